"""Dynamo's KV router: the worker with the lowest prefill + decode block cost wins.

This follows ai-dynamo/dynamo's `DefaultWorkerSelector` (`lib/llm/src/kv_router/
scheduler.rs`, later `lib/kv-router/src/scheduling/selector.rs`) and its `ActiveSequences`
bookkeeping (`sequence.rs`). For each worker:

    logit = overlap_score_weight * prefill_tokens / block_size + decode_blocks

- `prefill_tokens`: the worker's active prefill tokens (requests routed there whose
  prefill has not completed) plus this request's tokens that the worker has not cached.
- `decode_blocks`: the distinct KV blocks of the worker's active requests, plus the
  blocks of this request that are not among them.

The cost is counted in blocks, so it does not look at GPU speed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from app.engine_types import EngineStatus
from app.routing.base import RouteDecision
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.view import (
    ClusterView,
    FinishReport,
    InstanceId,
    InstanceView,
    RouteRequest,
    StepReport,
)

OVERLAP_SCORE_WEIGHT = 1.0  # KvRouterConfig default (--kv-overlap-score-weight)
ROUTER_TEMPERATURE = 0.0  # KvRouterConfig default: deterministic lowest logit


@dataclass(frozen=True)
class ActiveSequence:
    """A routed request that has not finished, as Dynamo's router tracks it."""

    instance_id: InstanceId
    blocks: tuple[Hashable, ...]  # its prompt's KV blocks (block hashes)
    num_prefill_tokens: int  # tokens it had to prefill there (uncached)


def softmax_pick(logits: Sequence[float], temperature: float, sample: float) -> int:
    """Dynamo's `softmax_sample` on logits where lower is better.

    The logits are divided by their range and negated, then scaled by
    1/temperature. `sample` (uniform in [0, 1)) walks the cumulative
    probabilities. If every logit is equal, the choice is uniform.
    """
    low, high = min(logits), max(logits)
    if low == high:
        return min(int(sample * len(logits)), len(logits) - 1)
    weights = [math.exp(-(v - low) / ((high - low) * temperature)) for v in logits]
    total, cumulative = sum(weights), 0.0
    for i, weight in enumerate(weights):
        cumulative += weight / total
        if sample <= cumulative:
            return i
    return len(logits) - 1


class PrefillQueue:
    """The requests routed to one instance whose prefill has not completed, oldest
    first, with their uncached prompt tokens.

    Dynamo counts a request's prefill tokens in full from routing until its first
    token, when `mark_prefill_completed` drops them (ai-dynamo/dynamo:
    `RequestGuard::on_item` in `lib/llm/src/kv_router/push_router.rs`;
    `PrefillLoadTracker` in `lib/kv-router/src/sequences/prefill_tracker.rs` decays
    them only when a prefill duration is modelled). The router here hears of a
    request again only at its finish, so the completion comes from the engine's
    running count of prompt tokens computed (`EngineStatus.prefill`): the engine
    prefills first come, first served, chunk by chunk, so each computed token goes to
    the oldest request whose prefill is open, and a request's prefill completes when
    its last uncached token has been computed. A long context in chunked prefill
    counts in full until then.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}  # request id -> uncached prompt tokens, oldest first
        self.num_tokens = 0  # the queue's total: the instance's active prefill tokens
        self._num_computed_front = 0  # tokens computed toward the oldest request
        self._num_computed_total = 0  # the engine's count when last reported

    def add(self, request_id: str, num_tokens: int) -> None:
        if num_tokens > 0:  # a fully cached prompt has no prefill to track, as in Dynamo
            self._tokens[request_id] = num_tokens
            self.num_tokens += num_tokens

    def remove(self, request_id: str) -> None:
        if request_id not in self._tokens:
            return
        if request_id == next(iter(self._tokens)):
            self._num_computed_front = 0
        self.num_tokens -= self._tokens.pop(request_id)

    def computed(self, num_computed_total: int) -> None:
        """The engine reports `num_computed_total` prompt tokens computed since it
        started: complete the prefills those since the last report cover."""
        self._num_computed_front += max(0, num_computed_total - self._num_computed_total)
        self._num_computed_total = num_computed_total
        while self._tokens:
            request_id, num_tokens = next(iter(self._tokens.items()))
            if self._num_computed_front < num_tokens:
                return
            self._num_computed_front -= num_tokens
            self.num_tokens -= self._tokens.pop(request_id)
        self._num_computed_front = 0  # nothing open: tokens of no tracked request


class KvRouterPolicy(SeededPolicy):
    """Dynamo KV routing: the worker with the lowest `logit` wins. With
    `router_temperature > 0` the worker is instead drawn by softmax.

    Tracks its own active requests per instance, as Dynamo's router does. It forgets
    a request when the request finishes or is dropped; its prefill tokens stop
    counting when its prefill completes (`PrefillQueue`).

    Deviations:
    - Prefill completion is taken from the engine's count of prompt tokens computed,
      spread over the routed requests first come, first served, not from each
      request's first token (see `PrefillQueue`).
    - Ties are broken at random. Dynamo first prefers the worker with the smaller
      radix tree, which the view does not report.
    - A request without block hashes gets blocks of its own, as Dynamo does with
      `router_assume_kv_reuse=false`.
    """

    def __init__(self, seed: int = 0, overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
                 router_temperature: float = ROUTER_TEMPERATURE) -> None:
        super().__init__(seed)
        self.overlap_score_weight = overlap_score_weight
        self.router_temperature = router_temperature
        self._active: dict[str, ActiveSequence] = {}  # request id -> its sequence
        self._blocks_on: dict[InstanceId, Counter[Hashable]] = {}  # block -> active holders
        self._prefills_on: dict[InstanceId, PrefillQueue] = {}

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        blocks = self.blocks_of(request)
        hits = [int(h) for h in view.prefix_hits_of(request, [v.instance_id for v in candidates])]
        i = self._pick(self.logits(request, blocks, candidates, hits))
        num_prefill_tokens = request.num_context_tokens - hits[i]
        self._add(request.request_id,
                  ActiveSequence(candidates[i].instance_id, blocks, num_prefill_tokens))
        return candidates[i].instance_id

    def logits(self, request: RouteRequest, blocks: tuple[Hashable, ...],
               candidates: Sequence[InstanceView], hits: Sequence[int]) -> list[float]:
        """The worker cost per candidate, in blocks (lower is better); `hits` are the
        prompt tokens each candidate has cached."""
        logits = []
        for inst, hit in zip(candidates, hits, strict=True):
            active = self._blocks_on.get(inst.instance_id, Counter())
            new_blocks = sum(1 for b in blocks if b not in active)
            prefill_tokens = self.active_prefill_tokens(inst) + request.num_context_tokens - hit
            decode_blocks = len(active) + new_blocks
            logits.append(self.overlap_score_weight * prefill_tokens / request.hash_block_size
                          + decode_blocks)
        return logits

    def active_prefill_tokens(self, inst: InstanceView) -> int:
        """Uncached prompt tokens of the requests routed to `inst` whose prefill has
        not completed."""
        queue = self._prefills_on.get(inst.instance_id)
        return queue.num_tokens if queue is not None else 0

    @staticmethod
    def blocks_of(request: RouteRequest) -> tuple[Hashable, ...]:
        if request.block_hashes:
            return request.block_hashes
        num_blocks = request.num_context_tokens // request.hash_block_size
        return tuple((request.request_id, k) for k in range(num_blocks))

    def _pick(self, logits: list[float]) -> int:
        if self.router_temperature > 0:
            return softmax_pick(logits, self.router_temperature, self.rng.random())
        lowest = min(logits)
        return self.rng.choice([i for i, v in enumerate(logits) if v == lowest])

    def _prefill_queue(self, instance_id: InstanceId) -> PrefillQueue:
        return self._prefills_on.setdefault(instance_id, PrefillQueue())

    def _add(self, request_id: str, seq: ActiveSequence) -> None:
        self._forget(request_id)  # a re-routed request leaves its previous instance
        self._active[request_id] = seq
        self._blocks_on.setdefault(seq.instance_id, Counter()).update(seq.blocks)
        self._prefill_queue(seq.instance_id).add(request_id, seq.num_prefill_tokens)

    def _forget(self, request_id: str) -> None:
        seq = self._active.pop(request_id, None)
        if seq is None:
            return
        active = self._blocks_on[seq.instance_id]
        for block in seq.blocks:
            active[block] -= 1
            if not active[block]:
                del active[block]
        self._prefill_queue(seq.instance_id).remove(request_id)

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self._prefill_queue(instance_id).computed(report.status.prefill.num_tokens)

    def on_status(self, status: EngineStatus, now: float) -> None:
        self._prefill_queue(status.engine_id).computed(status.prefill.num_tokens)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self._forget(report.request.request_id)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self._forget(request.request_id)
