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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from app.control.fleet import Member
from app.control.observe import LoadReport
from app.engines.config import EngineRole
from app.engines.messages import TokenEvent
from app.routing.base import Listeners
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy
from app.routing.instance_view import InstanceId
from app.routing.move_path import MoveRule
from app.routing.priority import PriorityRule
from app.routing.registry import RoutingStack
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, RouteRequest
from app.serving.chooser import InstanceChooser, RequestRejected
from app.serving.flight import (
    EngineLost,
    Flight,
    FlightState,
    GenerationRequest,
    InvalidTransition,
    OutputHook,
)
from app.serving.handoff import KvHandoff
from app.serving.instances import EngineClient, InstanceTracker, LiveInstance
from app.serving.kv_transfer import KvTransport
from app.serving.moves import Moves
from app.serving.reattach import FIND_TIMEOUT_S, EngineUnanswered, Found, Reattacher
from app.serving.router_reports import RouterCounters, RouterReports
from app.serving.router_state import Background, FlightTable, RouterContext
from app.serving.status_board import StatusChanges
from app.serving.telemetry import MigrationReason, NullFactory, RouterMetrics

# what callers of the router catch and pass, wherever each is defined
__all__ = ["EngineLost", "EngineUnanswered", "Found", "LiveRouter", "Predict", "RequestRejected",
           "StatusFeed"]

logger = logging.getLogger(__name__)

ABORTED = "abort"  # finish reason of a stream we ended ourselves (migration, disconnect)

Predict = Callable[[RouteRequest], Awaitable[float]]
# the engines' reports that changed since the last call, as every replica is given them
StatusFeed = Callable[[], Awaitable[StatusChanges]]


def pieces(batch: list[TokenEvent], size: int | None) -> list[list[TokenEvent]]:
    """`batch` in consecutive pieces of at most `size` events (None: whole)."""
    if size is None or len(batch) <= size:
        return [batch]
    return [batch[start:start + size] for start in range(0, len(batch), size)]


class LiveRouter:
    """One router replica: owns its flights and their token streams, polls the engines,
    and hands each job to its part: placement (`chooser`), the P/D hand-off
    (`handoff`), moves and fail-overs (`moves`), re-attaching (`reattacher`) and
    reports (`reports`)."""

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
        disaggregated = EngineRole.PREFILL in roles
        if disaggregated and kv_transport is None:
            raise ValueError("prefill and decode pools need a KV transport")
        self.kv_transport = kv_transport
        for x in (stack.policy, stack.watchdog):
            if x is not None and x.needs_true_output_length:
                raise ValueError(f"{type(x).__name__} needs true output lengths (simulator only)")
        self.policy = stack.policy
        self.watchdog = stack.watchdog
        pd_placer: DisaggregatedPlacer | None = None
        prefill_policy: LeastTtftPolicy | None = None
        if kv_transport is not None and disaggregated:
            prefill_policy = LeastTtftPolicy()
            pd_placer = DisaggregatedPlacer(prefill_policy, stack.policy, kv_transport.link)
        # the policy's estimator when it has one, else one of our own: the instance
        # gauges show what routing sees
        self.estimator = stack.estimator or StatusEstimator()
        own = None if stack.estimator is not None else self.estimator  # else the policy feeds it
        listeners = Listeners.of(stack.policy, prefill_policy, stack.watchdog, own)
        self.metrics = metrics or RouterMetrics(NullFactory())
        self.clock = clock
        self.tracker = InstanceTracker(clients, estimator=self.estimator,
                                       listeners=listeners.every, metrics=self.metrics,
                                       clock=clock, status_timeout_s=status_timeout_s)
        self.predict = predict
        self.poll_interval_s = poll_interval_s
        self.status_feed = status_feed
        self._poll_task: asyncio.Task | None = None
        self._first_token_listeners = listeners.first_token
        self.ctx = RouterContext(self.tracker, kv_transport, self.metrics, clock, disaggregated,
                                 FlightTable(self.tracker.load),
                                 Background(self.tracker.instances))
        self.reports = RouterReports(stack.policy, listeners, self.tracker, self.metrics, clock,
                                     tell_finishes=status_feed is not None)
        self.chooser = InstanceChooser(self.ctx, stack.policy, pd_placer, self.reports,
                                       request_priority)
        self.handoff = KvHandoff(self.ctx)
        self.moves = Moves(self.ctx, stack.watchdog, self.chooser, self.handoff, self.reports,
                           move_rule=move_rule, max_failovers=max_failovers)
        self.reattacher = Reattacher(self.ctx, self.chooser, self.moves)

    @property
    def flights(self) -> dict[str, Flight]:
        """The router's flights by request id."""
        return self.ctx.flights.by_id

    @property
    def background(self) -> Background:
        """Work started and not awaited (engine aborts, first polls)."""
        return self.ctx.background

    @property
    def instances(self) -> dict[InstanceId, LiveInstance]:
        """The engines this router knows, by id."""
        return self.tracker.instances

    def view(self, now: float, exclude: frozenset[InstanceId] = frozenset(),
             role: EngineRole | None = None) -> ClusterView:
        """The healthy instances routing may pick (`RouterContext.view`)."""
        return self.ctx.view(now, exclude, role)

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
            self.moves.watch(inst, self.clock())

    async def _poll(self, inst: LiveInstance) -> None:
        """Take the instance's report, then run the watchdog over it when it is due."""
        if await self.tracker.poll(inst):
            self.moves.watch(inst, self.clock())

    # ---- routing -----------------------------------------------------------------
    async def submit(self, request: GenerationRequest, text: OutputHook | None = None) -> Flight:
        """Route a request (`routed`, then `place`); raises `RequestRejected` with the
        reason when it is not served."""
        return self.place(request, await self.routed(request), text)

    async def routed(self, request: GenerationRequest) -> RouteRequest:
        """The policy's view of a request, with its output length predicted when the
        router predicts: what `place` needs, and all of its waiting."""
        route = self.chooser.route_request(request)
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
        where it says); without one only the engine ends it. ValueError, before anything
        is decided or reported, when a request of that id is in flight (one that arrived
        while this one's length was predicted)."""
        self.ctx.flights.check_new(request.request_id)
        flight = self.chooser.place(request, route, text)
        self.ctx.flights.track(flight)
        self.reports.routed()
        return flight

    def migrate(self, request_id: str, target_id: InstanceId | None = None,
                reason: MigrationReason = MigrationReason.OPERATOR) -> InstanceId | None:
        """Move a running request (`Moves.migrate`); returns the target."""
        return self.moves.migrate(request_id, target_id, reason)

    # ---- re-attaching --------------------------------------------------------------
    async def find(self, request_id: str, timeout_s: float = FIND_TIMEOUT_S) -> Found | None:
        """Where the engines hold client request `request_id` (`Reattacher.find`)."""
        return await self.reattacher.find(request_id, timeout_s)

    def reattach(self, request: GenerationRequest, found: Found,
                 text: OutputHook | None = None, num_seen: int = 0) -> Flight:
        """Take over a request an engine already runs (or just ran) for another router
        replica, never running it twice: the flight reads its latest submission where it
        is; one that ended unfinished is placed again from its output so far by token
        ids. The output's first `num_seen` tokens are the client's already; `stream`
        yields the rest. ValueError when the engine's request is not this one."""
        flight, seen = self.reattacher.attach(request, found, text, num_seen)
        self.ctx.flights.track(flight)
        self.reports.reattached()
        self._take(flight, seen)
        return flight

    # ---- streaming -------------------------------------------------------------------
    async def stream(self, flight: Flight, chunk_tokens: int | None = None
                     ) -> AsyncIterator[list[TokenEvent]]:
        """The request's tokens (indices from 0, one stream across moves); ends the
        flight. `chunk_tokens`: an engine's batch is taken and handed on in pieces of at
        most that many tokens, so that each piece's text is its own (None: as it comes;
        the engine actor merges the batches of `stream_interval_s`)."""
        try:
            if flight.placement.backlog or flight.placement.orphaned:
                kept = self.reattacher.take_backlog(flight, self._take)
                if kept:
                    yield kept
                if flight.state is FlightState.FINISHED:
                    return
            if flight.state is FlightState.PREFILLING:
                async for kept in self.handoff.prefill_stage(flight, self._take):
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
                        self.moves.fail_over(flight, f"{type(exc).__name__}: {exc}")
                        continue
                if flight.state is FlightState.MOVING:
                    self.moves.move(flight)
                else:  # ended without finishing and nobody moved it
                    self.moves.fail_over(flight, "stream ended before the last token")
        finally:
            self._end(flight)

    def _submission(self, flight: Flight) -> AsyncIterator[list[TokenEvent]]:
        """The flight's current engine submission: started now, or read where it runs."""
        client = self.instances[flight.instance_id].client
        if flight.placement.attached:
            flight.placement.attached = False
            return client.read(flight.engine_request_id, len(flight.output.token_ids))
        return client.generate(flight.engine_request())

    def _on_submission_start(self, flight: Flight, batch: list[TokenEvent]) -> None:
        """The first tokens of a serving submission: a P/D hand-off is done, and a
        move's target or a unified engine tells what it loaded or stored."""
        if flight.kv is not None and flight.kv.held:
            self.handoff.on_decode_start(flight, batch)
        self.moves.on_submission_start(flight, batch[0])

    def _take(self, flight: Flight, batch: list[TokenEvent]) -> list[TokenEvent]:
        """Record a batch; tokens cut by our own abort keep their ids but lose the reason;
        a stop the router finds in the text ends the output at its token; an output that
        holds `max_tokens` ends with "length" whatever its last event says (an abort can
        land on an engine's last token, and there is nothing left to run elsewhere).

        Times are the router's clock when the batch arrived (what the client sees, and
        free of clock skew between the router's and the engines' nodes).
        """
        if not batch:
            return []
        now = self.clock()
        output = flight.output
        first = output.first_token_s is None
        flight.took_tokens(now)
        self.ctx.flights.recount(flight)
        if first:
            output.num_cached_tokens = batch[0].num_cached_tokens or 0
            for listener in self._first_token_listeners:
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
                    self.background.abort(flight)
        if not kept:
            return []
        output.token_ids.extend(ev.token_id for ev in kept)
        output.logprobs.extend(ev.logprobs for ev in kept)
        reason = kept[-1].finish_reason
        if reason is None and len(output.token_ids) >= flight.request.sampling.max_tokens:
            reason = "length"
            kept[-1] = replace(kept[-1], finish_reason=reason)
        if reason is not None:
            flight.finish(reason, now)
            self.ctx.flights.recount(flight)
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

    def _end(self, flight: Flight) -> None:
        """Forget a flight whose stream is over: finished, or cancelled (the client left)
        or lost (its engine failed) on the way, then abort what its engine still runs."""
        self.handoff.release(flight)
        self.ctx.flights.forget(flight)
        now = self.clock()
        if flight.state is FlightState.FINISHED:
            self.reports.finished(flight, now)
        else:
            self.background.abort(flight)  # client gone or engine lost: free the engine
            if flight.state is not FlightState.LOST:
                flight.cancel()
            self.reports.dropped(flight, now)
        self.reports.step_done(flight, now)
        if self.kv_transport is not None:
            self.kv_transport.sweep()
        used = [*flight.placement.instance_ids, flight.placement.prefill_instance_id]
        self.tracker.forget_left([iid for iid in used if iid is not None])

    def cancel(self, flight: Flight) -> None:
        """End a flight whose stream will never be read (a sibling choice was refused)."""
        if self.ctx.flights.tracks(flight):
            self._end(flight)

    # ---- reporting ----------------------------------------------------------------------
    def counters(self) -> RouterCounters:
        return self.reports.counters(len(self.flights))

    def take_finished(self) -> list[FinishReport]:
        return self.reports.take_finished()

    def learn_finished(self, reports: Sequence[FinishReport]) -> None:
        self.reports.learn_finished(reports)

    def take_load_report(self) -> LoadReport:
        return self.reports.take_load_report()

    def session_answered(self, session_id: str) -> None:
        self.reports.session_answered(session_id)

    # ---- membership -------------------------------------------------------------------
    def follow(self, members: Sequence[Member],
               make_client: Callable[[Member], EngineClient]) -> None:
        """Take a new registry (`InstanceTracker.follow`), poll the engines that joined,
        and move the requests off engines the registry asks to evacuate."""
        for inst in self.tracker.follow(members, make_client):
            if self.status_feed is None:  # else its reports come with the feed
                self.background.spawn(self._poll(inst))
        for member in members:
            if member.evacuate:
                self.moves.evacuate(member.engine_id)
        self.tracker.forget_left(list(self.instances))
