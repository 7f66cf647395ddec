"""GoodServe against load balancers on a small heterogeneous cluster (seeded)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from app.config import load_cluster_config
from app.routing.registry import PolicyKind
from app.workload import Content, poisson_workload
from benchmarks.replay import ReplaySpec, run_replay

pytestmark = pytest.mark.integration

PAPER_CLUSTER = Path(__file__).resolve().parents[2] / "configs" / "paper-4gpu.yaml"


def mixed_contents(n: int, seed: int) -> list[Content]:
    """Short chats and long generations: deadlines (scale x solo time) differ widely."""
    rng = random.Random(seed)
    return [
        Content(rng.randint(100, 2000), rng.choice([rng.randint(20, 120), rng.randint(400, 900)]))
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_goodserve_meets_more_deadlines_than_load_balancers(seed):
    """Every seed, SLO scales 1 and 2, GoodServe with its label-free default predictor
    (the running history). Before confident placement it lost to least-request at
    scale 2 on seeds 0, 2 and 4: long generations predicted short went to weak GPUs."""
    workload = poisson_workload(20.0, 60.0, mixed_contents(500, seed=seed), seed=seed)
    spec = ReplaySpec(
        load_cluster_config(PAPER_CLUSTER),
        (PolicyKind.GOODSERVE, PolicyKind.LEAST_REQUEST, PolicyKind.ROUND_ROBIN),
        (1.0, 2.0), seed=seed,
    )
    met = {(cell.policy, cell.slo_scale): cell.summary["met"]
           for cell in run_replay(spec, workload)}
    for scale in (1.0, 2.0):
        assert met["goodserve", scale] > met["least-request", scale], (scale, met)
        assert met["goodserve", scale] > met["round-robin", scale], (scale, met)
