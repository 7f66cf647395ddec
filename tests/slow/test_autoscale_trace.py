"""`goodserve autoscale` on a Mooncake-style trace: static pools sized for the peak,
saturation scaling and SARA, each run whole through the CLI."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from tests.unit.test_autoscale import small_experiment

pytestmark = pytest.mark.slow


def test_autoscale_prints_one_json_object_keyed_by_strategy(tmp_path):
    trace, config = small_experiment(tmp_path)
    result = CliRunner().invoke(cli, ["autoscale", "--trace", str(trace), "--config", str(config),
                                      "--strategies", "static-peak,saturation,sara", "--json",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert list(summary) == ["static-peak", "saturation", "sara"]
    for figures in summary.values():
        assert set(figures) >= {"goodput_rps", "slo_attainment", "gpu_hours", "cost_usd",
                                "met_per_dollar", "lost", "migrations"}
        assert figures["lost"] == 0 and figures["cost_usd"] > 0
    assert summary["sara"]["engines_started"] > 0 == summary["static-peak"]["engines_started"]
    for name in ("summary.json", "timeline.csv", "goodput.csv", "autoscale.png"):
        assert (tmp_path / "out" / name).exists()
    with (tmp_path / "out" / "timeline.csv").open() as f:
        held: dict[float, int] = {}
        for row in csv.DictReader(f):
            if row["strategy"] == "sara":
                t = float(row["time_s"])
                held[t] = held.get(t, 0) + int(row["serving"]) + int(row["starting"])
    sizes = [held[t] for t in sorted(held)]
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes)  # grew for the peak, shrank after
