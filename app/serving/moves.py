"""Moving a live router's flights between engines: the watchdog's checks, migrations
(SLO risk, operator, an engine leaving its pool) and fail-overs when an engine fails.

A move is asked (`migrate`: the old submission is aborted) and carried out when the
old stream ends (`move`); either way the flight continues on its target by token ids
or with the prompt's stored KV, whichever `plan_move` expects to be faster.
"""

from __future__ import annotations

import logging

from app.engines.messages import StoredPromptKv, TokenEvent
from app.engines.prefix import PREFIX_BLOCK_SIZE
from app.routing.base import ActiveRequest, Watchdog
from app.routing.instance_view import InstanceId
from app.routing.move_path import MovePath, MoveRule, plan_move
from app.serving.chooser import InstanceChooser, RequestRejected
from app.serving.flight import MOVABLE, EngineLost, Flight, MoveRecord
from app.serving.handoff import KvHandoff
from app.serving.instances import LiveInstance
from app.serving.kv_transfer import ConnectorTransport
from app.serving.router_reports import RouterReports
from app.serving.router_state import RouterContext
from app.serving.telemetry import MigrationReason

logger = logging.getLogger(__name__)


class Moves:
    """Asks, plans and carries out a router's moves; counts them in its reports."""

    def __init__(self, ctx: RouterContext, watchdog: Watchdog | None,
                 chooser: InstanceChooser, handoff: KvHandoff, reports: RouterReports, *,
                 move_rule: MoveRule, max_failovers: int) -> None:
        self.ctx = ctx
        self.watchdog = watchdog
        self.chooser = chooser
        self.handoff = handoff
        self.reports = reports
        self.move_rule = move_rule
        self.max_failovers = max_failovers

    # ---- asking ------------------------------------------------------------------------
    def watch(self, inst: LiveInstance, now: float) -> None:
        """Run the watchdog when the instance has done another check period."""
        ctx = self.ctx
        if (self.watchdog is None or inst.status is None
                or inst.client.config.role != ctx.serve_role):
            return
        epoch = inst.status.num_iterations // self.watchdog.check_period_iterations
        if epoch <= inst.watched_epoch:
            return
        inst.watched_epoch = epoch
        mine = [f for f in ctx.flights.load.flights_on(inst.instance_id)
                if f.state in MOVABLE and f.resumable]
        if not mine:
            return
        active = [ActiveRequest(f.route, f.instance_id, len(f.output.token_ids), f.is_running)
                  for f in mine]
        view = ctx.view(now)
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
        ctx = self.ctx
        flight = ctx.flights.by_id.get(request_id)
        if flight is None or flight.state not in MOVABLE:
            return None
        if not flight.resumable:
            raise ValueError(
                f"request {request_id} samples with penalties on its output, a seed or a "
                "grammar: continuing it elsewhere by token ids would change its output, so it "
                "is not moved")
        if target_id is None:
            try:
                target_id = self.chooser.choose_elsewhere(flight)
            except RequestRejected as exc:
                raise ValueError(f"cannot move request {request_id}: {exc}") from None
        target = ctx.instances.get(target_id)
        if target is None or not target.healthy:
            raise ValueError(f"unknown or unhealthy target instance {target_id!r}")
        if target_id == flight.instance_id:
            raise ValueError(f"request {request_id} is already on {target_id}")
        if target.draining:
            raise ValueError(f"target instance {target_id!r} is leaving its pool")
        ctx.background.abort(flight)
        flight.ask_move(target_id, reason)
        ctx.flights.recount(flight)
        return target_id

    def evacuate(self, instance_id: InstanceId) -> None:
        """Move every flight off an engine leaving its pool, where another can take it."""
        for flight in self.ctx.flights.load.flights_on(instance_id):
            try:
                self.migrate(flight.request_id, reason=MigrationReason.DRAIN)
            except ValueError as exc:  # nowhere to go: it finishes where it is
                logger.info("request %s stays on draining %s: %s", flight.request_id,
                            instance_id, exc)

    # ---- carrying out ------------------------------------------------------------------
    def move(self, flight: Flight) -> None:
        """Carry out an asked migration: the flight goes on where it was asked to."""
        reason = flight.placement.move_reason
        self.reports.moved(reason)
        target = flight.placement.move_to
        assert target is not None
        flight.move(self.leave_for(flight, target, reason))
        self.ctx.flights.recount(flight)

    def fail_over(self, flight: Flight, why: str) -> None:
        """Continue on another instance by token ids, or give up with `EngineLost`."""
        ctx = self.ctx
        lost = flight.instance_id
        logger.warning("request %s lost its engine %s: %s", flight.request_id, lost, why)
        # a stream can break (a cancelled call) while its engine lives; the submission
        # would run on there, in the engine's journal, beside its continuation
        ctx.background.abort(flight)
        ctx.instances[lost].healthy = False  # until it answers a poll again
        if flight.placement.num_failovers >= self.max_failovers:
            flight.lose()
            raise EngineLost(f"request {flight.request_id}: engine {lost} failed ({why})")
        try:
            target = self.chooser.choose_elsewhere(flight)
        except RequestRejected as exc:
            flight.lose()
            raise EngineLost(f"request {flight.request_id}: engine {lost} failed ({why}) "
                             f"and no other can continue it: {exc}") from None
        self.reports.failed_over()
        flight.fail_over(self.leave_for(flight, target, MigrationReason.FAILURE))
        ctx.flights.recount(flight)

    def leave_for(self, flight: Flight, target: InstanceId,
                  reason: MigrationReason) -> MoveRecord:
        """Before a flight is submitted again on `target` (a move or a fail-over): its
        path is planned (on what `target` caches before this move), the hand-off's KV
        is freed, and `target` will hold the prompt's blocks."""
        record = self._plan_move(flight, target, reason)
        self.handoff.release(flight)
        self.ctx.instances[target].remember_prefix(flight.route.block_hashes)
        return record

    def on_submission_start(self, flight: Flight, first: TokenEvent) -> None:
        """A submission's first token: a move's target says what it loaded, and a
        unified engine says where its connector stored the prompt's KV (what a later
        move may load)."""
        ctx = self.ctx
        move = flight.loading_move
        if move is not None:
            per_token = ctx.instances[move.target].spec.model.kv_bytes_per_token
            time_s = ctx.clock() - move.start_s
            move.arrive(time_s, first.num_cached_tokens or 0,
                        per_token if self._store_ttl_s() is not None else None)
            ctx.metrics.moved(move.path, time_s, move.kv_bytes)
        stored = StoredPromptKv.from_params(first.kv_transfer_params)
        if stored is not None:
            flight.placement.stored_kv, flight.placement.stored_kv_s = stored, ctx.clock()

    def _store_ttl_s(self) -> float | None:
        """How long the KV connector's store that unified engines share keeps a prompt
        (None: no store a move can load from)."""
        transport = self.ctx.kv_transport
        if isinstance(transport, ConnectorTransport) and not self.ctx.disaggregated:
            return transport.connector.kv_ttl_s
        return None

    def _plan_move(self, flight: Flight, target: InstanceId,
                   reason: MigrationReason) -> MoveRecord:
        """The move's path, by estimated time (`plan_move`): recompute the context the
        target does not cache, or load the prompt's KV its first engine's connector
        stored (shared storage outlives an engine) and compute the rest. A store older
        than half the connector's TTL is not relied on (the sweep may take it)."""
        ctx = self.ctx
        now = ctx.clock()
        placement = flight.placement
        context = flight.route.num_prompt_tokens + (
            len(flight.output.token_ids) if flight.resumable else 0)
        stored = placement.stored_kv
        loadable = 0
        ttl_s = self._store_ttl_s()
        if stored is not None and ttl_s is not None and now - placement.stored_kv_s < ttl_s / 2:
            loadable = min(stored.num_tokens, context)
        inst = ctx.instances[target]
        cached = min(ctx.tracker.prefix_blocks(target, flight.route.block_hashes)
                     * PREFIX_BLOCK_SIZE, flight.route.num_prompt_tokens)
        link = None if ctx.kv_transport is None else ctx.kv_transport.link
        plan = plan_move(inst.spec, context, cached, link, now,
                         num_loadable_tokens=loadable,
                         num_running_on_target=ctx.tracker.num_running(target),
                         rule=self.move_rule)
        if link is not None and plan.path is MovePath.KV:
            link.enqueue(now, plan.num_kv_bytes)
        ctx.metrics.migrated(reason, plan.path)
        return MoveRecord(target, reason, plan.path, plan.estimate_s, plan.num_kv_bytes,
                          load_tokens=loadable if plan.path is MovePath.KV else 0,
                          start_s=now, cached_tokens=cached)
