"""The configuration reference: docs/configuration.md is the command's output, and
every config field says what it means."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.engines.config import SchedulerConfig
from app.serving.config import ServeConfig
from app.serving.config_reference import (
    REGENERATE,
    bounds_text,
    collect_sections,
    fields_without_description,
    serve_config_reference,
)

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
def test_committed_reference_matches_the_command():
    assert DOC.read_text() == serve_config_reference(), (
        f"docs/configuration.md is stale; regenerate it: {REGENERATE}")


def test_every_field_has_a_description():
    missing = sorted(fields_without_description(ServeConfig))
    assert not missing, f"fields without a description: {missing}"


def test_nested_sections_and_bounds_are_found():
    sections = {s.path: s for s in collect_sections(ServeConfig)}
    assert {"", "cluster", "cluster.groups[]", "cluster.groups[].engine",
            "cluster.groups[].engine.scheduler", "routing"} <= set(sections)
    assert bounds_text(SchedulerConfig.model_fields["max_num_seqs"]) == "> 0"
    port = next(f for f in sections[""].fields if f.path == "http_port")
    assert (port.default, port.bounds) == ("8000", ">= 1, <= 65535")
