"""Re-attaching: a live router takes over a request another router replica started
(its replica died, or the client reconnected elsewhere), never running it twice.

The engines say where they hold the request (`find`); the flight then reads its latest
submission where it is, or is placed again from its output so far when that submission
ended unfinished.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from app.engines.messages import EngineRecord, TokenEvent
from app.routing.instance_view import InstanceId
from app.serving.chooser import InstanceChooser, RequestRejected
from app.serving.flight import MOVABLE, EngineLost, Flight, GenerationRequest, OutputHook
from app.serving.moves import Moves
from app.serving.router_state import RouterContext, Take
from app.serving.telemetry import MigrationReason

logger = logging.getLogger(__name__)

# how long a re-attach waits for each engine to say whether it runs a request: a busy
# engine actor answers late, and one not heard from cannot be assumed not to run it
FIND_TIMEOUT_S = 10.0

Found = tuple[InstanceId, EngineRecord]  # where an engine holds a client request


class EngineUnanswered(Exception):
    """An engine did not say whether it runs a request: the request cannot be safely
    started, nor re-attached, yet."""


class Reattacher:
    """Finds a request on the engines and builds the flight that takes it over."""

    def __init__(self, ctx: RouterContext, chooser: InstanceChooser, moves: Moves) -> None:
        self.ctx = ctx
        self.chooser = chooser
        self.moves = moves

    async def find(self, request_id: str, timeout_s: float = FIND_TIMEOUT_S) -> Found | None:
        """Where the engines hold client request `request_id` (another replica started
        it): its latest submission past the prefill stage, and the engine. None: no
        engine started it (a prefill stage alone counts as not started). An engine that
        does not answer within `timeout_s` may run it: `EngineUnanswered`, for starting
        it again could run it twice."""
        asks = {asyncio.ensure_future(inst.client.find(request_id)): inst
                for inst in list(self.ctx.instances.values())}
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

    def attach(self, request: GenerationRequest, found: Found, text: OutputHook | None,
               num_seen: int) -> tuple[Flight, list[TokenEvent]]:
        """The flight that takes over `request` where `found` says it runs (or ran), and
        the output's first `num_seen` events (the client's already); the rest waits in
        its backlog. ValueError when the engine's request is not this one (another
        prompt under the same id)."""
        instance_id, record = found
        if tuple(request.prompt_token_ids) != record.prompt_token_ids:
            raise ValueError(f"request id {request.request_id} is in use by another request")
        route = self.chooser.route_request(request)
        flight = Flight.routed(request, route, instance_id, None, self.ctx.disaggregated, text)
        placement = flight.placement
        placement.attempt = record.attempt
        placement.attached = not record.ended
        placement.orphaned = record.ended and not record.finished
        events = record.output_events(self.ctx.clock())
        placement.backlog = events[num_seen:]
        return flight, events[:num_seen]

    def take_backlog(self, flight: Flight, take: Take) -> list[TokenEvent]:
        """A re-attached flight's output the client has not been sent (recorded by
        `take`); one whose submission ended unfinished is then placed again (by the
        policy, anywhere)."""
        placement = flight.placement
        backlog, placement.backlog = placement.backlog, []
        kept = take(flight, backlog) if flight.state in MOVABLE else []
        if placement.orphaned and flight.state in MOVABLE:
            placement.orphaned = False
            resumed = replace(flight.route, num_generated_tokens=len(flight.output.token_ids))
            try:
                target = self.chooser.choose(resumed, self.ctx.clock())
            except RequestRejected as exc:
                flight.lose()
                raise EngineLost(f"request {flight.request_id} was left unfinished and no "
                                 f"engine can continue it: {exc}") from None
            flight.fail_over(self.moves.leave_for(flight, target, MigrationReason.FAILURE))
            self.ctx.flights.recount(flight)
        return kept
