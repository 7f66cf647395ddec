"""GoodServe under bursty arrivals against the policies it used to lose to (seeded)."""

from __future__ import annotations

import random

import pytest

from app.config import load_cluster_config
from app.experiments.replay import ReplaySpec, run_replay
from app.routing.goodserve import GoodServeConfig
from app.routing.registry import PolicyKind, RoutingOptions
from app.workload import Arrivals, Content, SyntheticArrivals, synthetic_workload
from benchmarks.bimodal_goodput import PAPER_CLUSTER

pytestmark = pytest.mark.slow


def chat_contents(n: int, seed: int) -> list[Content]:
    """Chat-like requests: short prompts, log-normal answers (median ~180 tokens)."""
    rng = random.Random(seed)
    return [Content(rng.randint(20, 400), max(1, min(2000, int(rng.lognormvariate(5.2, 0.8)))))
            for _ in range(n)]


def test_goodserve_meets_as_many_deadlines_as_round_robin_and_slo_pack_in_bursts():
    """Gamma arrivals with CV 13 (bursts of near-simultaneous requests, then lulls) at
    150 req/s on the paper cluster, SLO scale 1: GoodServe with triage, here on the
    label-free history (where it is off by default: docs/goodserve-routing.md,
    "Bursty arrivals and triage").

    Without triage GoodServe met 40 against round-robin's 61: every request that could
    no longer make its deadline took the least-loaded fast instance, so the bursts
    queued ahead of the requests that still could, on every instance at once."""
    seed = 1
    workload = synthetic_workload(
        SyntheticArrivals(Arrivals.GAMMA, 150.0, 30.0, burstiness=13.0),
        chat_contents(500, seed), seed=seed)
    spec = ReplaySpec(
        load_cluster_config(PAPER_CLUSTER),
        (PolicyKind.GOODSERVE, PolicyKind.ROUND_ROBIN, PolicyKind.SLO_PACK), (1.0,), seed=seed,
        routing=RoutingOptions(seed, GoodServeConfig(triage=True)),
    )
    met = {cell.policy: cell.summary["met"] for cell in run_replay(spec, workload)}
    assert met["goodserve"] >= met["round-robin"], met
    assert met["goodserve"] >= met["slo-pack"], met
