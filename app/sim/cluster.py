"""Cluster state machine driven by the simulator's events.

Every public method is an event handler body: it takes the event time, mutates
the cluster and returns the follow-up events. Routing, migration and feedback go
through the same policy / watchdog objects the live router uses.

Decode runs. Most iterations repeat their engine's batch one token further, and
nothing but the engine and its step listeners notices them. When an iteration begins,
the engine plans the ones after it that would repeat its batch (`SimEngineCore.plan_run`,
up to the next that finishes a request or might preempt; their times priced in one
compiled call), and only the last gets a StepEndEvent; the others are applied in
`settle`, which the simulator calls before every event, as if each had had its own
event. An engine's iterations between two reads of it are applied together and reach
the step listeners in one report (`StepReport` with their durations): before an event
that touches other engines than its own (an arrival routes) every engine catches up;
before an engine's own iteration start or end only that engine does. Step listeners
thus hear each engine's iterations in order and before any decision after them, though
not interleaved in time with other engines' (a status estimator keeps one state per
engine, so it ends up the same). A watchdog check that falls inside a run is a decision
too: `settle` takes the checks in time order, each once its engine is applied up to
it; the check's view builds the other engines' views only when the check reads them,
after applying their iterations that ended before it (`_watch`), and the run goes on
unless the check moved a request. Whatever adds a request to an engine or takes one off
it (`_admit`, `migrate`), or a router queue that starts to hold requests (every entry
engine's iteration end then drains it), cuts the run: the iteration in flight ends by
an event, the next batch is formed anew. An iteration that would end exactly at another
event's time ends by an event too, so it still comes before arrivals and batches formed
at that time; only among iteration ends of several engines at one instant may the order
differ from stepping. Otherwise runs give the same records as one event pair per
iteration (`bulk_steps=False`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from app.engines.config import EngineRole
from app.engines.messages import RequestStatus, TokenEvent
from app.hardware.kv_link import KvLink
from app.routing.base import ActiveRequest, Listeners, Reject, RoutingPolicy, Watchdog
from app.routing.context_keeping import ContextKeeper
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy
from app.routing.instance_view import InstanceId
from app.routing.move_path import MovePath, MoveRule, plan_move
from app.routing.priority import PriorityRule
from app.routing.view import FinishReport, StepReport
from app.sim.engine_core import DecodeRun, ScheduledStep, SimSequence
from app.sim.events import (
    ArrivalEvent,
    ElasticHooks,
    Event,
    KvTransferDoneEvent,
    StepEndEvent,
    StepStartEvent,
)
from app.sim.flight import SimFlight
from app.sim.instance import InstanceSetup, Pool, SimInstance
from app.sim.records import RequestOutcome, RequestRecord
from app.workloads.sessions import StepReleases
from app.workloads.workload import WorkloadRequest

MAX_RUN_ITERATIONS = 64  # a longer run is planned again at its last iteration (and
# `SimInstance.run_budget` may plan it shorter)


def build_pools(setups: Sequence[InstanceSetup]) -> dict[EngineRole, Pool]:
    """Group instances by role; ids are '<instance name>-<n>' (e.g. 'H800-0', '2xV100-1')."""
    if not setups:
        raise ValueError("the cluster has no instances")
    roles = {s.role for s in setups}
    if EngineRole.UNIFIED in roles and len(roles) > 1:
        raise ValueError("mix of unified and prefill/decode instances")
    if EngineRole.UNIFIED not in roles and roles != {EngineRole.PREFILL, EngineRole.DECODE}:
        raise ValueError("disaggregated mode needs both prefill and decode instances")
    counters: dict[str, int] = {}
    members: dict[EngineRole, list[SimInstance]] = {role: [] for role in roles}
    for setup in setups:
        n = counters.get(setup.spec.name, 0)
        counters[setup.spec.name] = n + 1
        group = members[setup.role]
        group.append(SimInstance(f"{setup.spec.name}-{n}", setup, len(group)))
    return {role: Pool(role, group) for role, group in members.items()}


class SimCluster:
    """All instances, the router queue, the KV link and the per-request records."""

    def __init__(
        self,
        setups: Sequence[InstanceSetup],
        releases: StepReleases,
        policy: RoutingPolicy,
        *,
        prefill_policy: LeastTtftPolicy | None,
        watchdog: Watchdog | None,
        kv_link_gbps: float,
        max_ongoing_requests: int | None,
        seed: int,
        elastic: ElasticHooks | None = None,
        move_rule: MoveRule = MoveRule.CHEAPER,
        request_priority: PriorityRule = PriorityRule.NONE,
        bulk_steps: bool = True,
        context_keeper: ContextKeeper | None = None,
    ) -> None:
        self.pools = build_pools(setups)
        self.elastic = elastic
        self.disaggregated = EngineRole.PREFILL in self.pools
        self.entry_role = EngineRole.PREFILL if self.disaggregated else EngineRole.UNIFIED
        self.serve_role = EngineRole.DECODE if self.disaggregated else EngineRole.UNIFIED
        if self.disaggregated and prefill_policy is None:
            prefill_policy = LeastTtftPolicy()
        self.releases = releases
        self.requests = releases.requests
        self.policy = policy
        self.watchdog = watchdog
        self.link = KvLink(kv_link_gbps)  # P->D hand-offs and KV moves share it
        self.move_rule = move_rule
        self.request_priority = request_priority
        self.pd_placer = (DisaggregatedPlacer(prefill_policy, policy, self.link)
                          if self.disaggregated and prefill_policy is not None else None)
        self.max_ongoing_requests = max_ongoing_requests
        self.seed = seed
        self.listeners = Listeners.of(policy, prefill_policy, watchdog)
        self.reveal_lengths = any(getattr(x, "needs_true_output_length", False)
                                  for x in self.listeners.every)
        self.router_queue: deque[SimFlight] = deque()
        self.flights: dict[str, SimFlight] = {}  # request_id -> in-flight state
        self.records: list[RequestRecord] = []
        self.num_done = 0  # finished or rejected
        self.num_token_events = 0
        self.max_run_iterations = MAX_RUN_ITERATIONS if bulk_steps else 1
        # (end of an iteration in flight, tie-break, its instance, the run, its index)
        self._runs: list[tuple[float, int, SimInstance, DecodeRun, int]] = []
        # (end of a run's iteration that ends with a watchdog check, the same)
        self._checks: list[tuple[float, int, SimInstance, DecodeRun, int]] = []
        self._run_seq = itertools.count()
        self.quiet_end_s = 0.0  # end of the latest iteration applied by `settle`
        # sessions' contexts kept through tool waits (unified engines): who decides,
        # where each is pinned, and when each session's last step ended
        self.context_keeper = None if self.disaggregated else context_keeper
        self._pinned: dict[str, SimInstance] = {}
        self._step_ended_s: dict[str, float] = {}

    # ---- arrivals and routing ----------------------------------------------
    def arrive(self, index: int, now: float) -> list[Event]:
        events: list[Event] = []
        following = self.releases.after_arrival(index)
        if following is not None:
            events.append(ArrivalEvent(following.time_s, following.index))
        flight = self._new_flight(index, now)
        if self.context_keeper is not None:
            events.extend(self._session_back(flight.work, now))
        if self.elastic is not None:
            self.elastic.arrived(flight, now)
        if self.router_queue:
            self.router_queue.append(flight)  # FIFO behind earlier queued requests
            return events
        routed = self._try_route(flight, now)
        if routed is None:
            self.router_queue.append(flight)  # entry engines' iteration ends drain it now
            for inst in self.pools[self.entry_role].instances:
                events.extend(self._interrupt(inst))
        else:
            events.extend(routed)
        return events

    def _new_flight(self, index: int, now: float) -> SimFlight:
        work = self.releases.issued(index, now)
        route = work.route_request(reveal_true_length=self.reveal_lengths)
        if self.request_priority is not PriorityRule.NONE:
            route = replace(route, priority=self.request_priority.priority(route.deadline_s))
        record = self._record(work)
        flight = SimFlight(index, work, route, record, token_seed=self.seed * 1_000_003 + index)
        self.flights[work.request_id] = flight
        return flight

    def _try_route(self, flight: SimFlight, now: float) -> list[Event] | None:
        """Route one request; None when every entry instance is at the admission cap."""
        pool = self.pools[self.entry_role]
        view = pool.snapshot(now, self.max_ongoing_requests)
        if not view.instances:
            return None
        if not self.disaggregated:
            decision = self.policy.choose(flight.route, view, now)
            target = self._target(pool, flight, decision, type(self.policy).__name__)
            return [] if target is None else self._admit(flight, target, now)
        assert self.pd_placer is not None
        decode_pool = self.pools[EngineRole.DECODE]
        placement = self.pd_placer.place(flight.route, view, decode_pool.snapshot(now), now)
        if isinstance(placement, Reject):
            self._reject(flight, placement.reason)
            return []
        who = type(self.pd_placer).__name__
        target = self._target(pool, flight, placement.prefill_instance, who)
        decode = target and self._target(decode_pool, flight, placement.decode_instance, who)
        if target is None or decode is None:
            return []
        flight.decode_target = decode
        decode.inbound += 1
        flight.record.prefill_instance_id = target.instance_id
        return self._admit(flight, target, now)

    def _target(
        self, pool: Pool, flight: SimFlight, decision: InstanceId | Reject, who: str
    ) -> SimInstance | None:
        """The decided instance; a Reject or a target that cannot hold it is a rejection."""
        if isinstance(decision, Reject):
            self._reject(flight, decision.reason)
            return None
        target = pool.lookup(decision, who)
        need = flight.route.num_context_tokens
        if not target.fits(need):
            self._reject(flight, f"{target.instance_id} cannot hold {need} tokens")
            return None
        return target

    def _record(self, work: WorkloadRequest) -> RequestRecord:
        record = RequestRecord(
            request_id=work.request_id,
            arrival_s=work.arrival_s,
            deadline_s=work.deadline_s,
            slo_s=work.slo_s,
            num_prompt_tokens=work.num_prompt_tokens,
            num_output_tokens=work.num_output_tokens,
            predicted_output_tokens=work.predicted_output_tokens,
        )
        self.records.append(record)
        return record

    def _reject(self, flight: SimFlight, reason: str) -> None:
        flight.record.outcome = RequestOutcome.REJECTED
        flight.record.reject_reason = reason
        del self.flights[flight.route.request_id]
        self.num_done += 1
        self._cancel(self.releases.after_end(flight.index, flight.record.arrival_s, False)[1],
                     flight.route.request_id, flight.record.arrival_s)

    def _cancel(self, indices: Sequence[int], cause: str, now: float) -> None:
        """Steps of a session that cannot go on: never issued, counted as rejected."""
        for index in indices:
            record = self._record(replace(self.requests[index], arrival_s=now))
            record.outcome = RequestOutcome.REJECTED
            record.reject_reason = f"session ended: {cause} was not served"
            self.num_done += 1

    def _released(self, flight: SimFlight, inst: SimInstance, now: float) -> list[Event]:
        """Session steps that the end of `flight` on `inst` makes ready (closed loop);
        with a context keeper, the session's context may stay pinned there meanwhile."""
        ready, _ = self.releases.after_end(flight.index, now, True)
        events: list[Event] = [ArrivalEvent(r.time_s, r.index) for r in ready]
        if ready and self.context_keeper is not None:
            events.extend(self._keep_context(flight.work, inst, now))
        return events

    def _keep_context(self, work: WorkloadRequest, inst: SimInstance, now: float
                      ) -> list[Event]:
        """A session enters a tool wait: pin its context where it ran, for as long as
        the keeper says it is worth it."""
        assert self.context_keeper is not None and work.session_id is not None
        self._step_ended_s[work.session_id] = now
        until_s = self.context_keeper.keep_until(work.task or "", work.num_prompt_tokens,
                                                 inst.spec, now)
        if until_s is None:
            return []
        events = self._unpin(work.session_id) + self._interrupt(inst)
        if inst.core.pin(work.session_id, work.block_hashes, until_s):
            self._pinned[work.session_id] = inst
            self.pools[inst.role].mark_dirty(inst)
        return events

    def _session_back(self, work: WorkloadRequest, now: float) -> list[Event]:
        """A session's next step arrived: the keeper learns its tool wait, and its
        context, still cached, is no longer pinned (the step holds what it uses)."""
        assert self.context_keeper is not None
        ended_s = self._step_ended_s.pop(work.session_id or "", None)
        if ended_s is None:
            return []
        self.context_keeper.observe_wait(work.task or "", now - ended_s)
        return self._unpin(work.session_id or "")

    def _unpin(self, session_id: str) -> list[Event]:
        inst = self._pinned.pop(session_id, None)
        if inst is None:
            return []
        events = self._interrupt(inst)  # a decode run's blocks are counted from its start
        inst.core.unpin(session_id)
        self.pools[inst.role].mark_dirty(inst)
        return events

    def _admit(
        self, flight: SimFlight, inst: SimInstance, now: float, *, num_resumed: int = 0,
        skip_prefill: bool = False,
    ) -> list[Event]:
        """Hand the request to an engine (prefill instances only compute the first token)."""
        work = flight.work
        max_output = 1 if inst.role == EngineRole.PREFILL else work.num_output_tokens
        events = self._interrupt(inst)
        inst.core.add_request(
            SimSequence(
                request_id=work.request_id,
                num_prompt_tokens=work.num_prompt_tokens,
                max_output_tokens=max_output,
                arrival_s=now,
                num_resumed_tokens=num_resumed,
                block_hashes=work.block_hashes,
                hash_block_size=work.hash_block_size,
                token_seed=flight.token_seed,
                skip_prefill=skip_prefill,
                priority=flight.route.priority,
            )
        )
        flight.instance = inst
        if inst.role != EngineRole.PREFILL:
            flight.record.instance_ids.append(inst.instance_id)
        self.pools[inst.role].mark_dirty(inst)
        return events + self._kick(inst, now)

    def _kick(self, inst: SimInstance, now: float) -> list[Event]:
        if inst.busy:
            return []
        inst.start_pending = True
        return [StepStartEvent(now, inst)]

    # ---- iterations ------------------------------------------------------------
    def start_step(self, inst: SimInstance, now: float) -> list[Event]:
        """Form the next batch; with the iterations that repeat it (a decode run), only
        the last gets an event (module docstring)."""
        inst.start_pending = False
        step = inst.core.begin_step(now)
        self.pools[inst.role].mark_dirty(inst)
        if step is None:
            if inst.core.has_work:
                raise RuntimeError(f"{inst.instance_id} has work but scheduled nothing")
            return []
        run = inst.core.plan_run(step, min(self._run_limit(inst) - 1, inst.run_budget))
        if run is not None:
            inst.run, inst.run_at = run, 0
            step = run.iteration(run.num_repeats)
            self._queue_run(inst)
        inst.step = step
        return [StepEndEvent(step.end_s, inst, step)]

    def _run_limit(self, inst: SimInstance) -> int:
        """Iterations, from the one beginning now, that may end without an event: one
        while the router queue waits on this pool."""
        if self.router_queue and inst.role == self.entry_role:
            return 1
        return self.max_run_iterations

    def _queue_run(self, inst: SimInstance) -> None:
        """Queue the end of `inst`'s iteration in flight and, when a watchdog check
        falls within the run's quiet iterations, the first such (`settle`)."""
        run, at = inst.run, inst.run_at
        assert run is not None
        heapq.heappush(self._runs, (run.ends_s[at], next(self._run_seq), inst, run, at))
        inst.check_at = run.num_repeats
        if self.watchdog is not None and inst.role == self.serve_role:
            period = self.watchdog.check_period_iterations
            check = at + (-(inst.core.num_iterations + 1)) % period
            if check < run.num_repeats:
                inst.check_at = check
                heapq.heappush(self._checks,
                               (run.ends_s[check], next(self._run_seq), inst, run, check))

    def settle(self, until_s: float, *, inclusive: bool = False,
               before: Event | None = None) -> list[Event]:
        """Apply the decode runs' iterations that end before `until_s` (or at it, when
        `inclusive`): each completes, reports to the step listeners and begins the
        next; before an event at `until_s` that touches only its own engine
        (`_keeps_to_itself`), only that engine's (the others wait until anything
        reads them). A watchdog check in a run happens in time order, once its engine
        is applied up to it (the others when the check reads them, `_watch`); the
        events of a check that moved requests are returned at once (they come before
        anything later). An iteration ending exactly at `until_s` (not `inclusive`)
        gets its StepEndEvent instead, returned: it then ends in event order."""
        while True:
            check = self._next_check()
            if check is None or check[0] > until_s or check[0] == until_s and not inclusive:
                if before is None or not self._keeps_to_itself(before):
                    return self._apply_runs(until_s, inclusive, cut_ties=True)
                inst = before.instance  # type: ignore[attr-defined]
                if inst.run is not None and inst.run.ends_s[inst.run_at] < until_s:
                    self._settle_run(inst, until_s, inclusive=False)
                return []
            check_s, _, inst, _, at = heapq.heappop(self._checks)
            events = self._check_in_run(inst, at, check_s)
            if events:
                return events

    def _keeps_to_itself(self, event: Event) -> bool:
        """Whether `event` reads and changes only its own engine, so the other engines'
        runs need not be applied first: an iteration's start, or its end while no
        request waits at the router (whose drain routes) and no elastic hooks listen
        (its own watchdog check reads the others only through `_watch`'s view)."""
        return (isinstance(event, (StepStartEvent, StepEndEvent)) and not self.router_queue
                and self.elastic is None)

    def _next_check(self) -> tuple[float, int, SimInstance, DecodeRun, int] | None:
        """The earliest watchdog check still due in a run (those of cut runs dropped)."""
        checks = self._checks
        while checks and (checks[0][2].run is not checks[0][3]
                          or checks[0][2].check_at != checks[0][4]):
            heapq.heappop(checks)
        return checks[0] if checks else None

    def _apply_runs(self, until_s: float, inclusive: bool, cut_ties: bool) -> list[Event]:
        """Every run's iterations ending before `until_s` (or at it, when `inclusive`),
        up to its next watchdog check; `cut_ties`: an iteration in flight that ends at
        `until_s` is cut to end by an event (`_interrupt`)."""
        events: list[Event] = []
        runs = self._runs
        while runs and runs[0][0] <= until_s:
            end_s, _, inst, run, at = runs[0]
            if inst.run is not run or inst.run_at != at:  # cut, or applied since
                heapq.heappop(runs)
            elif end_s < until_s or inclusive:
                assert at < inst.check_at, "a run was applied past a watchdog check"
                heapq.heappop(runs)
                self._settle_run(inst, until_s, inclusive)
            elif cut_ties:
                heapq.heappop(runs)
                events.extend(self._interrupt(inst))
            else:
                break
        return events

    def _settle_run(self, inst: SimInstance, until_s: float, inclusive: bool) -> None:
        """`_apply_runs` for one engine: its iterations from the one in flight that end
        before `until_s` (or at it), up to its next watchdog check; the rest of its run
        waits in `_runs` again."""
        core, run, first = inst.core, inst.run, inst.run_at
        assert run is not None
        stop = (bisect.bisect_right if inclusive else bisect.bisect_left)(
            run.ends_s, until_s, first, inst.check_at)
        self.num_token_events += core.complete_repeats(run, first, stop)
        if self.listeners.step:
            self._report_run(inst, run, first, stop)
        self._begin_run_iteration(inst, run, stop)

    def _begin_run_iteration(self, inst: SimInstance, run: DecodeRun, index: int) -> None:
        """Iterations before `index` of `inst`'s run are applied: begin `index`, the
        last (whose StepEndEvent is queued) or one queued again in `_runs`."""
        inst.core.begin_repeat(run, index)
        self.pools[inst.role].mark_dirty(inst)
        self.quiet_end_s = max(self.quiet_end_s, run.ends_s[index - 1])
        if index == run.num_repeats:  # only the last iteration is left: the run was not cut
            inst.run = None
            inst.run_budget = min(2 * inst.run_budget, self.max_run_iterations)
            return
        inst.run_at = index
        if index > inst.check_at:  # past its check: queue the next
            self._queue_run(inst)
        else:
            heapq.heappush(self._runs, (run.ends_s[index], next(self._run_seq), inst, run, index))

    def _check_in_run(self, inst: SimInstance, at: int, now: float) -> list[Event]:
        """Iteration `at` of `inst`'s run ends with a watchdog check: its iterations up
        to it applied and reported (the other engines' only if the check reads them,
        `_watch`), the check sees the engine as `end_step` would; no move, the run goes
        on, else the engine forms its next batch now."""
        core, run, first = inst.core, inst.run, inst.run_at
        assert run is not None and first <= at == inst.check_at
        self.num_token_events += core.complete_repeats(run, first, at + 1)
        core.place_batch(run, at + 1, begun=False)
        self.pools[inst.role].mark_dirty(inst)
        self.quiet_end_s = max(self.quiet_end_s, now)
        if self.listeners.step:
            self._report_run(inst, run, first, at + 1)
        last, inst.run, inst.step = inst.step, None, None  # as between two iterations
        num_held = len(core.requests)
        events = self._watch(inst, now)
        if len(core.requests) < num_held:  # moved: the batch changed
            inst.run_budget = max(inst.run_budget // 2, 1)
            return events + self._kick(inst, now) if core.has_work else events
        inst.run, inst.step = run, last
        self._begin_run_iteration(inst, run, at + 1)
        return events

    def _interrupt(self, inst: SimInstance) -> list[Event]:
        """Cut `inst`'s decode run (settled up to now): its iteration in flight ends by
        an event; the batch after it is formed anew. The run's last event goes stale."""
        run = inst.run
        if run is None:
            return []
        inst.step = run.iteration(inst.run_at)
        inst.run = None
        inst.run_budget = max(inst.run_budget // 2, 1)
        return [StepEndEvent(inst.step.end_s, inst, inst.step)]

    def end_step(self, inst: SimInstance, step: ScheduledStep, now: float) -> list[Event]:
        if step is not inst.step:
            return []  # the end of a decode run that was cut
        tokens = inst.core.complete_step(step, now)
        inst.step = None
        self.pools[inst.role].mark_dirty(inst)
        events: list[Event] = []
        self.num_token_events += len(tokens)
        for token in tokens:  # hot loop: only first and last tokens matter here
            if token.index == 0 or token.finish_reason is not None:
                self._on_token(inst, token, now, events)
        if self.listeners.step:
            self._report_step(inst, step.start_s, (step.duration_s,),
                              step.batch.num_prefill_tokens, step.batch.num_decode_seqs, now)
        if self.watchdog is not None and inst.role == self.serve_role:
            if inst.core.num_iterations % self.watchdog.check_period_iterations == 0:
                events.extend(self._watch(inst, now))
        if self.router_queue and inst.role == self.entry_role:
            events.extend(self.drain_router_queue(now))
        if inst.core.has_work:
            events.extend(self._kick(inst, now))
        return events

    def _on_token(self, inst: SimInstance, token: TokenEvent, now: float, events: list) -> None:
        """A request's first token (index 0, never re-emitted after a resume) or its last."""
        flight = self.flights[token.request_id]
        record = flight.record
        if token.index == 0:
            record.first_token_s = now
            record.num_cached_tokens = token.num_cached_tokens or 0
            for listener in self.listeners.first_token:
                listener.on_first_token(flight.route, inst.instance_id, now, now)
        if not token.finished:
            return
        record.num_generated_tokens = token.index + 1
        if inst.role == EngineRole.PREFILL and token.index + 1 < record.num_output_tokens:
            num_bytes = flight.work.num_prompt_tokens * inst.spec.model.kv_bytes_per_token
            flight.instance = None  # in transit to its decode instance
            assert flight.decode_target is not None
            events.append(KvTransferDoneEvent(self.link.enqueue(now, num_bytes), flight,
                                              flight.decode_target, 1))
        else:
            self._finish(flight, inst, now)
            if self.elastic is not None:
                events.extend(self.elastic.finished(flight, inst, now))
            if self.releases.closed_loop:
                events.extend(self._released(flight, inst, now))

    def _finish(self, flight: SimFlight, inst: SimInstance, now: float) -> None:
        flight.record.finish_s = now
        flight.instance = None
        del self.flights[flight.route.request_id]
        self.num_done += 1
        if self.listeners.finish:
            report = FinishReport(
                flight.route, inst.instance_id, flight.record.num_generated_tokens,
                flight.record.first_token_s, now,
            )
            for listener in self.listeners.finish:
                listener.on_finish(report, now)

    def _report_step(self, inst: SimInstance, start_s: float, durations_s: Sequence[float],
                     num_prefill_tokens: int, num_decode_seqs: int, now: float) -> None:
        """One report for iterations of one batch shape that just ended, at `now`."""
        report = StepReport(inst.instance_id, start_s, durations_s, num_prefill_tokens,
                            num_decode_seqs, inst.status(now))
        for listener in self.listeners.step:
            listener.on_step(inst.instance_id, report, now)

    def _report_run(self, inst: SimInstance, run: DecodeRun, first: int, stop: int) -> None:
        """Iterations `first` to `stop` - 1 of `inst`'s run, just applied: one report."""
        self._report_step(inst, run.start_s(first), run.durations_s[first:stop], 0,
                          len(run.seqs), run.ends_s[stop - 1])

    def transfer_done(self, flight: SimFlight, target: SimInstance, num_resumed: int,
                      now: float) -> list[Event]:
        """KV arrived (a P->D hand-off or a KV move): the target continues from the
        `num_resumed` tokens generated so far without computing the context."""
        target.inbound -= 1
        return self._admit(flight, target, now, num_resumed=num_resumed, skip_prefill=True)

    @property
    def finished(self) -> bool:
        """Every request has finished or been rejected."""
        return self.num_done == len(self.requests)

    def drain_router_queue(self, now: float) -> list[Event]:
        events: list[Event] = []
        while self.router_queue:
            routed = self._try_route(self.router_queue[0], now)
            if routed is None:
                break
            self.router_queue.popleft()
            events.extend(routed)
        return events

    # ---- migration ---------------------------------------------------------------
    def _watch(self, inst: SimInstance, now: float) -> list[Event]:
        assert self.watchdog is not None
        core = inst.core
        if not core.requests or not self.pools[inst.role].is_open(inst):
            return []  # a draining engine's requests move at its drain deadline
        active = [
            ActiveRequest(
                self.flights[rid].route, inst.instance_id, seq.num_output_tokens,
                seq.status == RequestStatus.RUNNING,
            )
            for rid, seq in core.requests.items()
        ]
        def settle_others() -> None:  # iterations that ended before the check
            self._apply_runs(now, False, cut_ties=False)

        view = self.pools[inst.role].check_snapshot(inst, now, settle_others)
        moves = self.watchdog.check(inst.instance_id, active, view, now)
        if moves:  # the targets' runs first reach the check
            settle_others()
        events: list[Event] = []
        for request_id, target_id in moves.items():
            events.extend(self.migrate(inst, request_id, target_id, now))
        return events

    def migrate(
        self, src: SimInstance, request_id: str, target_id: str, now: float
    ) -> list[Event]:
        """Abort on the source and continue on the target, by the path `plan_move`
        takes: re-added with the generated tokens as prompt (token ids), or after its
        KV crossed the link (the source is alive, so its KV is reachable)."""
        pool = self.pools[src.role]
        target = pool.lookup(target_id, "migration")
        seq = src.core.requests.get(request_id)
        if seq is None or target is src:
            raise ValueError(f"cannot migrate {request_id} from {src.instance_id} to {target_id}")
        flight = self.flights[request_id]
        num_generated = seq.num_output_tokens
        context = flight.work.num_prompt_tokens + num_generated
        if not target.fits(context):
            raise ValueError(f"{target_id} cannot hold migrated request {request_id}")
        work = flight.work
        cached = min(target.core.prefix_cache.peek(work.block_hashes) * work.hash_block_size,
                     work.num_prompt_tokens)
        plan = plan_move(target.spec, context, cached, self.link, now,
                         num_loadable_tokens=context,
                         num_running_on_target=len(target.core.running), rule=self.move_rule)
        events = self._interrupt(src)
        src.core.abort_request(request_id)
        pool.mark_dirty(src)
        record = flight.record
        record.num_migrations += 1
        if plan.path is MovePath.TOKEN_IDS:
            return events + self._admit(flight, target, now, num_resumed=num_generated)
        done_s = self.link.enqueue(now, plan.num_kv_bytes)
        record.num_kv_moves += 1
        record.kv_moved_bytes += plan.num_kv_bytes
        record.kv_move_s += done_s - now
        flight.instance = None  # in transit to the target
        target.inbound += 1
        return [*events, KvTransferDoneEvent(done_s, flight, target, num_generated)]

    # ---- end of run --------------------------------------------------------------
    def finalize(self, now: float) -> list[RequestRecord]:
        """Settle outcomes; requests still in flight count as violated, session steps
        never issued (the run stopped first) as rejected."""
        for index in self.releases.unreleased():
            record = self._record(replace(self.requests[index], arrival_s=now))
            record.outcome = RequestOutcome.REJECTED
            record.reject_reason = "not issued: the run stopped first"
        for flight in self.flights.values():
            if flight.instance is not None:
                seq = flight.instance.core.requests[flight.route.request_id]
                flight.record.num_generated_tokens = seq.num_output_tokens
        for record in self.records:
            record.outcome = record.decide()
        return self.records

    @property
    def num_preemptions(self) -> int:
        return sum(inst.core.num_preemptions for pool in self.pools.values()
                   for inst in pool.instances)
