"""Just-enough placement over HTTP, on a service of its own that no other test has used.

The placement depends on the router's history of finished lengths, so it gets a
`live_url` service (module-scoped) that no other test has sent requests to.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import (
    STRONGEST,
    WEAKEST,
    instance_specs,
    met_at_engine_pace,
    post,
)

pytestmark = pytest.mark.integration


def test_just_enough_live_weak_gpu_for_loose_deadlines_strong_for_tight(live_url):
    """On the idle cluster 100 tokens take ~3.6 s on the A40 and ~0.9 s on the H800.
    Alone with its own service on purpose: with no finished request yet the history
    predictor's default (256) capped by max_tokens gives the true 100 tokens, and the
    loose request's 100 then make the history right for the tight one."""
    loose = post(live_url, "/v1/completions", max_tokens=100, slo_s=20.0).json()
    tight = post(live_url, "/v1/completions", max_tokens=100, slo_s=2.0).json()
    assert loose["goodserve"]["instance_ids"] == [WEAKEST]
    assert tight["goodserve"]["instance_ids"] == [STRONGEST]
    specs = instance_specs(live_url)  # each met its deadline at its engine's pace
    assert met_at_engine_pace(loose["goodserve"], specs[WEAKEST], loose["usage"])
    assert met_at_engine_pace(tight["goodserve"], specs[STRONGEST], tight["usage"])
