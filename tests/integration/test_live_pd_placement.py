"""Disaggregated just-enough over HTTP, on a service of its own (the history of finished
lengths must be empty, as in test_live_placement.py): the decode stage of a tight
request lands on the fast decode GPU, a loose one on the slow one."""

from __future__ import annotations

import pytest

from tests.integration.conftest import instance_specs, met_at_engine_pace, pd_service, post

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pd_url(ray_session):
    with pd_service("live-pdp") as (url, _):
        yield url


def test_tight_deadline_decodes_on_the_fast_gpu_loose_on_the_slow_one(pd_url):
    """100 tokens decode in ~1.7 s on 2x V100 and ~3.5 s on the A40 (idle, catalog)."""
    loose = post(pd_url, "/v1/completions", max_tokens=100, slo_s=20.0).json()
    tight = post(pd_url, "/v1/completions", max_tokens=100, slo_s=2.8).json()
    assert loose["goodserve"]["decode_instance"] == "live-pdp-decode-A40-2"
    assert tight["goodserve"]["decode_instance"] == "live-pdp-decode-2xV100-3"
    specs = instance_specs(pd_url)  # each met its deadline at its decode engine's pace
    for reply in (loose, tight):
        summary = reply["goodserve"]
        assert met_at_engine_pace(summary, specs[summary["decode_instance"]], reply["usage"])
