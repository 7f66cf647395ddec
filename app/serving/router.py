"""The live router: the routing stack (policy + watchdog) driving real engines.

Ray-free asyncio. Engines sit behind `EngineClient` (the Serve deployment supplies
Ray actor clients), the clock is injected, and every decision is made by the same
policy and watchdog objects the simulator runs:
- `submit` builds the policy's `RouteRequest` (predicted length, deadline, prefix
  hashes) and asks `policy.choose` on a view of the healthy instances (with prefill
  and decode pools, `DisaggregatedPlacer` picks one of each, and `stream` runs the
  prefill stage and the KV hand-off before the decode);
- `stream` relays the engine's tokens; when the watchdog (or an operator) moves the
  request, or its engine fails, it continues on the new instance by token ids
  (prompt + generated so far), so the client sees one uninterrupted stream;
- a poll loop feeds engine reports to the status estimator and runs the watchdog
  every `tau` iterations of an instance.
Instance load (running / waiting) comes from the router's own bookkeeping (counts
kept as flights change), which is current at every decision; polled reports supply
speeds and KV. Prefix hits come from a router-side LRU of the block hashes it sent
each instance (sized like the instance's KV), the "approximate prefix index" of
production routers: shipping every cached hash with each poll cost more than the
routing itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from app.config import EngineConfig, EngineRole
from app.control.fleet import Member
from app.control.observe import LoadReport
from app.control.plan import EngineState
from app.engine_types import (
    EngineRequest,
    EngineStatus,
    TokenEvent,
)
from app.engines.prefix import PREFIX_BLOCK_SIZE, PrefixCache, prefix_block_hashes
from app.hardware import InstanceSpec
from app.routing.base import ActiveRequest, Reject, RejectCode
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy
from app.routing.registry import RoutingStack
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, InstanceId, InstanceView, RouteRequest
from app.serving.flight import Flight, FlightState, GenerationRequest, InvalidTransition
from app.serving.kv_transfer import KvTransport
from app.serving.tokenizer import OutputText
from app.telemetry import MigrationReason, NullFactory, Outcome, RouterMetrics

logger = logging.getLogger(__name__)

ABORTED = "abort"  # finish reason of a stream we ended ourselves (migration, disconnect)
MOVABLE = frozenset({FlightState.QUEUED, FlightState.RUNNING})  # what a migration may move


class EngineClient(ABC):
    """Transport to one engine: what the router needs and nothing else."""

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        self.engine_id = engine_id
        self.config = config

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        """Stream the request's tokens, a batch per engine iteration."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request on the engine; True if it was there."""

    @abstractmethod
    async def status(self) -> EngineStatus:
        """The engine's black-box report."""


class RequestRejected(Exception):
    """The policy declined the request (admission control) or nothing can serve it."""

    def __init__(self, reason: str, code: RejectCode) -> None:
        super().__init__(reason)
        self.code = code


class EngineLost(Exception):
    """A request's engine failed and no other instance could take it over."""


@dataclass(eq=False)
class LiveInstance:
    client: EngineClient
    spec: InstanceSpec
    status: EngineStatus | None = None
    healthy: bool = False  # reachable at the last poll
    watched_epoch: int = 0  # num_iterations // tau at the last watchdog check
    prefixes: PrefixCache | None = None  # block hashes sent here; sized at the first report
    # what other router replicas had running / waiting here at the last poll
    others_running: int = 0
    others_waiting: int = 0
    draining: bool = False  # out of the registry's serving set: takes no new request
    left: bool = False  # gone from the registry: forgotten once nothing of ours is on it

    def remember_prefix(self, block_hashes: Sequence[int]) -> None:
        if self.prefixes is not None:
            self.prefixes.insert(block_hashes, PREFIX_BLOCK_SIZE)

    def update(self, status: EngineStatus, own_outstanding: int) -> None:
        """Take a report; the engine's requests beyond this router's own
        (`own_outstanding`) belong to other replicas, and count as waiting first
        when the engine has a queue."""
        self.status, self.healthy = status, True
        others = max(status.num_running + status.num_waiting - own_outstanding, 0)
        self.others_waiting = min(others, status.num_waiting)
        self.others_running = others - self.others_waiting
        if self.prefixes is None:
            blocks = status.num_kv_blocks_used + status.num_kv_blocks_free
            self.prefixes = PrefixCache(blocks * self.client.config.scheduler.block_size)

    @property
    def instance_id(self) -> InstanceId:
        return self.client.engine_id

    def reported_view(self) -> InstanceView:
        """The instance as its latest report shows it (the router adds its own load)."""
        assert self.status is not None
        sched = self.client.config.scheduler
        return InstanceView.from_status(self.status, self.spec, sched.block_size,
                                        sched.max_num_seqs)

    @property
    def tags(self) -> dict[str, str]:
        """The instance's metric tags."""
        config = self.client.config
        return {"instance": self.instance_id, "gpu_type": config.gpu_type,
                "role": config.role.value}


class OwnLoad:
    """This router's flights per instance, split into running and waiting, kept as
    they change (the views read the counts at every decision and every poll; the
    watchdog reads one instance's flights at each of its checks)."""

    def __init__(self) -> None:
        self._flights: dict[tuple[InstanceId, bool], dict[str, Flight]] = {}
        self._keys: dict[str, tuple[InstanceId, bool]] = {}  # where each flight is counted

    def update(self, flight: Flight) -> None:
        """Count the flight where it is now, as running or waiting (a no-op when that
        has not changed: every token batch asks)."""
        key = (flight.instance_id, flight.is_running)
        if self._keys.get(flight.request_id) == key:
            return
        self.remove(flight)
        self._keys[flight.request_id] = key
        self._flights.setdefault(key, {})[flight.request_id] = flight

    def remove(self, flight: Flight) -> None:
        key = self._keys.pop(flight.request_id, None)
        if key is not None:
            del self._flights[key][flight.request_id]

    def running(self, instance_id: InstanceId) -> int:
        return len(self._flights.get((instance_id, True), ()))

    def waiting(self, instance_id: InstanceId) -> int:
        return len(self._flights.get((instance_id, False), ()))

    def flights_on(self, instance_id: InstanceId) -> list[Flight]:
        return [f for running in (True, False)
                for f in self._flights.get((instance_id, running), {}).values()]


@dataclass(frozen=True)
class RouterCounters:
    """Totals since start (for metrics and tests)."""

    num_routed: int
    num_rejected: int
    num_finished: int
    num_dropped: int
    num_migrations: int  # SLO-risk and operator moves
    num_drain_migrations: int  # moves off engines leaving their pool
    num_failovers: int
    num_in_flight: int


Predict = Callable[[RouteRequest], Awaitable[float]]


class LiveRouter:
    """Routes, streams, migrates and fails over; one instance per router replica."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        stack: RoutingStack,
        *,
        clock: Callable[[], float] = time.time,
        predict: Predict | None = None,
        kv_transport: KvTransport | None = None,
        poll_interval_s: float = 0.1,
        status_timeout_s: float = 5.0,
        max_failovers: int = 2,
        metrics: RouterMetrics | None = None,
    ) -> None:
        if not clients:
            raise ValueError("the router needs at least one engine")
        roles = {c.config.role for c in clients}
        if roles not in ({EngineRole.UNIFIED}, {EngineRole.PREFILL, EngineRole.DECODE}):
            raise ValueError("engines must all be unified, or prefill and decode pools; got "
                             f"{sorted(r.value for r in roles)}")
        self.disaggregated = EngineRole.PREFILL in roles
        self.serve_role = EngineRole.DECODE if self.disaggregated else EngineRole.UNIFIED
        if self.disaggregated and kv_transport is None:
            raise ValueError("prefill and decode pools need a KV transport")
        self.kv_transport = kv_transport
        for x in (stack.policy, stack.watchdog):
            if x is not None and x.needs_true_output_length:
                raise ValueError(f"{type(x).__name__} needs true output lengths (simulator only)")
        self.instances = {c.engine_id: LiveInstance(c, c.config.instance) for c in clients}
        if len(self.instances) != len(clients):
            raise ValueError("engine ids must be unique")
        self.policy = stack.policy
        self.watchdog = stack.watchdog
        self.pd_placer: DisaggregatedPlacer | None = None
        prefill_policy: LeastTtftPolicy | None = None
        if kv_transport is not None and self.disaggregated:
            prefill_policy = LeastTtftPolicy()
            self.pd_placer = DisaggregatedPlacer(prefill_policy, stack.policy, kv_transport.link)
        # the policy's estimator when it has one, else one of our own: the instance
        # gauges show what routing sees
        self.estimator = stack.estimator or StatusEstimator()
        own = None if stack.estimator is not None else self.estimator  # else the policy feeds it
        present = (x for x in (stack.policy, prefill_policy, stack.watchdog, own) if x is not None)
        self._listeners = list({id(x): x for x in present}.values())
        self.metrics = metrics or RouterMetrics(NullFactory())
        self.clock = clock
        self.predict = predict
        self.poll_interval_s = poll_interval_s
        self.status_timeout_s = status_timeout_s
        self.max_failovers = max_failovers
        self.flights: dict[str, Flight] = {}  # request_id -> flight
        self._load = OwnLoad()  # the flights' instances and states, counted
        self._poll_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._num_routed = self._num_rejected = self._num_finished = self._num_dropped = 0
        self._num_migrations = self._num_drain_migrations = self._num_failovers = 0
        self._load_report = LoadReport()  # arrivals and completions since the last take

    # ---- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        """Poll every engine once (so the first request sees them), then keep polling."""
        if self._poll_task is None:
            await self.poll_once()
            self._poll_task = asyncio.create_task(self._poll_forever())

    def close(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # a bug here must not stop polling for good
                logger.exception("status poll failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(inst) for inst in self.instances.values()))

    async def _poll(self, inst: LiveInstance) -> None:
        try:
            status = await asyncio.wait_for(inst.client.status(), self.status_timeout_s)
        except Exception as exc:
            if inst.healthy:
                logger.warning("engine %s unreachable: %s", inst.instance_id, exc)
            inst.healthy = False
            self.metrics.instance_state(inst.tags, {"healthy": 0.0})
            return
        iid = inst.instance_id
        previous = inst.status
        inst.update(status, self._load.running(iid) + self._load.waiting(iid))
        now = self.clock()
        for listener in self._listeners:
            listener.on_status(status, now)
        self._export_instance(inst, previous, now)
        self._watch(inst, now)

    def _export_instance(self, inst: LiveInstance, previous: EngineStatus | None,
                         now: float) -> None:
        """The instance's gauges: its load, KV, iteration rate and what the status
        estimator makes of it (q_g, p_g, d_g for a request joining now)."""
        status = inst.status
        assert status is not None
        rate = 0.0
        if previous is not None and status.time_s > previous.time_s:
            rate = (status.num_iterations - previous.num_iterations) / (
                status.time_s - previous.time_s)
        estimate = self.estimator.estimate(inst.reported_view(), now)
        self.metrics.instance_state(inst.tags, {
            "queue_delay_seconds": estimate.queue_delay_s,
            "prefill_seconds_per_token": estimate.prefill_s_per_token,
            "decode_seconds_per_token": estimate.decode_s_per_token,
            "running": status.num_running,
            "waiting": status.num_waiting,
            "kv_usage": status.kv_usage,
            "iterations_per_second": rate,
            "healthy": 1.0,
        })

    # ---- views -----------------------------------------------------------------
    def view(self, now: float, exclude: frozenset[InstanceId] = frozenset(),
             role: EngineRole | None = None) -> ClusterView:
        """The healthy instances (of `role`, default the serving role: unified or
        decode) with their latest reports and their load: this
        router's requests, current at every decision, plus what other router replicas
        had there at the last poll (routing on its own requests alone, each replica
        would see an instance the others fill as idle)."""
        role = role or self.serve_role
        views = []
        for iid, inst in self.instances.items():
            if (not inst.healthy or inst.status is None or iid in exclude or inst.draining
                    or inst.client.config.role != role):
                continue
            views.append(replace(inst.reported_view(),
                                 num_running=self._load.running(iid) + inst.others_running,
                                 num_waiting=self._load.waiting(iid) + inst.others_waiting))
        return ClusterView(now, tuple(views), self._prefix_blocks)

    def _recount(self, flight: Flight) -> None:
        """Keep the load counts true after a transition of a flight we track."""
        if self.flights.get(flight.request_id) is flight:
            self._load.update(flight)

    def _prefix_blocks(self, instance_id: InstanceId, hashes: Sequence[int]) -> int:
        """Leading prompt blocks this router has sent the instance (and not yet aged out)."""
        prefixes = self.instances[instance_id].prefixes
        return 0 if prefixes is None else prefixes.peek(hashes)

    # ---- routing -----------------------------------------------------------------
    async def submit(self, request: GenerationRequest, text: OutputText | None = None) -> Flight:
        """Route a request; raises `RequestRejected` with the reason when it is not served.

        `text` is the client's view of the output (stop strings and stop token ids end it
        there); without one only the engine ends it."""
        if request.request_id in self.flights:
            raise ValueError(f"duplicate request id {request.request_id}")
        route = RouteRequest(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            deadline_s=math.inf if request.slo_s is None else request.arrival_s + request.slo_s,
            num_prompt_tokens=len(request.prompt_token_ids),
            block_hashes=prefix_block_hashes(request.prompt_token_ids),
            prompt=request.prompt_text,
            task=request.task,
            session_id=request.session_id,
            max_output_tokens=request.sampling.max_tokens,
        )
        self._load_report.arrival(route.num_prompt_tokens)
        if self.predict is not None:
            started = time.perf_counter()
            predicted = await self.predict(route)
            self.metrics.predicted(time.perf_counter() - started)
            route = replace(route, predicted_output_tokens=max(round(predicted), 1))
        started = time.perf_counter()
        try:
            prefill, target = self._place(route, self.clock(), request.sampling.resumable)
        except RequestRejected as exc:
            self._num_rejected += 1
            self.metrics.rejected(exc.code)
            raise
        self.metrics.routed(self.instances[target].tags, time.perf_counter() - started)
        flight = Flight.routed(request, route, target, prefill, self.disaggregated, text)
        for iid in {prefill or target, target}:
            self.instances[iid].remember_prefix(route.block_hashes)
        self.flights[request.request_id] = flight
        self._load.update(flight)
        self._num_routed += 1
        return flight

    def _place(self, route: RouteRequest, now: float,
               resumable: bool = True) -> tuple[InstanceId | None, InstanceId]:
        """(prefill instance or None when unified, the decode / unified instance).

        A request that cannot continue by token ids (a grammar, penalties on the output,
        a seeded sampler) cannot take its first token from a prefill engine either: its
        decode engine computes the prompt itself."""
        if self.pd_placer is None or not resumable:
            return None, self._choose(route, now)
        prefill_view = self.view(now, role=EngineRole.PREFILL)
        decode_view = self.view(now)
        if not prefill_view.instances or not decode_view.instances:
            raise RequestRejected("no healthy prefill or decode instance is available",
                                  RejectCode.NO_INSTANCE)
        placement = self.pd_placer.place(route, prefill_view, decode_view, now)
        if isinstance(placement, Reject):
            raise RequestRejected(placement.reason, placement.code)
        return placement.prefill_instance, placement.decode_instance

    def _choose(self, route: RouteRequest, now: float,
                exclude: frozenset[InstanceId] = frozenset(),
                role: EngineRole | None = None) -> InstanceId:
        view = self.view(now, exclude, role)
        if not view.instances:
            raise RequestRejected("no healthy engine instance is available",
                                  RejectCode.NO_INSTANCE)
        decision = self.policy.choose(route, view, now)
        if isinstance(decision, Reject):
            raise RequestRejected(decision.reason, decision.code)
        return decision

    def _choose_elsewhere(self, flight: Flight) -> InstanceId:
        """The policy's pick for the request as it stands now (prompt + generated ids to
        re-prefill), among the instances other than its current one; with no decode
        instance left, a prefill engine (same model) carries on."""
        resumed = replace(flight.route, num_generated_tokens=len(flight.output.token_ids))
        exclude = frozenset({flight.instance_id})
        try:
            return self._choose(resumed, self.clock(), exclude=exclude)
        except RequestRejected:
            if not self.disaggregated:
                raise
            return self._choose(resumed, self.clock(), exclude=exclude,
                                role=EngineRole.PREFILL)

    async def stream(self, flight: Flight) -> AsyncIterator[list[TokenEvent]]:
        """The request's tokens (indices from 0, one stream across moves); ends the flight."""
        try:
            if flight.state is FlightState.PREFILLING:
                async for kept in self._prefill_stage(flight):
                    yield kept
                if flight.state is FlightState.FINISHED:
                    return
            while True:
                client = self.instances[flight.instance_id].client
                try:
                    async for batch in client.generate(flight.engine_request()):
                        if batch and flight.kv is not None and flight.kv.held:
                            self._on_decode_start(flight, batch)
                        kept = self._take(flight, batch)
                        if kept:
                            yield kept
                        if flight.state is FlightState.FINISHED:
                            return
                except (EngineLost, InvalidTransition):  # a lost flight, or a bug of ours
                    raise
                except Exception as exc:  # our abort for a move, or the engine failed
                    if flight.state is not FlightState.MOVING:
                        self._fail_over(flight, f"{type(exc).__name__}: {exc}")
                        continue
                if flight.state is FlightState.MOVING:
                    self._move(flight)
                else:  # ended without finishing and nobody moved it
                    self._fail_over(flight, "stream ended before the last token")
        finally:
            self._end(flight)

    async def _prefill_stage(self, flight: Flight) -> AsyncIterator[list[TokenEvent]]:
        """Prompt -> first token on the prefill engine, then the prompt's KV to the decode
        engine. When either fails the decode engine prefills the prompt (by token ids)
        itself, so the request goes on."""
        inst = self.instances[flight.instance_id]
        params = None
        try:
            async for batch in inst.client.generate(flight.prefill_request()):
                params = batch[-1].kv_transfer_params or params
                kept = self._take(flight, self._first_token_only(flight, batch))
                if kept:
                    yield kept
        except (EngineLost, InvalidTransition):
            raise
        except Exception as exc:
            logger.warning("request %s: prefill on %s failed (%s: %s); its decode engine "
                           "prefills it", flight.request_id, inst.instance_id,
                           type(exc).__name__, exc)
            inst.healthy = False
        if flight.state is FlightState.FINISHED:
            return
        if not flight.output.token_ids:
            flight.decode_without_kv()
            self._recount(flight)
            return
        assert self.kv_transport is not None and flight.kv is not None
        flight.end_prefill(self.clock())
        self._recount(flight)
        try:
            handoff = await self.kv_transport.transfer(
                flight.route.num_prompt_tokens, inst.spec.model.kv_bytes_per_token,
                flight.kv.prefill_end_s, params)
        except Exception as exc:
            logger.warning("request %s: KV transfer failed (%s: %s); its decode engine "
                           "prefills it", flight.request_id, type(exc).__name__, exc)
            self.kv_transport.release(params)
            flight.decode_without_kv()
            return
        flight.hand_off(handoff.params, handoff.transfer_s)

    def _on_decode_start(self, flight: Flight, batch: list[TokenEvent]) -> None:
        """The decode engine produced its first token: it has the prompt's KV (it tells
        how many tokens it found rather than computed); the hand-off can be freed."""
        kv = flight.kv
        assert kv is not None
        kv.loaded_tokens = batch[0].num_cached_tokens or 0
        if kv.transfer_s is None and kv.prefill_end_s is not None:
            kv.transfer_s = self.clock() - kv.prefill_end_s  # load included
        if kv.transfer_s is not None:
            per_token = self.instances[flight.instance_id].spec.model.kv_bytes_per_token
            self.metrics.kv_transferred(kv.transfer_s, flight.route.num_prompt_tokens * per_token)
        self._release_kv(flight)

    def _release_kv(self, flight: Flight) -> None:
        if flight.kv is not None and flight.kv.held and self.kv_transport is not None:
            flight.kv.held = False
            self.kv_transport.release(flight.kv.params)

    @staticmethod
    def _first_token_only(flight: Flight, batch: list[TokenEvent]) -> list[TokenEvent]:
        """The prefill engine stops at one token by its own max_tokens; that ends the
        request only when the client asked for one token (an EOS always ends it)."""
        if flight.request.sampling.max_tokens == 1:
            return batch
        return [replace(ev, finish_reason=None) if ev.finish_reason == "length" else ev
                for ev in batch]

    def _take(self, flight: Flight, batch: list[TokenEvent]) -> list[TokenEvent]:
        """Record a batch; tokens cut by our own abort keep their ids but lose the reason;
        a stop the router finds in the text ends the output at its token.

        Times are the router's clock when the batch arrived (what the client sees, and
        free of clock skew between the router's and the engines' nodes).
        """
        if not batch:
            return []
        now = self.clock()
        flight.took_tokens(now)
        self._recount(flight)
        output = flight.output
        kept = [
            replace(ev, finish_reason=None) if ev.finish_reason == ABORTED else ev
            for ev in batch
        ]
        if output.replaying:
            kept = self._past_replay(flight, kept)
        if kept and output.text is not None:
            hit = output.text.observe([ev.token_id for ev in kept])
            if hit is not None:
                engine_ended = kept[hit.num_tokens - 1].finished
                kept = kept[:hit.num_tokens]
                kept[-1] = replace(kept[-1], finish_reason="stop")
                output.stop_reason = hit.reason
                if not engine_ended:
                    self._abort_in_background(flight)
        if not kept:
            return []
        output.token_ids.extend(ev.token_id for ev in kept)
        output.logprobs.extend(ev.logprobs for ev in kept)
        last = kept[-1]
        if last.finish_reason is not None:
            flight.finish(last.finish_reason, now)
            self._recount(flight)
        return kept

    @staticmethod
    def _past_replay(flight: Flight, batch: list[TokenEvent]) -> list[TokenEvent]:
        """A rerun's tokens beyond those the client already has; the ones before must be
        the same (greedy or seeded sampling reproduces them), else the client's stream
        cannot go on and the request fails with a clear error."""
        sent = flight.output.token_ids
        for ev in batch:
            if ev.index < len(sent) and (ev.token_id != sent[ev.index] or ev.finished):
                flight.lose()
                raise EngineLost(
                    f"request {flight.request_id}: its engine failed and the rerun from the "
                    f"start produced different tokens from the {len(sent)} already streamed "
                    "(only greedy or seeded sampling reruns the same)")
        return [ev for ev in batch if ev.index >= len(sent)]

    def _move(self, flight: Flight) -> None:
        """Carry out an asked migration: the flight goes on where it was asked to."""
        reason = flight.placement.move_reason
        if reason is MigrationReason.DRAIN:
            self._num_drain_migrations += 1
        else:
            self._num_migrations += 1
        self.metrics.migrated(reason)
        target = flight.placement.move_to
        assert target is not None
        self._leave_for(flight, target)
        flight.move()
        self._recount(flight)

    def _leave_for(self, flight: Flight, target: InstanceId) -> None:
        """Before a flight is submitted again on `target` (a move or a fail-over): the
        hand-off's KV is freed, and `target` will hold the prompt's blocks."""
        self._release_kv(flight)
        self.instances[target].remember_prefix(flight.route.block_hashes)

    def _fail_over(self, flight: Flight, why: str) -> None:
        """Continue on another instance by token ids, or give up with `EngineLost`."""
        lost = flight.instance_id
        logger.warning("request %s lost its engine %s: %s", flight.request_id, lost, why)
        self.instances[lost].healthy = False  # until it answers a poll again
        if flight.placement.num_failovers >= self.max_failovers:
            flight.lose()
            raise EngineLost(f"request {flight.request_id}: engine {lost} failed ({why})")
        try:
            target = self._choose_elsewhere(flight)
        except RequestRejected as exc:
            flight.lose()
            raise EngineLost(f"request {flight.request_id}: engine {lost} failed ({why}) "
                             f"and no other can continue it: {exc}") from None
        self._num_failovers += 1
        self.metrics.migrated(MigrationReason.FAILURE)
        self._leave_for(flight, target)
        flight.fail_over(target)
        self._recount(flight)

    def _end(self, flight: Flight) -> None:
        """Forget a flight whose stream is over: finished, or cancelled (the client left)
        or lost (its engine failed) on the way, then abort what its engine still runs."""
        self._release_kv(flight)
        if self.flights.get(flight.request_id) is flight:
            self._load.remove(flight)
            del self.flights[flight.request_id]
        now = self.clock()
        output = flight.output
        if flight.state is FlightState.FINISHED:
            self._num_finished += 1
            end_s = output.finish_s or now
            self._load_report.completion(len(output.token_ids), end_s <= flight.route.deadline_s)
            report = FinishReport(flight.route, flight.instance_id, len(output.token_ids),
                                  output.first_token_s, end_s)
            self.metrics.finished(
                arrival_s=flight.request.arrival_s, deadline_s=flight.route.deadline_s,
                first_token_s=output.first_token_s, end_s=end_s,
                num_output_tokens=len(output.token_ids),
                predicted_output_tokens=flight.route.predicted_output_tokens)
            for listener in self._listeners:
                listener.on_finish(report, now)
        else:
            self._num_dropped += 1
            self._abort_in_background(flight)  # client gone or engine lost: free the engine
            if flight.state is not FlightState.LOST:
                flight.cancel()
            self.metrics.ended(Outcome.ERROR if flight.state is FlightState.LOST
                               else Outcome.CANCELLED)
            for listener in self._listeners:
                listener.on_drop(flight.route, now)
        used = [*flight.placement.instance_ids, flight.placement.prefill_instance_id]
        self._forget_left([iid for iid in used if iid is not None])

    def cancel(self, flight: Flight) -> None:
        """End a flight whose stream will never be read (a sibling choice was refused)."""
        if self.flights.get(flight.request_id) is flight:
            self._end(flight)

    def _abort_in_background(self, flight: Flight) -> None:
        """Abort the flight's current engine submission (where it is now)."""
        self._spawn(self.instances[flight.instance_id].client.abort(flight.engine_request_id))

    def _spawn(self, coroutine: Awaitable) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- migration -------------------------------------------------------------------
    def _watch(self, inst: LiveInstance, now: float) -> None:
        """Run the watchdog when the instance has done another check period."""
        if (self.watchdog is None or inst.status is None
                or inst.client.config.role != self.serve_role):
            return
        epoch = inst.status.num_iterations // self.watchdog.check_period_iterations
        if epoch <= inst.watched_epoch:
            return
        inst.watched_epoch = epoch
        mine = [f for f in self._load.flights_on(inst.instance_id)
                if f.state in MOVABLE and f.resumable]
        if not mine:
            return
        active = [ActiveRequest(f.route, f.instance_id, len(f.output.token_ids), f.is_running)
                  for f in mine]
        view = self.view(now)
        if inst.instance_id not in view.by_id:
            return
        for request_id, target in self.watchdog.check(inst.instance_id, active, view, now).items():
            self.migrate(request_id, target, MigrationReason.SLO_RISK)

    def migrate(self, request_id: str, target_id: InstanceId | None = None,
                reason: MigrationReason = MigrationReason.OPERATOR) -> InstanceId | None:
        """Move a running request by token ids (watchdog, operator, or emptying an engine
        that leaves its pool: `reason` drain, counted apart); returns the target.

        Without `target_id` the policy picks among the other instances. Returns None
        when the request is not in flight (already finished), is already moving or is
        still in its prefill stage or KV hand-off;
        raises ValueError for an unknown, unhealthy or unavailable target.
        """
        flight = self.flights.get(request_id)
        if flight is None or flight.state not in MOVABLE:
            return None
        if not flight.resumable:
            raise ValueError(
                f"request {request_id} samples with penalties on its output, a seed or a "
                "grammar: continuing it elsewhere by token ids would change its output, so it "
                "is not moved")
        if target_id is None:
            try:
                target_id = self._choose_elsewhere(flight)
            except RequestRejected as exc:
                raise ValueError(f"cannot move request {request_id}: {exc}") from None
        target = self.instances.get(target_id)
        if target is None or not target.healthy:
            raise ValueError(f"unknown or unhealthy target instance {target_id!r}")
        if target_id == flight.instance_id:
            raise ValueError(f"request {request_id} is already on {target_id}")
        if target.draining:
            raise ValueError(f"target instance {target_id!r} is leaving its pool")
        self._abort_in_background(flight)
        flight.ask_move(target_id, reason)
        self._recount(flight)
        return target_id

    # ---- reporting ----------------------------------------------------------------------
    def counters(self) -> RouterCounters:
        return RouterCounters(
            num_routed=self._num_routed,
            num_rejected=self._num_rejected,
            num_finished=self._num_finished,
            num_dropped=self._num_dropped,
            num_migrations=self._num_migrations,
            num_drain_migrations=self._num_drain_migrations,
            num_failovers=self._num_failovers,
            num_in_flight=len(self.flights),
        )

    def take_load_report(self) -> LoadReport:
        """Arrivals and completions since the last call (for the pool controller)."""
        report, self._load_report = self._load_report, LoadReport()
        return report

    # ---- membership -------------------------------------------------------------------
    def follow(self, members: Sequence[Member],
               make_client: Callable[[Member], EngineClient]) -> None:
        """Take a new registry: new engines join (routable after their first report),
        draining ones take no new request (at once) and have their requests moved
        when asked to evacuate, and engines gone from it are forgotten once no
        request of this router is on them."""
        listed = {m.engine_id: m for m in members}
        for engine_id, member in listed.items():
            if engine_id not in self.instances:
                inst = LiveInstance(make_client(member), member.config.instance)
                self.instances[engine_id] = inst
                self._spawn(self._poll(inst))
        for engine_id, inst in self.instances.items():
            member = listed.get(engine_id)
            inst.draining = member is None or member.state is not EngineState.ACTIVE
            inst.left = member is None
        for member in members:
            if member.evacuate:
                self._evacuate(member.engine_id)
        self._forget_left(list(self.instances))

    def _evacuate(self, instance_id: InstanceId) -> None:
        for flight in self._load.flights_on(instance_id):
            try:
                self.migrate(flight.request_id, reason=MigrationReason.DRAIN)
            except ValueError as exc:  # nowhere to go: it finishes where it is
                logger.info("request %s stays on draining %s: %s", flight.request_id,
                            instance_id, exc)

    def _forget_left(self, instance_ids: Sequence[InstanceId]) -> None:
        """Drop instances that left the registry once no flight of ours is on them."""
        for iid in set(instance_ids):
            inst = self.instances.get(iid)
            if (inst is not None and inst.draining and inst.left
                    and not self._load.flights_on(iid)):
                del self.instances[iid]
