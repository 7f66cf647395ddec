"""`goodserve replay --backend live`: a workload replayed through the Serve router."""

from __future__ import annotations

import pytest

from app.config import EngineConfig, InstanceGroup

pytestmark = pytest.mark.integration


def test_live_replay_scores_every_request_of_each_cell(ray_session):
    """`replay --backend live` machinery on its own small cluster: every request comes
    back with its measured outcome, its prompt length reproduced exactly."""
    from app.config import ClusterConfig
    from app.routing.registry import PolicyKind
    from app.workload import Content, poisson_workload
    from benchmarks.replay import ReplaySpec, run_live_replay

    cluster = ClusterConfig(name="replay", groups=[
        InstanceGroup(engine=EngineConfig(gpu_type=g)) for g in ("H800", "A40")])
    pool = [Content(300, 20, block_hashes=(1, 2)), Content(120, 40)]
    workload = poisson_workload(4.0, 2.0, pool, seed=1)
    spec = ReplaySpec(cluster, (PolicyKind.GOODSERVE, PolicyKind.ROUND_ROBIN), (2.0,))
    outcomes = run_live_replay(spec, workload)
    assert [o.policy for o in outcomes] == ["goodserve", "round-robin"]
    for outcome in outcomes:
        assert len(outcome.records) == len(workload)
        assert all(r.finish_s is not None and r.num_generated_tokens == r.num_output_tokens
                   for r in outcome.records)
        assert outcome.summary["met"] + outcome.summary["violated"] == len(workload)
    round_robin = {tuple(r.instance_ids) for r in outcomes[1].records}
    assert round_robin == {("replay-H800-0",), ("replay-A40-1",)}
