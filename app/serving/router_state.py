"""What the parts of a live router share: its flights (counted per engine as they
change), the work it starts without awaiting, and its engines, clock and instruments.

`LiveRouter` owns these and hands one `RouterContext` to each part (placement, the P/D
hand-off, moves, re-attach), so that every part changes flights the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.engines.config import EngineRole
from app.engines.messages import TokenEvent
from app.routing.instance_view import InstanceId
from app.routing.view import ClusterView
from app.serving.flight import Flight
from app.serving.instances import InstanceTracker, LiveInstance, OwnLoad
from app.serving.kv_transfer import KvTransport
from app.serving.telemetry import RouterMetrics

logger = logging.getLogger(__name__)

# the router records a batch of a flight's tokens and returns those the client is sent
Take = Callable[[Flight, list[TokenEvent]], list[TokenEvent]]


class FlightTable:
    """The router's flights by request id; a transition of one it tracks is recounted
    (running or waiting, where) so that the load every decision reads stays true."""

    def __init__(self, load: OwnLoad) -> None:
        self.by_id: dict[str, Flight] = {}  # request_id -> flight
        self.load = load

    def check_new(self, request_id: str) -> None:
        if request_id in self.by_id:
            raise ValueError(f"duplicate request id {request_id}")

    def tracks(self, flight: Flight) -> bool:
        return self.by_id.get(flight.request_id) is flight

    def track(self, flight: Flight) -> None:
        self.check_new(flight.request_id)
        self.by_id[flight.request_id] = flight
        self.load.update(flight)

    def recount(self, flight: Flight) -> None:
        """Keep the load counts true after a transition of a flight we track."""
        if self.tracks(flight):
            self.load.update(flight)

    def forget(self, flight: Flight) -> None:
        if self.tracks(flight):
            self.load.remove(flight)
            del self.by_id[flight.request_id]


class Background:
    """Work the router starts and does not await (aborts, polls of joining engines),
    held until done: the event loop keeps only weak references to its tasks."""

    def __init__(self, instances: dict[InstanceId, LiveInstance]) -> None:
        self.instances = instances
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Awaitable) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, flight: Flight) -> None:
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

        self.spawn(abort())


@dataclass(frozen=True)
class RouterContext:
    """One router's engines, flights, background work, clock and instruments, as every
    part of it sees them."""

    tracker: InstanceTracker
    kv_transport: KvTransport | None
    metrics: RouterMetrics
    clock: Callable[[], float]
    disaggregated: bool  # prefill and decode pools (else unified engines)
    flights: FlightTable
    background: Background

    @property
    def instances(self) -> dict[InstanceId, LiveInstance]:
        return self.tracker.instances

    @property
    def serve_role(self) -> EngineRole:
        """The role that serves a request's output: decode in P/D, else unified."""
        return EngineRole.DECODE if self.disaggregated else EngineRole.UNIFIED

    def view(self, now: float, exclude: frozenset[InstanceId] = frozenset(),
             role: EngineRole | None = None) -> ClusterView:
        """The healthy instances routing may pick (of `role`, default the serving role:
        unified or decode), with this router's load there current."""
        return self.tracker.view(now, role or self.serve_role, exclude)
