"""One instance as a policy sees it at one moment: its static hardware spec and the
black-box figures its engine last reported. `ClusterView` (`app.routing.view`) is a
snapshot of these; `ViewArrays` (`app.routing.arrays`) their columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.engines.config import EngineRole
from app.engines.messages import EngineStatus
from app.hardware.specs import InstanceSpec
from app.routing.priority import num_waiting_ahead

InstanceId = str


@dataclass(frozen=True)
class InstanceView:
    """One instance at one moment: static spec plus its latest black-box report."""

    instance_id: InstanceId
    spec: InstanceSpec
    role: EngineRole
    num_waiting: int
    num_running: int
    num_kv_blocks_free: int
    num_kv_blocks: int
    kv_block_size: int
    num_iterations: int
    recent_iteration_s: tuple[float, ...]  # latest iteration latencies, oldest first
    recent_queue_wait_s: tuple[float, ...]  # arrival -> first scheduled, recent requests
    updated_s: float  # when these figures were taken
    max_num_seqs: int | None = None  # the engine's configured batch cap, when known
    # an engine in priority mode: its waiting requests' priorities, ascending, as far as
    # the substrate knows them (the rest count as ahead of a newcomer,
    # `priority.num_waiting_ahead`); None: it serves its queue in arrival order
    waiting_priorities: tuple[int, ...] | None = None

    @classmethod
    def from_status(
        cls,
        status: EngineStatus,
        spec: InstanceSpec,
        max_num_seqs: int | None = None,
    ) -> InstanceView:
        """Build from the report a live engine sends (the router's path), its KV counted
        in the engine's own blocks."""
        return cls(
            instance_id=status.engine_id,
            spec=spec,
            role=EngineRole(status.role),
            num_waiting=status.num_waiting,
            num_running=status.num_running,
            num_kv_blocks_free=status.num_kv_blocks_free,
            num_kv_blocks=status.num_kv_blocks_used + status.num_kv_blocks_free,
            kv_block_size=status.kv_block_size,
            num_iterations=status.num_iterations,
            recent_iteration_s=status.recent_iteration_s,
            recent_queue_wait_s=status.recent_queue_wait_s,
            updated_s=status.time_s,
            max_num_seqs=max_num_seqs,
        )

    @property
    def gpu_type(self) -> str:
        return self.spec.gpu.name

    @property
    def num_outstanding(self) -> int:
        return self.num_waiting + self.num_running

    def num_waiting_ahead(self, priority: int) -> int:
        """Waiting requests the engine runs before a new request of `priority`."""
        return num_waiting_ahead(self.num_waiting, self.waiting_priorities, priority)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.kv_block_size

    @property
    def kv_free_tokens(self) -> int:
        return self.num_kv_blocks_free * self.kv_block_size

    def can_hold(self, num_tokens: int) -> bool:
        """Whether the request could ever run here (static KV capacity, not current load)."""
        return num_tokens + 1 <= self.kv_capacity_tokens
