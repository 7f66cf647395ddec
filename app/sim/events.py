"""Simulator events: frozen dataclasses whose handlers return the follow-up events.

Order is `(time_s, KIND, seq)`: `heap_key` is the only definition of it. At equal
times, iterations finish first (so views are current), then KV transfers land,
then requests arrive, and batches form last, so every request that arrives at
an instant can join the batch that starts at that instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from app.sim.cluster import Flight, SimCluster
    from app.sim.engine_core import ScheduledStep
    from app.sim.instance import SimInstance


class EventKind(IntEnum):
    """Tie-break priority at equal times: lower runs first."""

    STEP_END = 0
    KV_TRANSFER_DONE = 1
    ARRIVAL = 2
    STEP_START = 3


@dataclass(frozen=True, eq=False)
class Event:
    time_s: float
    KIND: ClassVar[EventKind]

    def handle(self, cluster: SimCluster) -> list[Event]:
        raise NotImplementedError


def heap_key(event: Event, seq: int) -> tuple[float, int, int]:
    """The one sort key of the event queue; `seq` (owned by the simulator) makes it FIFO."""
    return (event.time_s, event.KIND, seq)


@dataclass(frozen=True, eq=False)
class ArrivalEvent(Event):
    """Request `index` of the workload arrives; its handler schedules the next arrival."""

    KIND = EventKind.ARRIVAL
    index: int

    def handle(self, cluster: SimCluster) -> list[Event]:
        return cluster.arrive(self.index, self.time_s)


@dataclass(frozen=True, eq=False)
class StepStartEvent(Event):
    """An idle instance with work forms its next batch."""

    KIND = EventKind.STEP_START
    instance: SimInstance

    def handle(self, cluster: SimCluster) -> list[Event]:
        return cluster.start_step(self.instance, self.time_s)


@dataclass(frozen=True, eq=False)
class StepEndEvent(Event):
    """An iteration finishes: tokens come out, watchdog and router queue get a turn."""

    KIND = EventKind.STEP_END
    instance: SimInstance
    step: ScheduledStep

    def handle(self, cluster: SimCluster) -> list[Event]:
        return cluster.end_step(self.instance, self.step, self.time_s)


@dataclass(frozen=True, eq=False)
class KvTransferDoneEvent(Event):
    """A prompt's KV reached its decode instance (disaggregated mode)."""

    KIND = EventKind.KV_TRANSFER_DONE
    flight: Flight

    def handle(self, cluster: SimCluster) -> list[Event]:
        return cluster.transfer_done(self.flight, self.time_s)
