"""What a routing policy may see: the request, a snapshot of the instances, reports.

These types are shared by the live router and the offline simulator, so a policy
written against them runs unchanged on both substrates. They hold no engine
internals: only black-box figures an engine reports, plus the static hardware spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from app.engines.messages import EngineStatus
from app.routing.arrays import ViewArrays
from app.routing.instance_view import InstanceId, InstanceView

if TYPE_CHECKING:
    from app.engines.prefix import PrefixDirectory


@dataclass(frozen=True)
class RouteRequest:
    """A request as a policy sees it.

    `true_output_tokens` is filled only for policies that declare
    `needs_true_output_length` (exact lengths); everyone else must rely on
    `predicted_output_tokens`.
    """

    request_id: str
    arrival_s: float
    deadline_s: float  # absolute; math.inf when the request has no SLO
    num_prompt_tokens: int
    block_hashes: tuple[int, ...] = ()  # chained prefix hashes of the prompt
    hash_block_size: int = 16  # tokens per entry of block_hashes
    prompt: str | None = None  # text, for output-length predictors
    task: str | None = None
    # agent sessions: the conversation this request continues (None: a lone request),
    # its step within it (0 = first) and the tokens it appends to the context it extends
    session_id: str | None = None
    step_index: int = 0
    num_appended_tokens: int | None = None
    # per-request TTFT and TPOT targets (llm-d's x-slo-ttft-ms / x-slo-tpot-ms), for
    # policies that take them instead of the end-to-end deadline
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    predicted_output_tokens: int | None = None
    true_output_tokens: int | None = None  # exact lengths only
    num_generated_tokens: int = 0  # > 0 when a migrated request is re-routed
    max_output_tokens: int | None = None  # the client's max_tokens: a hard cap on the output
    # disaggregated decode: when the prompt's KV is expected on the decode instance
    # (prefill finished, transfer done); that instance then computes no prefill
    kv_ready_s: float | None = None
    # the engine priority the router sends it with (`ClusterConfig.request_priority`):
    # where engines run by priority, what runs before it there
    priority: int = 0

    @property
    def slo_s(self) -> float:
        return self.deadline_s - self.arrival_s

    @property
    def has_deadline(self) -> bool:
        return math.isfinite(self.deadline_s)

    @property
    def num_context_tokens(self) -> int:
        """Tokens the target must hold before it can generate the next one."""
        return self.num_prompt_tokens + self.num_generated_tokens


PrefixLookup = Callable[[InstanceId, Sequence[int]], int]  # (instance, hashes) -> cached blocks


@dataclass(frozen=True)
class ClusterView:
    """Immutable snapshot of the candidate instances for one routing decision.

    `prefix_lookup` answers from the instance's prefix cache (simulator) or its
    reported digest (live router); it is valid for the duration of the decision.
    """

    time_s: float
    instances: tuple[InstanceView, ...]
    prefix_lookup: PrefixLookup
    kv_capacity_floor_tokens: int = 0  # <= every instance's capacity; lets `holding` skip the scan
    columns: ViewArrays | None = None  # `instances` as columns, when the substrate keeps them
    # every instance's prefix cache at once, when the substrate keeps one (else per instance)
    prefix_directory: PrefixDirectory | None = None

    @cached_property
    def by_id(self) -> dict[InstanceId, InstanceView]:
        return {v.instance_id: v for v in self.instances}

    @property
    def arrays(self) -> ViewArrays:
        """`instances` as columns (vectorised routing): the substrate's, else built
        (once: `ViewArrays.id_rank` says why this is not one `cached_property`)."""
        return self.columns if self.columns is not None else self._built_arrays

    @cached_property
    def _built_arrays(self) -> ViewArrays:
        return ViewArrays.of(self.instances)

    def get(self, instance_id: InstanceId) -> InstanceView:
        if self.columns is not None:  # the substrate's id -> row, not a dict per snapshot
            return self.instances[self.columns.row_of[instance_id]]
        return self.by_id[instance_id]

    def prefix_hit_tokens(self, instance_id: InstanceId, request: RouteRequest) -> int:
        """Prompt tokens already cached on the instance (H_rg in the latency estimate)."""
        if not request.block_hashes:
            return 0
        blocks = self.prefix_lookup(instance_id, request.block_hashes)
        return min(blocks * request.hash_block_size, request.num_prompt_tokens)

    def prefix_hits_of(self, request: RouteRequest,
                       instance_ids: Sequence[InstanceId]) -> list[int] | np.ndarray:
        """`prefix_hit_tokens` for each of `instance_ids`, in one directory query when
        the substrate keeps a directory."""
        if not request.block_hashes:
            return np.zeros(len(instance_ids), dtype=np.int64)
        if self.prefix_directory is None:
            return [self.prefix_hit_tokens(i, request) for i in instance_ids]
        return self.prefix_directory.hit_tokens(request.block_hashes, instance_ids,
                                                request.hash_block_size,
                                                request.num_prompt_tokens)

    def holding(self, request: RouteRequest) -> Sequence[InstanceView]:
        """Instances whose KV capacity can ever hold the request, in view order."""
        need = request.num_context_tokens
        if need + 1 <= self.kv_capacity_floor_tokens:
            return self.instances
        return [v for v in self.instances if v.can_hold(need)]


class DeferredClusterView(ClusterView):
    """A snapshot that holds one instance's view and builds the others' when first
    read: a watchdog check reads its own instance every time but the others only when
    it weighs a move, and a substrate may have work to do before it can show them (the
    simulator applies their engines' iterations up to the check)."""

    def __init__(self, time_s: float, source: InstanceView,
                 build: Callable[[], ClusterView]) -> None:
        object.__setattr__(self, "time_s", time_s)
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_build", build)

    @cached_property
    def whole(self) -> ClusterView:
        """The snapshot of every instance, built on first read."""
        return self._build()

    @property  # type: ignore[override]
    def instances(self) -> tuple[InstanceView, ...]:
        return self.whole.instances

    @property  # type: ignore[override]
    def prefix_lookup(self) -> PrefixLookup:
        return self.whole.prefix_lookup

    @property  # type: ignore[override]
    def kv_capacity_floor_tokens(self) -> int:
        return self.whole.kv_capacity_floor_tokens

    @property  # type: ignore[override]
    def columns(self) -> ViewArrays | None:
        return self.whole.columns

    @property  # type: ignore[override]
    def prefix_directory(self) -> PrefixDirectory | None:
        return self.whole.prefix_directory

    def get(self, instance_id: InstanceId) -> InstanceView:
        if instance_id == self._source.instance_id:
            return self._source
        return self.whole.get(instance_id)


@dataclass(frozen=True)
class StepReport:
    """Finished engine iterations of one batch shape, back to back, as a black-box
    status estimator receives them: one, or the stretch of a decode run between two
    decisions, so that a listener takes a run in one call, not one per iteration.

    No iteration after the first starts or finishes a request, so the status's
    counters of those (finishes, queue waits) stand as read after the first."""

    instance_id: InstanceId
    start_s: float  # when the first began; each later one begins as the one before ends
    durations_s: Sequence[float]  # per iteration
    num_prefill_tokens: int  # per iteration
    num_decode_seqs: int  # per iteration
    status: EngineStatus  # queue/batch/KV figures right after the last iteration

    @property
    def first_end_s(self) -> float:
        """When the first iteration ended (its start plus its duration, as the
        substrate's clock adds them)."""
        return self.start_s + self.durations_s[0]


@dataclass(frozen=True)
class FinishReport:
    """A request that produced its last token (history predictors learn from these)."""

    request: RouteRequest
    instance_id: InstanceId
    num_output_tokens: int
    first_token_s: float | None
    finish_s: float
