"""Elastic pools in the simulator: a scaler decides every interval, engines boot and drain.

The simulator's counterpart of the controller actor. Every `interval_s` of virtual
time the scaler (the SARA controller, or an autoscaler it is compared with) sees the
engine registry and returns a plan diff; this shell applies it: new engines join
their pool `startup_s` later, drained engines stop taking requests, are stopped once
empty, and past the drain deadline their requests move by token ids to the
instance the routing policy picks. GPU time is counted from an engine's start to its
stop, start-up included, since a booting GPU is paid for.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from app.config import EngineRole, SchedulerConfig
from app.control.controller import ControlStep
from app.control.observe import LoadWindow
from app.control.plan import EngineRecord, EngineState
from app.hardware import make_instance
from app.planning.inventory import Stock
from app.planning.split import EngineKind
from app.routing.base import Reject
from app.sim.events import ControlEvent, EngineReadyEvent, Event
from app.sim.instance import InstanceSetup, SimInstance

if TYPE_CHECKING:
    from app.sim.cluster import SimCluster


class Scaler(Protocol):
    """Anything that turns observations and the registry into plan diffs (the SARA
    `Controller`, or an autoscaler it is compared with)."""

    @property
    def interval_s(self) -> float: ...

    @property
    def window(self) -> LoadWindow: ...  # the routers' reports go here

    def step(self, now: float, engines: Sequence[EngineRecord]) -> ControlStep: ...


@dataclass(frozen=True)
class PoolSample:
    """Pool sizes after one control step (for plots)."""

    time_s: float
    serving: Mapping[str, int]  # role -> engines taking requests
    starting: Mapping[str, int]  # role -> engines booting
    draining: int


@dataclass
class ElasticStats:
    """What the run cost and how often engines moved."""

    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    num_started: int = 0
    num_stopped: int = 0
    num_drain_migrations: int = 0  # requests moved off draining engines
    stopped_s: dict[str, float] = field(default_factory=dict)  # engine id -> when stopped
    samples: list[PoolSample] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0


def engine_setup(model: str, role: str, kind: EngineKind) -> InstanceSetup:
    """A simulated engine of `kind` serving `model` in `role`."""
    scheduler = SchedulerConfig() if kind.max_num_seqs is None else SchedulerConfig(
        max_num_seqs=kind.max_num_seqs)
    return InstanceSetup(make_instance(kind.gpu, model, kind.tp), scheduler, EngineRole(role))


class ElasticPools:
    """Applies a scaler's plan diffs to a `SimCluster`'s pools."""

    def __init__(self, scaler: Scaler, model: str, stock: Sequence[Stock],
                 startup_s: float) -> None:
        if startup_s < 0:
            raise ValueError(f"start-up time must be >= 0, got {startup_s}")
        self.scaler = scaler
        self.model = model
        self.prices = {s.kind: s.price_per_hour for s in stock}
        self.startup_s = startup_s
        self.records: dict[str, EngineRecord] = {}
        self.instances: dict[str, SimInstance] = {}
        self.started_s: dict[str, float] = {}
        self.stats = ElasticStats()
        self.steps: list[ControlStep] = []  # every decision, with what it was based on
        self._ids = itertools.count()
        self.cluster: SimCluster | None = None

    def attach(self, cluster: SimCluster, now: float) -> list[Event]:
        """Register the cluster's initial engines (serving at `now`); first control step."""
        self.cluster = cluster
        for pool in cluster.pools.values():
            for inst in pool.instances:
                kind = EngineKind(inst.spec.gpu.name, inst.spec.tp, inst.core.config.max_num_seqs)
                self.prices.setdefault(kind, inst.spec.gpu.price_per_hour * inst.spec.tp)
                self._register(inst, kind, EngineState.ACTIVE, now)
        return [ControlEvent(now + self.scaler.interval_s)]

    # ---- registry -------------------------------------------------------------
    def _register(self, inst: SimInstance, kind: EngineKind, state: EngineState,
                  now: float) -> None:
        self.instances[inst.instance_id] = inst
        self.records[inst.instance_id] = EngineRecord(inst.instance_id, inst.role.value, kind,
                                                      state, now)
        self.started_s[inst.instance_id] = now

    def _set_state(self, engine_id: str, state: EngineState, now: float) -> None:
        self.records[engine_id] = replace(self.records[engine_id], state=state, since_s=now)

    def registry(self) -> list[EngineRecord]:
        """Records with current running counts (what the routers would report)."""
        return [self._reported(r, self.instances[r.engine_id]) for r in self.records.values()]

    @staticmethod
    def _reported(record: EngineRecord, inst: SimInstance) -> EngineRecord:
        core = inst.core
        return replace(record, running=inst.num_held, waiting=len(core.waiting),
                       kv_usage=1.0 - core.num_free_blocks / core.num_kv_blocks)

    # ---- control steps -------------------------------------------------------------
    def control(self, now: float) -> list[Event]:
        cluster = self._cluster()
        step = self.scaler.step(now, self.registry())
        self.steps.append(step)
        diff = step.diff
        events: list[Event] = []
        for role, kind in diff.start:
            events.append(self._start(role, kind, now))
        for engine_id in diff.reactivate:
            self._set_state(engine_id, EngineState.ACTIVE, now)
            inst = self.instances[engine_id]
            cluster.pools[inst.role].reopen(inst)
        for engine_id in diff.drain:
            self._set_state(engine_id, EngineState.DRAINING, now)
            inst = self.instances[engine_id]
            cluster.pools[inst.role].close(inst)
        for engine_id in diff.stop:
            self._stop(engine_id, now)
        for engine_id in diff.migrate:
            events.extend(self._evacuate(engine_id, now))
        if diff.reactivate:
            events.extend(cluster.drain_router_queue(now))
        self._sample(now)
        if not cluster.finished:
            events.append(ControlEvent(now + self.scaler.interval_s))
        return events

    def _start(self, role: str, kind: EngineKind, now: float) -> EngineReadyEvent:
        setup = engine_setup(self.model, role, kind)
        inst = SimInstance(f"{setup.spec.name}-{role}-x{next(self._ids)}", setup, -1)
        self._register(inst, kind, EngineState.STARTING, now)
        self.stats.num_started += 1
        return EngineReadyEvent(now + self.startup_s, inst)

    def ready(self, inst: SimInstance, now: float) -> list[Event]:
        """A started engine finished booting (unless it was stopped meanwhile)."""
        record = self.records.get(inst.instance_id)
        if record is None or record.state is not EngineState.STARTING:
            return []
        cluster = self._cluster()
        self._set_state(inst.instance_id, EngineState.ACTIVE, now)
        cluster.pools[inst.role].add(inst)
        return cluster.drain_router_queue(now)

    def _stop(self, engine_id: str, now: float) -> None:
        record = self.records.pop(engine_id)
        inst = self.instances.pop(engine_id)
        if record.state is not EngineState.STARTING:  # a booting engine never joined a pool
            if inst.num_held:
                raise RuntimeError(f"{engine_id} stopped with requests on it")
            self._cluster().pools[inst.role].close(inst)
        self._charge(engine_id, record.kind, now)
        self.stats.num_stopped += 1
        self.stats.stopped_s[engine_id] = now

    def _charge(self, engine_id: str, kind: EngineKind, now: float) -> None:
        seconds = now - self.started_s.pop(engine_id)
        self.stats.gpu_seconds += seconds * kind.tp
        self.stats.cost_usd += seconds / 3600.0 * self.prices.get(kind, 0.0)

    def _evacuate(self, engine_id: str, now: float) -> list[Event]:
        """Move a draining engine's requests by token ids to where the policy routes them."""
        cluster = self._cluster()
        inst = self.instances[engine_id]
        pool = cluster.pools[inst.role]
        events: list[Event] = []
        for request_id in list(inst.core.requests):
            view = pool.snapshot(now)
            flight = cluster.flights[request_id]
            choice = cluster.policy.choose(flight.route, view, now) if view.instances else None
            if choice is None or isinstance(choice, Reject):
                continue  # nowhere to go: it finishes where it is
            events.extend(cluster.migrate(inst, request_id, choice, now))
            self.stats.num_drain_migrations += 1
        return events

    def _sample(self, now: float) -> None:
        serving: dict[str, int] = {}
        starting: dict[str, int] = {}
        for record in self.records.values():
            if record.state is EngineState.ACTIVE:
                serving[record.role] = serving.get(record.role, 0) + 1
            elif record.state is EngineState.STARTING:
                starting[record.role] = starting.get(record.role, 0) + 1
        draining = sum(r.state is EngineState.DRAINING for r in self.records.values())
        self.stats.samples.append(PoolSample(now, serving, starting, draining))

    def close_books(self, now: float) -> ElasticStats:
        """End of run: charge every engine still held up to `now`."""
        for engine_id, record in list(self.records.items()):
            self._charge(engine_id, record.kind, now)
        self.records.clear()
        return self.stats

    def _cluster(self) -> SimCluster:
        if self.cluster is None:
            raise RuntimeError("elastic pools are not attached to a cluster")
        return self.cluster
