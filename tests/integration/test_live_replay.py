"""`goodserve replay --backend live`: a workload replayed through the Serve router."""

from __future__ import annotations

import pytest

from app.engines.config import EngineConfig, InstanceGroup

pytestmark = pytest.mark.integration


def test_live_replay_scores_every_request_of_each_cell(ray_session):
    """`replay --backend live` machinery on its own small cluster: every request comes
    back with its measured outcome, its prompt length reproduced exactly."""
    from app.engines.config import ClusterConfig
    from app.experiments.replay import ReplaySpec, run_live_replay
    from app.routing.registry import PolicyKind
    from app.workloads.workload import Content, poisson_workload

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
        # the router's first-token time, from its own arrival, within the client's e2e
        assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in outcome.records)
        assert outcome.summary["met"] + outcome.summary["violated"] == len(workload)
    round_robin = {tuple(r.instance_ids) for r in outcomes[1].records}
    assert round_robin == {("replay-H800-0",), ("replay-A40-1",)}


def test_live_replay_issues_agent_steps_after_their_parents(ray_session):
    """Closed loop over HTTP: each session step is sent only once every step it waits
    for has come back, plus its tool wait; a fan-out's join waits for both branches."""
    from app.engines.config import ClusterConfig
    from app.experiments.replay import ReplaySpec, run_live_replay
    from app.routing.registry import PolicyKind
    from app.workloads.sessions import AgentSession, AgentStep, sessions_workload

    def step(step_id, wait_for=(), wait_s=0.0, prompt=600):
        return AgentStep(step_id, tuple(wait_for), wait_s, prompt, 100, 12,
                         tuple(range(prompt // 256)), 256)

    sessions = [AgentSession(f"s{i}", 0.3 * i, (
        step("0"), step("1", ["0"], 0.4, 800), step("2", ["0"], 0.2, 900),
        step("3", ["1", "2"], 0.3, 1200))) for i in range(3)]
    workload = sessions_workload(sessions, 1.0, "sessions")
    cluster = ClusterConfig(name="agents", groups=[
        InstanceGroup(engine=EngineConfig(gpu_type=g)) for g in ("H800", "A40")])
    outcome, = run_live_replay(ReplaySpec(cluster, (PolicyKind.LEAST_REQUEST,), (3.0,)),
                               workload)
    records = {r.request_id: r for r in outcome.records}
    assert len(records) == len(workload)
    assert all(r.finish_s is not None for r in records.values())
    for child, parents in enumerate(workload.graph.parents):
        if not parents:
            continue
        last = max(records[workload.requests[p].request_id].finish_s for p in parents)
        issued = records[workload.requests[child].request_id].arrival_s
        assert issued >= last + workload.graph.tool_wait_s[child] - 0.05
