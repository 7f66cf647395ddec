"""Simulator events: frozen dataclasses whose handlers return the follow-up events.

Order is `(time_s, KIND, seq)`: `heap_key` is the only definition of it. At equal
times, iterations finish first (so views are current), then KV transfers land,
booted engines join their pool, requests arrive, batches form, and the elastic
pools' controller decides last, on the state every other event of that instant left.

A handler sees the cluster through `ClusterHandlers` and the elastic pools through
`ElasticHooks`, the methods it calls on them, so the events depend on neither module.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Protocol

from app.sim.engine_core import ScheduledStep
from app.sim.flight import SimFlight
from app.sim.instance import SimInstance


class EventKind(IntEnum):
    """Tie-break priority at equal times: lower runs first."""

    STEP_END = 0
    KV_TRANSFER_DONE = 1
    ENGINE_READY = 2
    ARRIVAL = 3
    STEP_START = 4
    CONTROL = 5


class ElasticHooks(Protocol):
    """What the cluster and the elastic pools' events call on the pools
    (`app.sim.elastic.ElasticPools`)."""

    def arrived(self, flight: SimFlight, now: float) -> None: ...

    def finished(self, flight: SimFlight, inst: SimInstance, now: float) -> list[Event]: ...

    def context_moved(self, move: ContextMoveDoneEvent, now: float) -> list[Event]: ...

    def ready(self, inst: SimInstance, now: float) -> list[Event]: ...

    def control(self, now: float) -> list[Event]: ...


class ClusterHandlers(Protocol):
    """What the events call on the cluster they run on (`app.sim.cluster.SimCluster`):
    one handler body per event."""

    elastic: ElasticHooks | None

    def arrive(self, index: int, now: float) -> list[Event]: ...

    def start_step(self, inst: SimInstance, now: float) -> list[Event]: ...

    def end_step(self, inst: SimInstance, step: ScheduledStep, now: float) -> list[Event]: ...

    def transfer_done(self, flight: SimFlight, target: SimInstance, num_resumed: int,
                      now: float) -> list[Event]: ...


@dataclass(frozen=True, eq=False)
class Event:
    time_s: float
    KIND: ClassVar[EventKind]

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        raise NotImplementedError


def heap_key(event: Event, seq: int) -> tuple[float, int, int]:
    """The one sort key of the event queue; `seq` (owned by the simulator) makes it FIFO."""
    return (event.time_s, event.KIND, seq)


@dataclass(frozen=True, eq=False)
class ArrivalEvent(Event):
    """Request `index` of the workload arrives; its handler schedules the next arrival."""

    KIND = EventKind.ARRIVAL
    index: int

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        return cluster.arrive(self.index, self.time_s)


@dataclass(frozen=True, eq=False)
class StepStartEvent(Event):
    """An idle instance with work forms its next batch."""

    KIND = EventKind.STEP_START
    instance: SimInstance

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        return cluster.start_step(self.instance, self.time_s)


@dataclass(frozen=True, eq=False)
class StepEndEvent(Event):
    """An iteration finishes: tokens come out, watchdog and router queue get a turn."""

    KIND = EventKind.STEP_END
    instance: SimInstance
    step: ScheduledStep

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        return cluster.end_step(self.instance, self.step, self.time_s)


@dataclass(frozen=True, eq=False)
class KvTransferDoneEvent(Event):
    """A request's KV reached its target: a prompt's at its decode instance
    (disaggregated mode, `num_resumed` 1), or a moved request's context."""

    KIND = EventKind.KV_TRANSFER_DONE
    flight: SimFlight
    target: SimInstance
    num_resumed: int  # output tokens generated before the transfer

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        return cluster.transfer_done(self.flight, self.target, self.num_resumed, self.time_s)


@dataclass(frozen=True, eq=False)
class ContextMoveDoneEvent(Event):
    """A session's context, moved off a draining engine during its tool wait, reached
    its target's prefix cache (`ElasticPools.context_moved`)."""

    KIND = EventKind.KV_TRANSFER_DONE
    session_id: str
    source: SimInstance
    target: SimInstance
    block_hashes: tuple[int, ...]
    hash_block_size: int

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        assert cluster.elastic is not None
        return cluster.elastic.context_moved(self, self.time_s)


@dataclass(frozen=True, eq=False)
class EngineReadyEvent(Event):
    """An engine the controller started has booted and joins its pool."""

    KIND = EventKind.ENGINE_READY
    instance: SimInstance

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        assert cluster.elastic is not None
        return cluster.elastic.ready(self.instance, self.time_s)


@dataclass(frozen=True, eq=False)
class ControlEvent(Event):
    """The elastic pools' scaler takes its interval's decision."""

    KIND = EventKind.CONTROL

    def handle(self, cluster: ClusterHandlers) -> list[Event]:
        assert cluster.elastic is not None
        return cluster.elastic.control(self.time_s)
