"""Simulated instances, their pools (with the cheap routing views) and the KV link."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.engines.config import ClusterConfig, EngineRole, SchedulerConfig
from app.engines.messages import EngineStatus
from app.engines.prefix import PrefixDirectory
from app.hardware.specs import InstanceSpec
from app.routing.arrays import ViewColumns
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, DeferredClusterView
from app.sim.engine_core import DecodeRun, ScheduledStep, SimEngineCore


@dataclass(frozen=True)
class InstanceSetup:
    """One engine to simulate: hardware, scheduler knobs and role."""

    spec: InstanceSpec
    scheduler: SchedulerConfig = SchedulerConfig()
    role: EngineRole = EngineRole.UNIFIED


def setups_from_config(cluster: ClusterConfig) -> list[InstanceSetup]:
    return [InstanceSetup(e.instance, e.scheduler, e.role) for e in cluster.engines()]


class SimInstance:
    """One engine: the shared engine core plus the simulator's stepping state.

    In a decode run (`SimCluster.start_step`) the iterations of `run` before `step`
    (its last), from `run_at` (in flight), end without events of their own; the first
    that ends with a watchdog check is `check_at`. A run is planned ahead, so one cut
    short wastes the rest of its plan: `run_budget`, the repeats the next run may plan,
    doubles after a run that got through its quiet iterations and halves after one that
    was cut, which keeps the waste to about the iterations the runs did apply."""

    __slots__ = ("instance_id", "role", "role_name", "spec", "core", "pool_index", "step",
                 "run", "run_at", "check_at", "run_budget", "start_pending", "inbound")

    def __init__(self, instance_id: InstanceId, setup: InstanceSetup, pool_index: int) -> None:
        self.instance_id = instance_id
        self.role = setup.role
        self.role_name = setup.role.value  # what each status carries
        self.spec = setup.spec
        self.core = SimEngineCore(setup.spec, setup.scheduler)
        self.pool_index = pool_index
        self.step: ScheduledStep | None = None  # the iteration whose StepEndEvent is queued
        self.run: DecodeRun | None = None  # while it has iterations before `step`
        self.run_at = 0  # the run's iteration in flight
        self.check_at = 0  # the run's first iteration that ends with a watchdog check
        self.run_budget = 1
        self.start_pending = False  # a StepStartEvent is queued
        self.inbound = 0  # disaggregated: requests placed here whose KV is in transit

    @property
    def busy(self) -> bool:
        return self.step is not None or self.start_pending

    @property
    def num_held(self) -> int:
        """Requests on the engine or on their way to it (a drained engine stops at 0)."""
        return len(self.core.requests) + self.inbound

    @property
    def kv_capacity_tokens(self) -> int:
        return self.core.num_kv_blocks * self.core.config.block_size

    def fits(self, num_tokens: int) -> bool:
        """Same rule as `SimEngineCore.add_request` and `InstanceView.can_hold`."""
        return num_tokens + 1 <= self.kv_capacity_tokens

    def make_view(self, now: float) -> InstanceView:
        core = self.core
        return InstanceView(
            instance_id=self.instance_id,
            spec=self.spec,
            role=self.role,
            num_waiting=len(core.waiting),
            num_running=len(core.running),
            num_kv_blocks_free=core.num_free_blocks,
            num_kv_blocks=core.num_kv_blocks,
            kv_block_size=core.config.block_size,
            num_iterations=core.num_iterations,
            recent_iteration_s=tuple(core.recent_iteration_s),
            recent_queue_wait_s=tuple(core.recent_queue_wait_s),
            updated_s=now,
            max_num_seqs=core.config.max_num_seqs,
            waiting_priorities=core.waiting.priorities(),
        )

    def status(self, now: float) -> EngineStatus:
        return self.core.status(self.instance_id, self.role_name, now, with_digest=False)


class Pool:
    """Instances of one role, with views rebuilt only for instances that changed.

    A snapshot costs one tuple copy plus one view per instance touched since the
    last snapshot, which keeps routing O(changes) rather than O(instances x state).
    Membership can change (elastic pools): `add` appends an engine, `close` stops
    routing to one (it keeps stepping what it holds), `reopen` takes it back.
    """

    def __init__(self, role: EngineRole, instances: Sequence[SimInstance]) -> None:
        self.role = role
        self.instances: list[SimInstance] = []
        self.by_id: dict[InstanceId, SimInstance] = {}  # id -> instance
        self._views: list[InstanceView | None] = []
        self._columns = ViewColumns()  # the views as arrays, for vectorised routing
        self._prefixes = PrefixDirectory()  # every member's prefix cache, for the same
        self._dirty: set[int] = set()
        self._closed: set[int] = set()  # pool indices not offered to routing
        self._capacity_floor = 0
        for inst in instances:
            self.add(inst)

    def add(self, inst: SimInstance) -> None:
        """A new member; its `pool_index` is its position here."""
        if inst.instance_id in self.by_id:
            raise ValueError(f"{inst.instance_id} is already in the {self.role.value} pool")
        inst.pool_index = len(self.instances)
        self.instances.append(inst)
        self.by_id[inst.instance_id] = inst
        inst.core.prefix_cache.join(self._prefixes, inst.instance_id)
        self._views.append(None)
        self._dirty.add(inst.pool_index)
        self._refresh_floor()

    def close(self, inst: SimInstance) -> None:
        self._closed.add(inst.pool_index)
        self._refresh_floor()

    def reopen(self, inst: SimInstance) -> None:
        self._closed.discard(inst.pool_index)
        self._refresh_floor()

    def is_open(self, inst: SimInstance) -> bool:
        return inst.pool_index not in self._closed

    def _refresh_floor(self) -> None:
        capacities = [inst.kv_capacity_tokens for inst in self.instances
                      if inst.pool_index not in self._closed]
        self._capacity_floor = min(capacities, default=0)

    def mark_dirty(self, inst: SimInstance) -> None:
        self._dirty.add(inst.pool_index)

    def lookup(self, instance_id: InstanceId, who: str) -> SimInstance:
        inst = self.by_id.get(instance_id)
        if inst is None or not self.is_open(inst):
            raise ValueError(
                f"{who} chose {instance_id!r}, not an open {self.role.value} instance"
            )
        return inst

    def _view(self, index: int, now: float) -> InstanceView:
        """Member `index`'s view, rebuilt (and its columns) if it changed since."""
        view = self._views[index]
        if index in self._dirty:
            self._views[index] = view = self.instances[index].make_view(now)
            self._columns.set(index, view)
            self._dirty.discard(index)
        assert view is not None
        return view

    def snapshot(self, now: float, max_outstanding: int | None = None) -> ClusterView:
        """Views of the open instances, or of those under the admission cap."""
        for i in sorted(self._dirty):
            self._view(i, now)
        views: tuple[InstanceView, ...] = tuple(self._views)  # type: ignore[arg-type]
        if not self._closed and max_outstanding is None:
            return ClusterView(now, views, self.prefix_blocks, self._capacity_floor,
                               self._columns.arrays(), self._prefixes)
        rows = [i for i, v in enumerate(views) if i not in self._closed
                and (max_outstanding is None or v.num_outstanding < max_outstanding)]
        return ClusterView(now, tuple(views[i] for i in rows), self.prefix_blocks,
                           self._capacity_floor, self._columns.arrays(rows), self._prefixes)

    def check_snapshot(self, inst: SimInstance, now: float,
                       settle: Callable[[], None]) -> ClusterView:
        """`snapshot(now)` for a watchdog check of open member `inst`: its own view at
        once, the others' when the check first reads them, after `settle` brought their
        engines up to `now` (most checks read only their own)."""
        def build() -> ClusterView:
            settle()
            return self.snapshot(now)

        return DeferredClusterView(now, self._view(inst.pool_index, now), build)

    def prefix_blocks(self, instance_id: InstanceId, block_hashes: Sequence[int]) -> int:
        return self.by_id[instance_id].core.prefix_cache.peek(block_hashes)
