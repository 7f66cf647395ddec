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
- a poll loop (`InstanceTracker`, app/serving/instances.py) feeds engine reports to
  the status estimator, and the router runs the watchdog every `tau` iterations of an
  instance.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from app.control.fleet import Member
from app.control.observe import LoadReport
from app.engines.config import EngineRole
from app.engines.messages import EngineRecord, StoredPromptKv, TokenEvent
from app.engines.prefix import PREFIX_BLOCK_SIZE, prefix_block_hashes
from app.routing.base import ActiveRequest, Listeners, Reject, RejectCode
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy
from app.routing.instance_view import InstanceId
from app.routing.move_path import MovePath, MoveRule, plan_move
from app.routing.priority import PriorityRule
from app.routing.registry import RoutingStack
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, RouteRequest
from app.serving.flight import (
    Flight,
    FlightState,
    GenerationRequest,
    InvalidTransition,
    MoveRecord,
    OutputHook,
)
from app.serving.instances import EngineClient, InstanceTracker, LiveInstance
from app.serving.kv_transfer import ConnectorTransport, KvTransport
from app.serving.router_reports import RouterCounters, RouterReports
from app.serving.status_board import StatusChanges
from app.serving.telemetry import MigrationReason, NullFactory, RouterMetrics

logger = logging.getLogger(__name__)

# how long a re-attach waits for each engine to say whether it runs a request: a busy
# engine actor answers late, and one not heard from cannot be assumed not to run it
FIND_TIMEOUT_S = 10.0


class EngineUnanswered(Exception):
    """An engine did not say whether it runs a request: the request cannot be safely
    started, nor re-attached, yet."""

ABORTED = "abort"  # finish reason of a stream we ended ourselves (migration, disconnect)
MOVABLE = frozenset({FlightState.QUEUED, FlightState.RUNNING})  # what a migration may move


class RequestRejected(Exception):
    """The policy declined the request (admission control) or nothing can serve it."""

    def __init__(self, reason: str, code: RejectCode) -> None:
        super().__init__(reason)
        self.code = code


class EngineLost(Exception):
    """A request's engine failed and no other instance could take it over."""


Predict = Callable[[RouteRequest], Awaitable[float]]
Found = tuple[InstanceId, EngineRecord]  # where an engine holds a client request
# the engines' reports that changed since the last call, as every replica is given them
StatusFeed = Callable[[], Awaitable[StatusChanges]]



def pieces(batch: list[TokenEvent], size: int | None) -> list[list[TokenEvent]]:
    """`batch` in consecutive pieces of at most `size` events (None: whole)."""
    if size is None or len(batch) <= size:
        return [batch]
    return [batch[start:start + size] for start in range(0, len(batch), size)]

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
        move_rule: MoveRule = MoveRule.CHEAPER,
        status_feed: StatusFeed | None = None,
        request_priority: PriorityRule = PriorityRule.NONE,
    ) -> None:
        """`kv_transport` moves prompts' KV from prefill to decode engines; with unified
        engines it is the connector whose stored prompts a move can load (`move_rule`
        chooses, per move, between that and recomputing by token ids). `status_feed`
        long-polls the engines' reports published for every router replica (None: this
        router polls each engine itself every `poll_interval_s`). `request_priority`
        gives each request the engine priority it keeps on every engine it runs on."""
        if not clients:
            raise ValueError("the router needs at least one engine")
        roles = {c.config.role for c in clients}
        if roles not in ({EngineRole.UNIFIED}, {EngineRole.PREFILL, EngineRole.DECODE}):
            raise ValueError("engines must all be unified, or prefill and decode pools; got "
                             f"{sorted(r.value for r in roles)}")
        self.disaggregated = EngineRole.PREFILL in roles
        self.move_rule = move_rule
        self.request_priority = request_priority
        self.serve_role = EngineRole.DECODE if self.disaggregated else EngineRole.UNIFIED
        if self.disaggregated and kv_transport is None:
            raise ValueError("prefill and decode pools need a KV transport")
        self.kv_transport = kv_transport
        for x in (stack.policy, stack.watchdog):
            if x is not None and x.needs_true_output_length:
                raise ValueError(f"{type(x).__name__} needs true output lengths (simulator only)")
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
        self._listeners = Listeners.of(stack.policy, prefill_policy, stack.watchdog, own)
        self.metrics = metrics or RouterMetrics(NullFactory())
        self.clock = clock
        self.tracker = InstanceTracker(clients, estimator=self.estimator,
                                       listeners=self._listeners.every, metrics=self.metrics,
                                       clock=clock, status_timeout_s=status_timeout_s)
        self.predict = predict
        self.poll_interval_s = poll_interval_s
        self.status_feed = status_feed
        self.max_failovers = max_failovers
        self.flights: dict[str, Flight] = {}  # request_id -> flight
        self._poll_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.reports = RouterReports(stack.policy, self._listeners, self.tracker, self.metrics,
                                     clock, tell_finishes=status_feed is not None)

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
            if self.status_feed is None:  # the feed's long poll paces itself
                await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # a bug here must not stop polling for good
                logger.exception("status poll failed")
                await asyncio.sleep(self.poll_interval_s)

    async def poll_once(self) -> None:
        """Every engine's report: polled from each engine, or the published ones that
        changed since the last call."""
        if self.status_feed is None:
            await asyncio.gather(*(self._poll(inst)
                                   for inst in self.tracker.instances.values()))
            return
        changes = await self.status_feed()
        for engine_id, status in changes.items():
            inst = self.tracker.instances.get(engine_id)
            if inst is None:
                continue
            if status is None:
                self.tracker.unreachable(inst, "no published report")
                continue
            self.tracker.take(inst, status)
            self._watch(inst, self.clock())

    async def _poll(self, inst: LiveInstance) -> None:
        """Take the instance's report, then run the watchdog over it when it is due."""
        if await self.tracker.poll(inst):
            self._watch(inst, self.clock())

    @property
    def instances(self) -> dict[InstanceId, LiveInstance]:
        """The engines this router knows, by id."""
        return self.tracker.instances

    def view(self, now: float, exclude: frozenset[InstanceId] = frozenset(),
             role: EngineRole | None = None) -> ClusterView:
        """The healthy instances routing may pick (of `role`, default the serving role:
        unified or decode), with this router's load there current."""
        return self.tracker.view(now, role or self.serve_role, exclude)

    def _recount(self, flight: Flight) -> None:
        """Keep the load counts true after a transition of a flight we track."""
        if self.flights.get(flight.request_id) is flight:
            self.tracker.load.update(flight)

    # ---- routing -----------------------------------------------------------------
    async def submit(self, request: GenerationRequest, text: OutputHook | None = None) -> Flight:
        """Route a request (`routed`, then `place`); raises `RequestRejected` with the
        reason when it is not served."""
        return self.place(request, await self.routed(request), text)

    async def routed(self, request: GenerationRequest) -> RouteRequest:
        """The policy's view of a request, with its output length predicted when the
        router predicts: what `place` needs, and all of its waiting."""
        route = self._route_request(request)
        if self.predict is None:
            return route
        started = time.perf_counter()
        predicted = await self.predict(route)
        self.metrics.predicted(time.perf_counter() - started)
        return replace(route, predicted_output_tokens=max(round(predicted), 1))

    def place(self, request: GenerationRequest, route: RouteRequest,
              text: OutputHook | None = None) -> Flight:
        """Place a request by its `route` (made by `routed`); raises `RequestRejected`
        with the reason when it is not served.

        `text` is the client's view of the output (stop strings and stop token ids end it
        where it says); without one only the engine ends it."""
        started = time.perf_counter()
        try:
            prefill, target = self._place(route, self.clock(), request.sampling.resumable)
        except RequestRejected as exc:
            self.reports.rejected(route, exc.code)
            raise
        self.reports.arrived(route, prefill or target)
        placed = time.perf_counter()
        self.metrics.routed(self.instances[target].tags, placed - started)
        self.metrics.placed(placed - request.received_perf_s)
        flight = Flight.routed(request, route, target, prefill, self.disaggregated, text)
        for iid in {prefill or target, target}:
            self.instances[iid].remember_prefix(route.block_hashes)
        self._track(flight)
        self.reports.routed()
        return flight

    def _track(self, flight: Flight) -> None:
        if flight.request_id in self.flights:
            raise ValueError(f"duplicate request id {flight.request_id}")
        self.flights[flight.request_id] = flight
        self.tracker.load.update(flight)

    def _route_request(self, request: GenerationRequest) -> RouteRequest:
        """The policy's view of a request (its deadline, prefix blocks, priority)."""
        if request.request_id in self.flights:
            raise ValueError(f"duplicate request id {request.request_id}")
        deadline_s = math.inf if request.slo_s is None else request.arrival_s + request.slo_s
        return RouteRequest(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            deadline_s=deadline_s,
            num_prompt_tokens=len(request.prompt_token_ids),
            block_hashes=prefix_block_hashes(request.prompt_token_ids),
            prompt=request.prompt_text,
            task=request.task,
            session_id=request.session_id,
            step_index=request.step_index,
            max_output_tokens=request.sampling.max_tokens,
            priority=self.request_priority.priority(deadline_s),
        )

    # ---- re-attaching --------------------------------------------------------------
    async def find(self, request_id: str, timeout_s: float = FIND_TIMEOUT_S) -> Found | None:
        """Where the engines hold client request `request_id` (another replica started
        it): its latest submission past the prefill stage, and the engine. None: no
        engine started it (a prefill stage alone counts as not started). An engine that
        does not answer within `timeout_s` may run it: `EngineUnanswered`, for starting
        it again could run it twice."""
        asks = {asyncio.ensure_future(inst.client.find(request_id)): inst
                for inst in list(self.instances.values())}
        if not asks:
            return None
        try:
            _, unanswered = await asyncio.wait(asks, timeout=timeout_s)
        finally:  # also when the caller gave up
            for ask in asks:
                ask.cancel()
        if unanswered:
            raise EngineUnanswered(
                f"engine {asks[next(iter(unanswered))].instance_id} did not say within "
                f"{timeout_s:g} s whether it runs request {request_id}")
        found: list[Found] = []
        for ask, inst in asks.items():
            if (exc := ask.exception()) is not None:  # a dead engine holds nothing
                logger.info("engine %s not asked about %s: %s", inst.instance_id,
                            request_id, exc)
                continue
            found += [(inst.instance_id, r) for r in ask.result() if r.attempt >= 0]
        return max(found, key=lambda pair: pair[1].attempt, default=None)

    def reattach(self, request: GenerationRequest, found: Found,
                 text: OutputHook | None = None, num_seen: int = 0) -> Flight:
        """Take over a request an engine already runs (or just ran) for another router
        replica, never running it twice: the flight reads its latest submission where it
        is; one that ended unfinished (aborted, or its engine failed) is placed again
        from its output so far by token ids. The output's first `num_seen` tokens are
        the client's already; `stream` yields the rest. ValueError when the engine's
        request is not this one (another prompt under the same id)."""
        instance_id, record = found
        if tuple(request.prompt_token_ids) != record.prompt_token_ids:
            raise ValueError(f"request id {request.request_id} is in use by another request")
        route = self._route_request(request)
        flight = Flight.routed(request, route, instance_id, None, self.disaggregated, text)
        placement = flight.placement
        placement.attempt = record.attempt
        placement.attached = not record.ended
        placement.orphaned = record.ended and not record.finished
        events = record.output_events(self.clock())
        placement.backlog = events[num_seen:]
        self._track(flight)
        self.reports.reattached()
        self._take(flight, events[:num_seen])
        return flight

    def _submission(self, flight: Flight) -> AsyncIterator[list[TokenEvent]]:
        """The flight's current engine submission: started now, or read where it runs."""
        client = self.instances[flight.instance_id].client
        if flight.placement.attached:
            flight.placement.attached = False
            return client.read(flight.engine_request_id, len(flight.output.token_ids))
        return client.generate(flight.engine_request())

    def _take_backlog(self, flight: Flight) -> list[TokenEvent]:
        """A re-attached flight's output the client has not been sent; one whose
        submission ended unfinished is then placed again (by the policy, anywhere)."""
        placement = flight.placement
        backlog, placement.backlog = placement.backlog, []
        kept = self._take(flight, backlog) if flight.state in MOVABLE else []
        if placement.orphaned and flight.state in MOVABLE:
            placement.orphaned = False
            resumed = replace(flight.route, num_generated_tokens=len(flight.output.token_ids))
            try:
                target = self._choose(resumed, self.clock())
            except RequestRejected as exc:
                flight.lose()
                raise EngineLost(f"request {flight.request_id} was left unfinished and no "
                                 f"engine can continue it: {exc}") from None
            flight.fail_over(self._leave_for(flight, target, MigrationReason.FAILURE))
            self._recount(flight)
        return kept

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

    async def stream(self, flight: Flight, chunk_tokens: int | None = None
                     ) -> AsyncIterator[list[TokenEvent]]:
        """The request's tokens (indices from 0, one stream across moves); ends the
        flight. `chunk_tokens`: an engine's batch is taken and handed on in pieces of at
        most that many tokens, so that each piece's text is its own (None: as it comes;
        the engine actor merges the batches of `stream_interval_s`)."""
        try:
            if flight.placement.backlog or flight.placement.orphaned:
                kept = self._take_backlog(flight)
                if kept:
                    yield kept
                if flight.state is FlightState.FINISHED:
                    return
            if flight.state is FlightState.PREFILLING:
                async for kept in self._prefill_stage(flight):
                    yield kept
                if flight.state is FlightState.FINISHED:
                    return
            while True:
                try:
                    async for batch in self._submission(flight):
                        if batch and not flight.placement.started:
                            self._on_submission_start(flight, batch)
                        for piece in pieces(batch, chunk_tokens):
                            kept = self._take(flight, piece)
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
        output = flight.output
        first = output.first_token_s is None
        flight.took_tokens(now)
        self._recount(flight)
        if first:
            output.num_cached_tokens = batch[0].num_cached_tokens or 0
            for listener in self._listeners.first_token:
                listener.on_first_token(flight.route, flight.instance_id, now, now)
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
        self.reports.moved(reason)
        target = flight.placement.move_to
        assert target is not None
        flight.move(self._leave_for(flight, target, reason))
        self._recount(flight)

    def _plan_move(self, flight: Flight, target: InstanceId,
                   reason: MigrationReason) -> MoveRecord:
        """The move's path, by estimated time (`plan_move`): recompute the context the
        target does not cache, or load the prompt's KV its first engine's connector
        stored (shared storage outlives an engine) and compute the rest. A store older
        than half the connector's TTL is not relied on (the sweep may take it)."""
        now = self.clock()
        placement = flight.placement
        context = flight.route.num_prompt_tokens + (
            len(flight.output.token_ids) if flight.resumable else 0)
        stored = placement.stored_kv
        loadable = 0
        if (stored is not None and isinstance(self.kv_transport, ConnectorTransport)
                and not self.disaggregated
                and now - placement.stored_kv_s < self.kv_transport.connector.kv_ttl_s / 2):
            loadable = min(stored.num_tokens, context)
        inst = self.instances[target]
        cached = min(self.tracker.prefix_blocks(target, flight.route.block_hashes)
                     * PREFIX_BLOCK_SIZE, flight.route.num_prompt_tokens)
        link = None if self.kv_transport is None else self.kv_transport.link
        plan = plan_move(inst.spec, context, cached, link, now,
                         num_loadable_tokens=loadable,
                         num_running_on_target=self.tracker.num_running(target),
                         rule=self.move_rule)
        if link is not None and plan.path is MovePath.KV:
            link.enqueue(now, plan.num_kv_bytes)
        self.metrics.migrated(reason, plan.path)
        return MoveRecord(target, reason, plan.path, plan.estimate_s, plan.num_kv_bytes,
                          load_tokens=loadable if plan.path is MovePath.KV else 0,
                          start_s=now, cached_tokens=cached)

    def _on_submission_start(self, flight: Flight, batch: list[TokenEvent]) -> None:
        """The first tokens of a serving submission: a P/D hand-off is done, a move's
        target says what it loaded, and a unified engine says where its connector stored
        the prompt's KV."""
        first = batch[0]
        if flight.kv is not None and flight.kv.held:
            self._on_decode_start(flight, batch)
        move = flight.loading_move
        if move is not None:
            loads = isinstance(self.kv_transport, ConnectorTransport) and not self.disaggregated
            per_token = self.instances[move.target].spec.model.kv_bytes_per_token
            time_s = self.clock() - move.start_s
            move.arrive(time_s, first.num_cached_tokens or 0, per_token if loads else None)
            self.metrics.moved(move.path, time_s, move.kv_bytes)
        stored = StoredPromptKv.from_params(first.kv_transfer_params)
        if stored is not None:
            flight.placement.stored_kv, flight.placement.stored_kv_s = stored, self.clock()

    def _leave_for(self, flight: Flight, target: InstanceId,
                   reason: MigrationReason) -> MoveRecord:
        """Before a flight is submitted again on `target` (a move or a fail-over): its
        path is planned (on what `target` caches before this move), the hand-off's KV
        is freed, and `target` will hold the prompt's blocks."""
        record = self._plan_move(flight, target, reason)
        self._release_kv(flight)
        self.instances[target].remember_prefix(flight.route.block_hashes)
        return record

    def _fail_over(self, flight: Flight, why: str) -> None:
        """Continue on another instance by token ids, or give up with `EngineLost`."""
        lost = flight.instance_id
        logger.warning("request %s lost its engine %s: %s", flight.request_id, lost, why)
        # a stream can break (a cancelled call) while its engine lives; the submission
        # would run on there, in the engine's journal, beside its continuation
        self._abort_in_background(flight)
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
        self.reports.failed_over()
        flight.fail_over(self._leave_for(flight, target, MigrationReason.FAILURE))
        self._recount(flight)

    def _end(self, flight: Flight) -> None:
        """Forget a flight whose stream is over: finished, or cancelled (the client left)
        or lost (its engine failed) on the way, then abort what its engine still runs."""
        self._release_kv(flight)
        if self.flights.get(flight.request_id) is flight:
            self.tracker.load.remove(flight)
            del self.flights[flight.request_id]
        now = self.clock()
        if flight.state is FlightState.FINISHED:
            self.reports.finished(flight, now)
        else:
            self._abort_in_background(flight)  # client gone or engine lost: free the engine
            if flight.state is not FlightState.LOST:
                flight.cancel()
            self.reports.dropped(flight, now)
        self.reports.step_done(flight, now)
        if self.kv_transport is not None:
            self.kv_transport.sweep()
        used = [*flight.placement.instance_ids, flight.placement.prefill_instance_id]
        self.tracker.forget_left([iid for iid in used if iid is not None])

    def session_answered(self, session_id: str) -> None:
        self.reports.session_answered(session_id)

    def cancel(self, flight: Flight) -> None:
        """End a flight whose stream will never be read (a sibling choice was refused)."""
        if self.flights.get(flight.request_id) is flight:
            self._end(flight)

    def _abort_in_background(self, flight: Flight) -> None:
        """Abort the flight's current engine submission (where it is now); an engine
        that is gone has nothing to abort."""
        instance_id, engine_request_id = flight.instance_id, flight.engine_request_id
        client = self.instances[instance_id].client

        async def abort() -> None:
            try:
                await client.abort(engine_request_id)
            except Exception as exc:
                logger.info("abort of %s on %s failed: %s", engine_request_id, instance_id,
                            exc)

        self._spawn(abort())

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
        mine = [f for f in self.tracker.load.flights_on(inst.instance_id)
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
        return self.reports.counters(len(self.flights))

    def take_finished(self) -> list[FinishReport]:
        return self.reports.take_finished()

    def learn_finished(self, reports: Sequence[FinishReport]) -> None:
        self.reports.learn_finished(reports)

    def take_load_report(self) -> LoadReport:
        return self.reports.take_load_report()

    # ---- membership -------------------------------------------------------------------
    def follow(self, members: Sequence[Member],
               make_client: Callable[[Member], EngineClient]) -> None:
        """Take a new registry (`InstanceTracker.follow`), poll the engines that joined,
        and move the requests off engines the registry asks to evacuate."""
        for inst in self.tracker.follow(members, make_client):
            if self.status_feed is None:  # else its reports come with the feed
                self._spawn(self._poll(inst))
        for member in members:
            if member.evacuate:
                self._evacuate(member.engine_id)
        self.tracker.forget_left(list(self.instances))

    def _evacuate(self, instance_id: InstanceId) -> None:
        for flight in self.tracker.load.flights_on(instance_id):
            try:
                self.migrate(flight.request_id, reason=MigrationReason.DRAIN)
            except ValueError as exc:  # nowhere to go: it finishes where it is
                logger.info("request %s stays on draining %s: %s", flight.request_id,
                            instance_id, exc)
