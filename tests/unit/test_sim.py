"""Discrete-event simulator: ordering, conservation, routing hooks, migration, P/D."""

from __future__ import annotations

import dataclasses
import heapq
import math

import pytest

from app.engines.config import EngineRole, SchedulerConfig
from app.engines.messages import EngineStatus
from app.hardware.kv_link import KvLink
from app.hardware.specs import make_instance
from app.routing.base import ActiveRequest, Reject, RoutingPolicy, Watchdog
from app.routing.baselines import LeastRequestPolicy, RandomPolicy
from app.routing.disaggregated import LeastTtftPolicy
from app.routing.move_path import MoveRule
from app.routing.priority import PriorityRule
from app.routing.view import ClusterView, FinishReport, RouteRequest, StepReport
from app.sim.events import ArrivalEvent, EventKind, StepEndEvent, StepStartEvent, heap_key
from app.sim.instance import InstanceSetup, Pool, SimInstance
from app.sim.metrics import summarize
from app.sim.records import RequestOutcome
from app.sim.simulator import Simulator
from app.workloads.workload import WorkloadRequest

pytestmark = pytest.mark.unit

MODEL = "llama-3.1-8b"


def make_setups(*gpus: str, role: EngineRole = EngineRole.UNIFIED, **knobs) -> list[InstanceSetup]:
    scheduler = SchedulerConfig(**knobs)
    return [InstanceSetup(make_instance(g, MODEL, 2 if g == "V100" else 1), scheduler, role)
            for g in gpus]


def make_requests(
    n: int, prompt: int = 256, output: int = 32, gap_s: float = 0.01, slo_s: float = math.inf
) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", i * gap_s, prompt + i % 7, output + i % 5, slo_s=slo_s)
            for i in range(n)]


def run(setups, requests, policy: RoutingPolicy | None = None, **kwargs):
    return Simulator(setups, policy or LeastRequestPolicy(seed=0), **kwargs).run(requests)


def assert_conserved(result) -> None:
    """Every request ends met, violated or rejected; generated tokens add up."""
    outcomes = {r.outcome for r in result.records}
    assert outcomes <= {RequestOutcome.MET, RequestOutcome.VIOLATED, RequestOutcome.REJECTED}
    assert sum(r.num_generated_tokens for r in result.records) == result.num_token_events
    for r in result.records:
        if r.finish_s is not None:
            assert r.num_generated_tokens == r.num_output_tokens
            assert r.arrival_s <= r.first_token_s <= r.finish_s


# ---- events ---------------------------------------------------------------------------


def test_heap_key_orders_by_time_then_kind_then_seq() -> None:
    inst = SimInstance("x", make_setups("A40")[0], 0)
    events = [StepStartEvent(1.0, inst), ArrivalEvent(1.0, 0), ArrivalEvent(1.0, 1),
              ArrivalEvent(0.5, 2)]
    heap = [(*heap_key(e, seq), e) for seq, e in enumerate(events)]
    heapq.heapify(heap)
    popped = [heapq.heappop(heap)[-1] for _ in events]
    assert [type(e).__name__ for e in popped] == [
        "ArrivalEvent", "ArrivalEvent", "ArrivalEvent", "StepStartEvent"]
    assert [e.index for e in popped[:3]] == [2, 0, 1]
    assert StepEndEvent.KIND < ArrivalEvent.KIND < StepStartEvent.KIND
    assert EventKind.KV_TRANSFER_DONE < EventKind.ARRIVAL


def test_kv_link_is_fifo_with_bandwidth_service() -> None:
    link = KvLink(bandwidth_gbps=1.0)
    assert link.enqueue(0.0, 1e9) == pytest.approx(1.0)
    assert link.enqueue(0.5, 2e9) == pytest.approx(3.0)  # waits for the first
    assert link.enqueue(10.0, 1e9) == pytest.approx(11.0)  # idle link starts at once
    assert link.num_transfers == 3
    with pytest.raises(ValueError):
        KvLink(0.0)


# ---- views ------------------------------------------------------------------------------


def test_pool_snapshot_rebuilds_only_changed_views() -> None:
    setups = make_setups("H800", "A40")
    insts = [SimInstance(f"i{k}", s, k) for k, s in enumerate(setups)]
    pool = Pool(EngineRole.UNIFIED, insts)
    first = pool.snapshot(0.0)
    assert [v.instance_id for v in first.instances] == ["i0", "i1"]
    from app.sim.engine_core import SimSequence

    insts[1].core.add_request(SimSequence("a", 100, 4, 0.0))
    pool.mark_dirty(insts[1])
    second = pool.snapshot(1.0)
    assert second.instances[0] is first.instances[0]
    assert second.get("i1").num_waiting == 1 and first.get("i1").num_waiting == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.instances[0].num_waiting = 3  # type: ignore[misc]
    capped = pool.snapshot(1.0, max_outstanding=1)
    assert [v.instance_id for v in capped.instances] == ["i0"]


def test_view_prefix_hit_reads_the_instance_cache() -> None:
    hashes = (11, 12, 13)
    requests = [WorkloadRequest("a", 0.0, 1536, 2, hashes, 512),
                WorkloadRequest("b", 100.0, 1536, 2, hashes[:2] + (99,), 512)]
    seen: list[int] = []

    class Spy(LeastRequestPolicy):
        def choose(self, request, view, now):
            seen.append(view.prefix_hit_tokens(view.instances[0].instance_id, request))
            return view.instances[0].instance_id

    run(make_setups("A800"), requests, Spy())
    assert seen == [0, 1024]


# ---- conservation and outcomes ------------------------------------------------------------


def test_overload_loses_nothing_and_tokens_add_up() -> None:
    requests = make_requests(300, prompt=4000, output=64, gap_s=0.001, slo_s=2.0)
    result = run(make_setups("A40", "V100"), requests, RandomPolicy(seed=3))
    assert_conserved(result)
    summary = summarize(result.records, result.duration_s)
    assert summary.met + summary.violated + summary.rejected == 300
    assert summary.violated > 0 and summary.rejected == 0


def test_alone_on_reference_gpu_meets_scale_one_slo() -> None:
    spec = make_instance("A800", MODEL)
    request = WorkloadRequest("a", 0.0, 12000, 343, slo_s=spec.solo_latency_s(12000, 343))
    (record,) = run(make_setups("A800"), [request]).records
    assert record.outcome == RequestOutcome.MET
    assert record.e2e_s == pytest.approx(request.slo_s, rel=1e-5)


def test_rejections_are_recorded_with_reasons() -> None:
    class RejectOdd(LeastRequestPolicy):
        def choose(self, request, view, now):
            if int(request.request_id[1:]) % 2:
                return Reject("odd")
            return super().choose(request, view, now)

    result = run(make_setups("A40"), make_requests(10), RejectOdd(seed=0))
    rejected = [r for r in result.records if r.outcome == RequestOutcome.REJECTED]
    assert [r.request_id for r in rejected] == ["r1", "r3", "r5", "r7", "r9"]
    assert all(r.reject_reason == "odd" and r.finish_s is None for r in rejected)
    assert_conserved(result)


def test_request_too_large_for_every_instance_is_rejected() -> None:
    tiny = make_setups("A40", num_kv_blocks=64)  # 1024 tokens
    result = run(tiny, [WorkloadRequest("big", 0.0, 5000, 8), *make_requests(1)[:1]])
    assert result.records[0].outcome == RequestOutcome.REJECTED
    assert "no instance can hold" in result.records[0].reject_reason
    assert result.records[1].finish_s is not None


def test_unknown_instance_from_policy_is_an_error() -> None:
    class Bad(LeastRequestPolicy):
        def choose(self, request, view, now):
            return "nope"

    with pytest.raises(ValueError, match="nope"):
        run(make_setups("A40"), make_requests(1), Bad())


def test_unsorted_or_duplicate_requests_are_refused() -> None:
    requests = make_requests(3)
    with pytest.raises(ValueError, match="sorted"):
        run(make_setups("A40"), [requests[1], requests[0]])
    with pytest.raises(ValueError, match="unique"):
        run(make_setups("A40"), [requests[0], requests[0]])


def test_runs_are_deterministic_for_a_seed() -> None:
    requests = make_requests(80, gap_s=0.002)

    def finishes(seed: int) -> list[float | None]:
        result = run(make_setups("H800", "A40", "V100"), requests, RandomPolicy(seed=seed))
        return [(r.finish_s, tuple(r.instance_ids)) for r in result.records]

    assert finishes(1) == finishes(1)
    assert finishes(1) != finishes(2)


def test_drain_limit_counts_unfinished_as_violated() -> None:
    requests = make_requests(20, prompt=2000, output=500, gap_s=0.0)
    result = run(make_setups("A40", max_num_seqs=2), requests, max_drain_s=1.0)
    unfinished = [r for r in result.records if r.finish_s is None]
    assert unfinished and all(r.outcome == RequestOutcome.VIOLATED for r in unfinished)
    assert result.makespan_s <= 1.0
    assert_conserved(result)


# ---- decode runs ---------------------------------------------------------------------------


class StepLog(LeastRequestPolicy):
    """Least-request routing that keeps each instance's step reports."""

    def iterations(self) -> dict[str, list[tuple[float, float, int, int]]]:
        """Each instance's iterations as its reports told them: (start, duration,
        prefill tokens, decode sequences), a report's `now` its last one's end."""
        told: dict[str, list[tuple[float, float, int, int]]] = {}
        for instance_id, reports in self.steps.items():
            rows = told[instance_id] = []
            for report, now in reports:
                start_s = report.start_s
                for duration_s in report.durations_s:
                    rows.append((start_s, duration_s, report.num_prefill_tokens,
                                 report.num_decode_seqs))
                    start_s += duration_s
                assert start_s == now
        return told

    def statuses(self) -> dict[str, list[tuple[int, int, EngineStatus]]]:
        """Each instance's reports as (their first iteration, last, the status)."""
        spans: dict[str, list[tuple[int, int, EngineStatus]]] = {}
        for instance_id, reports in self.steps.items():
            rows = spans[instance_id] = []
            first = 0
            for report, _ in reports:
                rows.append((first, first + len(report.durations_s) - 1, report.status))
                first += len(report.durations_s)
        return spans

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.steps: dict[str, list[tuple[StepReport, float]]] = {}

    def on_step(self, instance_id, report, now):
        self.steps.setdefault(instance_id, []).append((report, now))


class MoveWaiting(Watchdog):
    """At each check, moves the checked instance's first waiting request to the
    instance with the most free KV (at most `limit` moves in all)."""

    def __init__(self, tau: int, limit: int) -> None:
        super().__init__(tau)
        self.limit = limit

    def check(self, instance_id, active, view: ClusterView, now):
        waiting = [a for a in active if not a.is_running]
        others = [v for v in view.instances if v.instance_id != instance_id]
        if not waiting or not others or self.limit == 0:
            return {}
        self.limit -= 1
        target = max(others, key=lambda v: v.num_kv_blocks_free).instance_id
        return {waiting[0].request.request_id: target}


@pytest.mark.parametrize("max_drain_s", [None, 4.0])
@pytest.mark.parametrize("priority", [PriorityRule.NONE, PriorityRule.DEADLINE])
def test_decode_runs_give_the_records_and_reports_of_one_event_per_iteration(
        max_drain_s, priority) -> None:
    """Arrivals onto busy engines, KV short enough to preempt, a watchdog that moves
    requests, a drain limit: bulk and per-iteration stepping agree on every record,
    every step report and the preemptions."""
    requests = [dataclasses.replace(r, slo_s=5.0 + i % 3)
                for i, r in enumerate(make_requests(40, prompt=120, output=150, gap_s=0.07))]
    scheduling = ("priority" if priority is PriorityRule.DEADLINE else "fcfs")
    setups = make_setups("H800", "A40", "V100", num_kv_blocks=80, max_num_seqs=6,
                         scheduling_policy=scheduling)

    def simulate(bulk: bool):
        policy = StepLog()
        result = run(setups, requests, policy, watchdog=MoveWaiting(tau=10, limit=6),
                     max_drain_s=max_drain_s, request_priority=priority, bulk_steps=bulk)
        return result, policy

    (bulk, bulk_log), (stepped, stepped_log) = simulate(True), simulate(False)
    assert [dataclasses.asdict(r) for r in bulk.records] == [
        dataclasses.asdict(r) for r in stepped.records]
    assert bulk_log.iterations() == stepped_log.iterations()
    stepped_statuses = {i: [status for *_, status in spans]
                        for i, spans in stepped_log.statuses().items()}
    for instance_id, spans in bulk_log.statuses().items():
        for first, last, status in spans:  # a report covers its iterations' status:
            assert status == stepped_statuses[instance_id][last]  # after the last,
            for each in stepped_statuses[instance_id][first:last]:  # with the starts and
                assert (each.num_finished, each.num_queue_wait_samples,  # finishes as
                        each.recent_queue_wait_s) == (  # after the first
                    status.num_finished, status.num_queue_wait_samples,
                    status.recent_queue_wait_s)
    assert max(last - first for spans in bulk_log.statuses().values()
               for first, last, _ in spans) > 0  # some reports covered several
    assert (bulk.makespan_s, bulk.num_token_events, bulk.num_preemptions) == (
        stepped.makespan_s, stepped.num_token_events, stepped.num_preemptions)
    assert stepped.num_preemptions > 0
    assert sum(r.num_migrations for r in stepped.records) > 0
    assert bulk.num_events < stepped.num_events / 2  # the runs took no events


# ---- router queue ------------------------------------------------------------------------


def test_admission_cap_queues_requests_at_the_router() -> None:
    requests = make_requests(3, gap_s=0.0)
    result = run(make_setups("A800"), requests, max_ongoing_requests=1)
    records = result.records
    assert records[0].finish_s <= records[1].first_token_s
    assert records[1].finish_s <= records[2].first_token_s
    assert_conserved(result)


# ---- callbacks and what a policy sees ----------------------------------------------------------


class Recorder(LeastRequestPolicy):
    needs_true_output_length = True

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.requests: list[RouteRequest] = []
        self.steps: list[StepReport] = []
        self.finishes: list[FinishReport] = []

    def choose(self, request, view, now):
        assert now == request.arrival_s and view.time_s == now
        self.requests.append(request)
        return super().choose(request, view, now)

    def on_step(self, instance_id, report, now):
        assert report.start_s + sum(report.durations_s) == pytest.approx(now)
        self.steps.append(report)

    def on_finish(self, report, now):
        self.finishes.append(report)


def test_policy_sees_request_fields_and_gets_callbacks() -> None:
    requests = [dataclasses.replace(r, predicted_output_tokens=40, prompt="hi", slo_s=5.0)
                for r in make_requests(12)]
    policy = Recorder()
    result = run(make_setups("H800", "A40"), requests, policy)
    seen = policy.requests[3]
    assert seen.true_output_tokens == requests[3].num_output_tokens
    assert seen.predicted_output_tokens == 40 and seen.prompt == "hi"
    assert seen.deadline_s == pytest.approx(requests[3].arrival_s + 5.0)
    assert len(policy.finishes) == 12
    assert {f.request.request_id for f in policy.finishes} == {r.request_id for r in requests}
    assert len(policy.steps) > 0
    assert policy.steps[-1].status.num_iterations > 0
    assert_conserved(result)


def test_true_output_length_is_hidden_from_ordinary_policies() -> None:
    seen: list[RouteRequest] = []

    class Spy(LeastRequestPolicy):
        def choose(self, request, view, now):
            seen.append(request)
            return super().choose(request, view, now)

    run(make_setups("A40"), make_requests(3), Spy())
    assert all(r.true_output_tokens is None for r in seen)


# ---- migration -----------------------------------------------------------------------------


class MoveAllOnce(Watchdog):
    """Moves every active request of `source` to `target` at its first check."""

    def __init__(self, source: str, target: str, tau: int) -> None:
        super().__init__(tau)
        self.source, self.target = source, target
        self.calls: list[tuple[str, list[ActiveRequest]]] = []

    def check(self, instance_id, active, view: ClusterView, now):
        self.calls.append((instance_id, list(active)))
        if instance_id != self.source or len(self.calls) > 1:
            return {}
        return {a.request.request_id: self.target for a in active}


class Pin(RoutingPolicy):
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id

    def choose(self, request, view, now):
        return self.instance_id


def test_watchdog_migrates_by_token_ids() -> None:
    requests = make_requests(4, prompt=500, output=200, gap_s=0.0)
    watchdog = MoveAllOnce("A40-0", "H800-0", tau=20)
    result = run(make_setups("A40", "H800"), requests, Pin("A40-0"), watchdog=watchdog,
                 move_rule=MoveRule.TOKEN_IDS)
    source, active = watchdog.calls[0]
    assert source == "A40-0" and len(active) == 4
    assert all(a.num_generated_tokens > 0 for a in active if a.is_running)
    for r in result.records:
        assert r.instance_ids == ["A40-0", "H800-0"] and r.num_migrations == 1
    assert summarize(result.records, 1.0).migrations == 4
    assert_conserved(result)
    unmigrated = run(make_setups("A40", "H800"), requests, Pin("A40-0"))
    assert max(r.finish_s for r in result.records) < max(r.finish_s for r in unmigrated.records)


def test_long_context_moves_carry_their_kv_when_that_is_cheaper() -> None:
    """30k-token contexts over a 50 GB/s link: loading the KV beats the H800
    recomputing it, so each move carries it (its bytes on the record) and the moved
    requests finish sooner than by token ids; over a 0.05 GB/s link they go by token
    ids."""
    requests = make_requests(3, prompt=30_000, output=300, gap_s=0.0)
    kv_per_token = make_instance("H800", MODEL).model.kv_bytes_per_token

    def moved(gbps: float, rule: MoveRule):
        watchdog = MoveAllOnce("A40-0", "H800-0", tau=20)
        result = run(make_setups("A40", "H800"), requests, Pin("A40-0"), watchdog=watchdog,
                     kv_link_gbps=gbps, move_rule=rule)
        assert_conserved(result)
        generated = {a.request.request_id: a.num_generated_tokens for a in watchdog.calls[0][1]}
        return result, generated

    fast, generated = moved(50.0, MoveRule.CHEAPER)
    for r in fast.records:
        assert r.num_migrations == 1 and r.num_kv_moves == 1
        assert r.kv_moved_bytes == (r.num_prompt_tokens + generated[r.request_id]) * kv_per_token
        assert r.kv_move_s > 0
    assert summarize(fast.records, 1.0).kv_moves == 3
    by_ids, _ = moved(50.0, MoveRule.TOKEN_IDS)
    assert all(r.num_kv_moves == 0 and r.kv_moved_bytes == 0 for r in by_ids.records)
    assert max(r.finish_s for r in fast.records) < max(r.finish_s for r in by_ids.records)
    slow, _ = moved(0.05, MoveRule.CHEAPER)
    assert sum(r.num_kv_moves for r in slow.records) == 0


@pytest.mark.parametrize("rule", list(PriorityRule))
def test_priority_engines_run_the_earliest_deadline_first_and_moves_keep_it(rule) -> None:
    """Four requests at once, latest deadline first, on one-slot engines in priority
    mode: by deadline under the deadline rule, else by arrival; moved together to
    another such engine, they run there in the same order."""
    requests = [WorkloadRequest(f"r{i}", 0.0, 300, 40, slo_s=40.0 - 10 * i) for i in range(4)]
    setups = make_setups("A40", "H800", max_num_seqs=1, scheduling_policy="priority")
    expected = ["r3", "r2", "r1", "r0"] if rule is PriorityRule.DEADLINE else [
        "r0", "r1", "r2", "r3"]

    def finish_order(result) -> list[str]:
        return [r.request_id for r in sorted(result.records, key=lambda r: r.finish_s)]

    assert finish_order(run(setups, requests, Pin("A40-0"), request_priority=rule)) == expected
    moved = run(setups, requests, Pin("A40-0"), watchdog=MoveAllOnce("A40-0", "H800-0", 5),
                request_priority=rule, move_rule=MoveRule.TOKEN_IDS)
    assert all(r.instance_ids == ["A40-0", "H800-0"] for r in moved.records)
    assert finish_order(moved) == expected
    assert_conserved(moved)


def test_a_policy_hears_each_first_token_once_where_and_when_it_came() -> None:
    """Moved after their first tokens, the requests produce no other: the policy hears
    one first token per request, from the instance that produced it, at its record's
    time (before its finish)."""
    heard: list[tuple[str, str, float, float]] = []

    class Hearing(Pin):
        def on_first_token(self, request, instance_id, first_token_s, now):
            heard.append((request.request_id, instance_id, first_token_s, now))

        def on_finish(self, report, now):
            assert report.request.request_id in {rid for rid, *_ in heard}

    requests = make_requests(4, prompt=500, output=200, gap_s=0.0)
    watchdog = MoveAllOnce("A40-0", "H800-0", tau=20)
    result = run(make_setups("A40", "H800"), requests, Hearing("A40-0"), watchdog=watchdog,
                 move_rule=MoveRule.TOKEN_IDS)
    assert all(a.num_generated_tokens > 0 for a in watchdog.calls[0][1])
    assert all(r.num_migrations == 1 for r in result.records)
    assert sorted(heard) == sorted((r.request_id, "A40-0", r.first_token_s, r.first_token_s)
                                   for r in result.records)


def test_bad_migration_target_is_an_error() -> None:
    watchdog = MoveAllOnce("A40-0", "A40-0", tau=5)
    with pytest.raises(ValueError, match="cannot migrate"):
        run(make_setups("A40", "H800"), make_requests(2, output=50), Pin("A40-0"),
            watchdog=watchdog)


# ---- disaggregated mode ----------------------------------------------------------------------


def test_prefill_decode_pools_transfer_kv_over_the_link() -> None:
    setups = make_setups("H800", role=EngineRole.PREFILL) + make_setups(
        "A40", "A800", role=EngineRole.DECODE)
    requests = make_requests(6, prompt=8000, output=20, gap_s=0.0) + [
        WorkloadRequest("one", 0.5, 300, 1)]
    heard: dict[str, str] = {}  # request id -> where its first token came from

    class Hearing(LeastRequestPolicy):
        def on_first_token(self, request, instance_id, first_token_s, now):
            heard[request.request_id] = instance_id

    result = run(setups, requests, Hearing(seed=1),
                 prefill_policy=LeastTtftPolicy(), kv_link_gbps=1.0)
    assert_conserved(result)
    assert heard == {r.request_id: "H800-0" for r in requests}  # the prefill engine's
    assert result.num_kv_transfers == 6  # the one-token request never leaves prefill
    by_id = {r.request_id: r for r in result.records}
    assert by_id["one"].instance_ids == [] and by_id["one"].finish_s is not None
    kv_s = 8000 * make_instance("A800", MODEL).model.kv_bytes_per_token / 1e9
    for r in result.records[:6]:
        assert r.prefill_instance_id == "H800-0"
        assert r.instance_ids[0] in {"A40-0", "A800-0"}
        assert r.finish_s >= r.first_token_s + kv_s


def test_mixed_roles_are_refused() -> None:
    setups = make_setups("H800") + make_setups("A40", role=EngineRole.DECODE)
    with pytest.raises(ValueError, match="mix"):
        run(setups, make_requests(1))
