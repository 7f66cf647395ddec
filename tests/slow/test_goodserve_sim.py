"""GoodServe against load balancers on a small heterogeneous cluster (seeded)."""

from __future__ import annotations

import pytest
import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, run_replay
from app.routing.registry import PolicyKind
from benchmarks.bimodal_goodput import PAPER_CLUSTER, bimodal_workload

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", range(5))
def test_goodserve_meets_more_deadlines_than_load_balancers(seed):
    """Every seed, SLO scales 1-3, GoodServe with its label-free default predictor
    (the running history). Before confident placement it lost to least-request at
    scale 2 on seeds 0, 2 and 4: long generations predicted short went to weak GPUs.
    Before the cold-start rule (`pick_while_cold`) it lost to preble at scale 3 on
    seeds 0-3: in the first ~15 s the history, with no long generation
    finished yet, called them short and just-enough sent them to the A40. Preble with
    its load rebalancing (the faithful baseline) ties it at scale 3: within 2% on every
    seed (ahead on seeds 1 and 4)."""
    workload = bimodal_workload(20.0, 60.0, seed)
    spec = ReplaySpec(
        load_cluster_config(PAPER_CLUSTER),
        (PolicyKind.GOODSERVE, PolicyKind.LEAST_REQUEST, PolicyKind.ROUND_ROBIN,
         PolicyKind.PREBLE),
        (1.0, 2.0, 3.0), seed=seed,
    )
    met = {(cell.policy, cell.slo_scale): cell.summary["met"]
           for cell in run_replay(spec, workload)}
    for scale in (1.0, 2.0, 3.0):
        assert met["goodserve", scale] > met["least-request", scale], (scale, met)
        assert met["goodserve", scale] > met["round-robin", scale], (scale, met)
    assert met["goodserve", 3.0] >= 0.98 * met["preble", 3.0], met


def test_bimodal_benchmark_prints_met_requests_per_seed():
    from typer.testing import CliRunner

    from benchmarks.bimodal_goodput import main

    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, ["--seeds", "0,1", "--slo-scales", "2",
                                      "--policies", "least-request", "--duration", "10"])
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.output.splitlines() if line.startswith("| least")]
    counts = row.split("|")[3].split(" / ")
    assert len(counts) == 2 and all(0 < int(c) <= 200 for c in counts)
    bad = CliRunner().invoke(app, ["--policies", "nope", "--duration", "10"])
    assert bad.exit_code != 0 and "unknown policy 'nope'" in bad.output
