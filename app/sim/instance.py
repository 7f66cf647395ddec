"""Simulated instances, their pools (with the cheap routing views) and the KV link."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.config import ClusterConfig, EngineRole, SchedulerConfig
from app.engine_types import EngineStatus
from app.hardware import InstanceSpec
from app.routing.view import ClusterView, InstanceId, InstanceView
from app.sim.engine_core import ScheduledStep, SimEngineCore


@dataclass(frozen=True)
class InstanceSetup:
    """One engine to simulate: hardware, scheduler knobs and role."""

    spec: InstanceSpec
    scheduler: SchedulerConfig = SchedulerConfig()
    role: EngineRole = EngineRole.UNIFIED


def setups_from_config(cluster: ClusterConfig) -> list[InstanceSetup]:
    return [InstanceSetup(e.instance, e.scheduler, e.role) for e in cluster.engines()]


class SimInstance:
    """One engine: the shared engine core plus the simulator's stepping state."""

    __slots__ = ("instance_id", "role", "spec", "core", "pool_index", "step", "start_pending")

    def __init__(self, instance_id: InstanceId, setup: InstanceSetup, pool_index: int) -> None:
        self.instance_id = instance_id
        self.role = setup.role
        self.spec = setup.spec
        self.core = SimEngineCore(setup.spec, setup.scheduler)
        self.pool_index = pool_index
        self.step: ScheduledStep | None = None  # iteration in flight
        self.start_pending = False  # a StepStartEvent is queued

    @property
    def busy(self) -> bool:
        return self.step is not None or self.start_pending

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
        )

    def status(self, now: float) -> EngineStatus:
        return self.core.status(self.instance_id, self.role.value, now, with_digest=False)


class Pool:
    """Instances of one role, with views rebuilt only for instances that changed.

    A snapshot costs one tuple copy plus one view per instance touched since the
    last snapshot, which keeps routing O(changes) rather than O(instances x state).
    """

    def __init__(self, role: EngineRole, instances: Sequence[SimInstance]) -> None:
        self.role = role
        self.instances = list(instances)
        self.by_id = {inst.instance_id: inst for inst in self.instances}  # id -> instance
        self._views: list[InstanceView | None] = [None] * len(self.instances)
        self._dirty: set[int] = set(range(len(self.instances)))
        self._capacity_floor = min(inst.kv_capacity_tokens for inst in self.instances)

    def mark_dirty(self, inst: SimInstance) -> None:
        self._dirty.add(inst.pool_index)

    def lookup(self, instance_id: InstanceId, who: str) -> SimInstance:
        try:
            return self.by_id[instance_id]
        except KeyError:
            raise ValueError(
                f"{who} chose {instance_id!r}, not a {self.role.value} instance"
            ) from None

    def snapshot(self, now: float, max_outstanding: int | None = None) -> ClusterView:
        """Views of all instances, or of those under the admission cap."""
        for i in self._dirty:
            self._views[i] = self.instances[i].make_view(now)
        self._dirty.clear()
        views: tuple[InstanceView, ...] = tuple(self._views)  # type: ignore[arg-type]
        if max_outstanding is not None:
            views = tuple(v for v in views if v.num_outstanding < max_outstanding)
        return ClusterView(now, views, self.prefix_blocks, self._capacity_floor)

    def prefix_blocks(self, instance_id: InstanceId, block_hashes: Sequence[int]) -> int:
        return self.by_id[instance_id].core.prefix_cache.peek(block_hashes)
