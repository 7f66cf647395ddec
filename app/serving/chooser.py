"""Where a live router's requests run: the policy's pick among the healthy instances,
or, with prefill and decode pools, a prefill and a decode instance
(`DisaggregatedPlacer`). It decides; the router tracks what it places."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from app.engines.config import EngineRole
from app.engines.prefix import prefix_block_hashes
from app.routing.base import Reject, RejectCode, RoutingPolicy
from app.routing.disaggregated import DisaggregatedPlacer
from app.routing.instance_view import InstanceId
from app.routing.priority import PriorityRule
from app.routing.view import RouteRequest
from app.serving.flight import Flight, GenerationRequest, OutputHook
from app.serving.router_reports import RouterReports
from app.serving.router_state import RouterContext


class RequestRejected(Exception):
    """The policy declined the request (admission control) or nothing can serve it."""

    def __init__(self, reason: str, code: RejectCode) -> None:
        super().__init__(reason)
        self.code = code


class InstanceChooser:
    """The routing decisions of one router: a new request's instances, and another
    instance for a flight that must leave its own."""

    def __init__(self, ctx: RouterContext, policy: RoutingPolicy,
                 pd_placer: DisaggregatedPlacer | None, reports: RouterReports,
                 request_priority: PriorityRule) -> None:
        self.ctx = ctx
        self.policy = policy
        self.pd_placer = pd_placer
        self.reports = reports
        self.request_priority = request_priority

    def route_request(self, request: GenerationRequest) -> RouteRequest:
        """The policy's view of a request (its deadline, prefix blocks, priority)."""
        self.ctx.flights.check_new(request.request_id)
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

    def place(self, request: GenerationRequest, route: RouteRequest,
              text: OutputHook | None = None) -> Flight:
        """The flight of a request placed by its `route`, reported and with its prompt's
        blocks remembered where they will be cached; raises `RequestRejected`."""
        ctx = self.ctx
        started = time.perf_counter()
        try:
            prefill, target = self._place(route, ctx.clock(), request.sampling.resumable)
        except RequestRejected as exc:
            self.reports.rejected(route, exc.code)
            raise
        self.reports.arrived(route, prefill or target)
        placed = time.perf_counter()
        ctx.metrics.routed(ctx.instances[target].tags, placed - started)
        ctx.metrics.placed(placed - request.received_perf_s)
        flight = Flight.routed(request, route, target, prefill, ctx.disaggregated, text)
        for iid in {prefill or target, target}:
            ctx.instances[iid].remember_prefix(route.block_hashes)
        return flight

    def _place(self, route: RouteRequest, now: float,
               resumable: bool = True) -> tuple[InstanceId | None, InstanceId]:
        """(prefill instance or None when unified, the decode / unified instance).

        A request that cannot continue by token ids (a grammar, penalties on the output,
        a seeded sampler) cannot take its first token from a prefill engine either: its
        decode engine computes the prompt itself."""
        if self.pd_placer is None or not resumable:
            return None, self.choose(route, now)
        prefill_view = self.ctx.view(now, role=EngineRole.PREFILL)
        decode_view = self.ctx.view(now)
        if not prefill_view.instances or not decode_view.instances:
            raise RequestRejected("no healthy prefill or decode instance is available",
                                  RejectCode.NO_INSTANCE)
        placement = self.pd_placer.place(route, prefill_view, decode_view, now)
        if isinstance(placement, Reject):
            raise RequestRejected(placement.reason, placement.code)
        return placement.prefill_instance, placement.decode_instance

    def choose(self, route: RouteRequest, now: float,
               exclude: frozenset[InstanceId] = frozenset(),
               role: EngineRole | None = None) -> InstanceId:
        """The policy's pick among the healthy instances of `role` (default serving)
        other than `exclude`; raises `RequestRejected`."""
        view = self.ctx.view(now, exclude, role)
        if not view.instances:
            raise RequestRejected("no healthy engine instance is available",
                                  RejectCode.NO_INSTANCE)
        decision = self.policy.choose(route, view, now)
        if isinstance(decision, Reject):
            raise RequestRejected(decision.reason, decision.code)
        return decision

    def choose_elsewhere(self, flight: Flight) -> InstanceId:
        """The policy's pick for the request as it stands now (prompt + generated ids to
        re-prefill), among the instances other than its current one; with no decode
        instance left, a prefill engine (same model) carries on."""
        resumed = replace(flight.route, num_generated_tokens=len(flight.output.token_ids))
        exclude = frozenset({flight.instance_id})
        clock = self.ctx.clock
        try:
            return self.choose(resumed, clock(), exclude=exclude)
        except RequestRejected:
            if not self.ctx.disaggregated:
                raise
            return self.choose(resumed, clock(), exclude=exclude, role=EngineRole.PREFILL)
