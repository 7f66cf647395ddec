"""Elastic pools in the simulator: the controller's plan diffs applied in virtual time
(engines boot after a delay, drained engines stop when empty or hand their requests
over by token ids), with nothing lost and GPU time counted."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from app.control.controller import Controller, ControllerSettings, StageSlo
from app.control.plan import ScalingRules
from app.control.strategies import StaticScaler
from app.engines.config import EngineRole, SchedulerConfig
from app.hardware.specs import make_instance
from app.planning.inventory import DECODE, PREFILL, UNIFIED, PoolTargets, Stock
from app.planning.split import EngineKind
from app.routing.baselines import LeastRequestPolicy
from app.routing.move_path import MoveRule
from app.sim.elastic import ElasticPools
from app.sim.instance import InstanceSetup
from app.sim.records import RequestOutcome
from app.sim.simulator import Simulator
from app.workloads.sessions import file_workload
from app.workloads.workload import Workload, WorkloadRequest

pytestmark = pytest.mark.unit

MODEL = "llama-3.1-8b"
A800 = EngineKind("A800", 1, 256)
STOCK = (Stock(A800, 8, 2.0),)


def step_load(phases: tuple[tuple[float, float], ...], seed: int = 0) -> list[WorkloadRequest]:
    """Poisson arrivals, (rate, seconds) per phase."""
    rng = random.Random(seed)
    requests, t, end = [], 0.0, 0.0
    for rate, seconds in phases:
        end += seconds
        while (t := t + rng.expovariate(rate)) < end:
            requests.append(WorkloadRequest(f"r{len(requests)}", t, rng.randint(50, 600),
                                            rng.randint(20, 300), slo_s=20.0))
        t = end
    return requests


def setups(*roles: EngineRole) -> list[InstanceSetup]:
    return [InstanceSetup(make_instance("A800", MODEL), SchedulerConfig(), r) for r in roles]


def sara(roles: tuple[str, ...]) -> Controller:
    settings = ControllerSettings(MODEL, roles, STOCK, StageSlo(make_instance("A800", MODEL), 3.0),
                                  rules=ScalingRules(30.0, 30.0, 20.0), interval_s=10.0,
                                  startup_s=20.0)
    return Controller(settings, 0.0)


def assert_nothing_lost(result) -> None:
    """Every request finished, and never on an engine after that engine was stopped."""
    records, stopped = result.records, result.elastic.stopped_s
    assert all(r.outcome in (RequestOutcome.MET, RequestOutcome.VIOLATED) for r in records)
    assert all(r.finish_s is not None and r.num_generated_tokens == r.num_output_tokens
               for r in records)
    assert all(r.finish_s <= stopped.get(r.instance_ids[-1], float("inf")) for r in records)


@pytest.mark.parametrize("roles", [(EngineRole.UNIFIED,), (EngineRole.PREFILL, EngineRole.DECODE)])
def test_a_step_up_grows_the_pools_and_the_step_down_shrinks_them(roles):
    requests = step_load(((3.0, 60.0), (30.0, 90.0), (3.0, 150.0)))
    pool_roles = tuple(r.value for r in roles)
    elastic = ElasticPools(sara(pool_roles), MODEL, STOCK, startup_s=20.0)
    result = Simulator(setups(*roles), LeastRequestPolicy(seed=0), elastic=elastic).run(requests)
    assert_nothing_lost(result)
    serving = [sum(s.serving.values()) for s in result.elastic.samples]
    peak = max(serving)
    assert serving[0] == len(roles) and peak > len(roles)
    assert serving[-1] < peak  # shrunk after the load fell
    stats = result.elastic
    assert stats.num_started >= peak - len(roles) and stats.num_stopped >= 1
    # GPU time lies between the initial pools held throughout and the peak held throughout
    assert len(roles) * result.makespan_s < stats.gpu_seconds < peak * result.makespan_s
    assert stats.cost_usd == pytest.approx(stats.gpu_hours * 2.0)
    started_roles = {role for step in elastic.steps for role, _ in step.diff.start}
    assert started_roles <= set(pool_roles) | {UNIFIED}


def test_engines_join_only_after_their_start_up_time():
    targets = PoolTargets(0.0, {UNIFIED: {A800: 3}}, 6.0, True)
    scaler = StaticScaler(interval_s=5.0, rules=ScalingRules(0.0, 0.0, 10.0), fixed=targets)
    elastic = ElasticPools(scaler, MODEL, STOCK, startup_s=12.0)
    requests = step_load(((20.0, 40.0),))
    result = Simulator(setups(EngineRole.UNIFIED), LeastRequestPolicy(seed=0),
                       elastic=elastic).run(requests)
    assert_nothing_lost(result)
    first = [(s.time_s, s.serving.get(UNIFIED, 0), s.starting.get(UNIFIED, 0))
             for s in result.elastic.samples[:4]]
    t0 = requests[0].arrival_s
    assert first[0] == pytest.approx((t0 + 5.0, 1, 2))  # started at the first step
    assert first[2][1] == 1 and first[3][1] == 3  # serving from 5 + 12 s on
    used = {i for r in result.records for i in r.instance_ids}
    assert len(used) == 3
    late = [r for r in result.records if any("-x" in i for i in r.instance_ids)]
    assert late and min(r.arrival_s for r in late) >= t0 + 17.0 - 1e-9


def drain_to_one(bulk_steps: bool = True):
    """Four engines, a static target of one: three drain at the first step, with long
    requests still on them; past the 2 s deadline those move by token ids."""
    requests = [WorkloadRequest(f"r{i}", 0.01 * i, 200, 2000, slo_s=1e9) for i in range(40)]
    targets = PoolTargets(0.0, {UNIFIED: {A800: 1}}, 2.0, True)
    scaler = StaticScaler(interval_s=1.0, rules=ScalingRules(0.0, 0.0, 2.0), fixed=targets)
    elastic = ElasticPools(scaler, MODEL, STOCK, startup_s=0.0)
    return Simulator(setups(*[EngineRole.UNIFIED] * 4), LeastRequestPolicy(seed=0),
                     elastic=elastic, bulk_steps=bulk_steps).run(requests)


def test_drained_engines_hand_their_requests_over_after_the_deadline():
    result = drain_to_one()
    assert_nothing_lost(result)
    stats = result.elastic
    assert stats.num_drain_migrations > 0 and stats.num_stopped == 3
    moved = [r for r in result.records if r.num_migrations]
    assert moved and len({r.instance_ids[-1] for r in moved}) == 1  # onto the one kept
    assert result.elastic.samples[-1].serving == {UNIFIED: 1}


def test_moves_off_draining_engines_cut_their_decode_runs_without_changing_a_record():
    bulk, stepped = drain_to_one(), drain_to_one(bulk_steps=False)
    assert bulk.records == stepped.records and bulk.elastic == stepped.elastic
    assert bulk.num_events < stepped.num_events / 2


def test_a_decode_engine_with_kv_on_its_way_is_not_stopped():
    # P/D: the scaler wants one decode engine of two; the drained one still has
    # transfers in flight at the first step and must hold them until they land
    requests = [WorkloadRequest(f"r{i}", 0.001 * i, 4000, 50, slo_s=1e9) for i in range(30)]
    targets = PoolTargets(0.0, {PREFILL: {A800: 1}, DECODE: {A800: 1}}, 4.0, True)
    scaler = StaticScaler(interval_s=0.05, rules=ScalingRules(0.0, 0.0, 100.0), fixed=targets)
    elastic = ElasticPools(scaler, MODEL, STOCK, startup_s=0.0)
    result = Simulator(setups(EngineRole.PREFILL, EngineRole.DECODE, EngineRole.DECODE),
                       LeastRequestPolicy(seed=0), kv_link_gbps=0.5, elastic=elastic
                       ).run(requests)
    assert_nothing_lost(result)
    assert result.elastic.num_stopped == 1


def test_elastic_pools_reject_a_negative_start_up_time():
    with pytest.raises(ValueError, match="start-up"):
        ElasticPools(sara((UNIFIED,)), MODEL, STOCK, startup_s=-1.0)


# ---- agent sessions across a scale-down -------------------------------------------------

def session_log(tmp_path, num_sessions: int, tool_wait_s: float) -> Workload:
    """Sessions of two steps: a 30k-token context, then 200 tokens more after a tool."""
    rows = []
    for i in range(num_sessions):
        rows.append({"session_id": f"s{i}", "step_id": "0", "parent": None,
                     "input_tokens": 30_000, "output_tokens": 20, "arrival_ms": 100 * i})
        rows.append({"session_id": f"s{i}", "step_id": "1", "parent": "0",
                     "input_tokens": 30_220, "appended_tokens": 200, "output_tokens": 20,
                     "tool_wait_ms": 1000 * tool_wait_s})
    path = tmp_path / "sessions.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    workload = file_workload(path)
    return workload.with_requests([replace(r, slo_s=1e9) for r in workload.requests])


def run_drain(workload: Workload, interval_s: float, rule: MoveRule,
              kv_link_gbps: float = 25.0):
    """Two unified A800s, a static target of one: one drains at the first step."""
    targets = PoolTargets(0.0, {UNIFIED: {A800: 1}}, 2.0, True)
    scaler = StaticScaler(interval_s=interval_s, rules=ScalingRules(0.0, 0.0, 100.0),
                          fixed=targets)
    elastic = ElasticPools(scaler, MODEL, STOCK, startup_s=0.0)
    result = Simulator(setups(EngineRole.UNIFIED, EngineRole.UNIFIED),
                       LeastRequestPolicy(seed=0), elastic=elastic, move_rule=rule,
                       kv_link_gbps=kv_link_gbps).run(workload)
    (drained,) = elastic.steps[0].diff.drain
    return result, drained


@pytest.mark.parametrize("interval_s", [2.0, 15.0])  # steps in flight / tools running
def test_a_draining_engine_hands_the_sessions_contexts_over_and_loses_no_step(
        tmp_path, interval_s):
    """Whether the drain finds a session's step running (it finishes there) or waiting on
    a tool, its context leaves the draining engine: moved as KV, the next step reuses it
    on the engine kept; by token ids, the next step recomputes it. Nothing is lost."""
    workload = session_log(tmp_path, 4, tool_wait_s=30.0)
    moved, drained = run_drain(workload, interval_s, MoveRule.CHEAPER)
    recomputed, drained_again = run_drain(workload, interval_s, MoveRule.TOKEN_IDS)
    assert drained == drained_again
    for result in (moved, recomputed):
        assert_nothing_lost(result)
        assert result.elastic.num_stopped == 1
        assert {r.instance_ids[-1] for r in result.records
                if r.request_id.endswith("/1")} != {drained}  # next steps on the kept one
    there = {r.request_id.split("/")[0] for r in moved.records
             if r.request_id.endswith("/0") and r.instance_ids[-1] == drained}
    assert there and moved.elastic.num_contexts_moved == len(there)
    assert moved.elastic.context_moved_bytes > 0 and moved.elastic.num_contexts_recomputed == 0
    assert recomputed.elastic.num_contexts_recomputed == len(there)
    assert recomputed.elastic.num_contexts_moved == 0

    def ttft(result, session: str) -> float:
        (record,) = [r for r in result.records if r.request_id == f"{session}/1"]
        return record.first_token_s - record.arrival_s

    for session in there:  # the moved context saves the next step's 30k-token recompute
        assert ttft(moved, session) < 0.5 * ttft(recomputed, session)


def test_a_draining_engine_is_not_stopped_while_contexts_are_leaving_it(tmp_path):
    """Two 30k-token contexts (3.9 GB each) over a 0.5 GB/s link take 16 s: the engine,
    empty of requests by 7 s, stops at the first decision after both have landed."""
    workload = session_log(tmp_path, 4, tool_wait_s=60.0)
    result, drained = run_drain(workload, 2.0, MoveRule.KV, kv_link_gbps=0.5)
    assert_nothing_lost(result)
    assert result.elastic.num_contexts_moved == 2
    kv_bytes = 30_000 // 256 * 256 * make_instance("A800", MODEL).model.kv_bytes_per_token
    assert result.elastic.context_moved_bytes == pytest.approx(2 * kv_bytes)
    assert result.elastic.stopped_s[drained] >= 2 * kv_bytes / 0.5e9
