"""Dynamo's KV router: the worker with the lowest prefill + decode block cost wins.

This follows ai-dynamo/dynamo's `DefaultWorkerSelector` (`lib/llm/src/kv_router/
scheduler.rs`, later `lib/kv-router/src/scheduling/selector.rs`) and its `ActiveSequences`
bookkeeping (`sequence.rs`). For each worker:

    logit = overlap_score_weight * prefill_tokens / block_size + decode_blocks

- `prefill_tokens`: the worker's active prefill tokens (the uncached prompt tokens of
  the requests routed there that have not produced their first token) plus this
  request's tokens that the worker has not cached.
- `decode_blocks`: the distinct KV blocks of the worker's active requests, plus the
  blocks of this request that are not among them.

The cost is counted in blocks, so it does not look at GPU speed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from app.routing.base import RouteDecision
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, FinishReport, RouteRequest

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


class KvRouterPolicy(SeededPolicy):
    """Dynamo KV routing: the worker with the lowest `logit` wins. With
    `router_temperature > 0` the worker is instead drawn by softmax.

    Tracks its own active requests per instance, as Dynamo's router does. It forgets
    a request when the request finishes or is dropped. A request's prefill tokens
    count in full from routing until its first token, when they stop counting, as
    Dynamo's `mark_prefill_completed` drops them (`RequestGuard::on_item` in
    ai-dynamo/dynamo `lib/llm/src/kv_router/push_router.rs`; its `PrefillLoadTracker`
    decays them before then only when a prefill duration is modelled). A long
    context in chunked prefill counts in full until then.

    Deviations:
    - A request re-routed after its first token (a fail-over or a move in the live
      router) counts no prefill tokens on its new instance; Dynamo counts them until
      the new stream's first token. A policy hears of one first token per request.
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
        self._prefilling: set[str] = set()  # request ids without a first token yet
        self._prefill_tokens_on: Counter[InstanceId] = Counter()  # of those, per instance

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        blocks = self.blocks_of(request)
        hits = [int(h) for h in view.prefix_hits_of(request, [v.instance_id for v in candidates])]
        i = self._pick(self.logits(request, blocks, candidates, hits))
        # re-routed after its first token (a fail-over): no other first token will come
        num_prefill_tokens = (request.num_context_tokens - hits[i]
                              if request.num_generated_tokens == 0 else 0)
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
        """Uncached prompt tokens of the requests routed to `inst` that have not
        produced their first token."""
        return self._prefill_tokens_on[inst.instance_id]

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

    def _add(self, request_id: str, seq: ActiveSequence) -> None:
        self._forget(request_id)  # a re-routed request leaves its previous instance
        self._active[request_id] = seq
        self._blocks_on.setdefault(seq.instance_id, Counter()).update(seq.blocks)
        self._prefilling.add(request_id)
        self._prefill_tokens_on[seq.instance_id] += seq.num_prefill_tokens

    def _end_prefill(self, request_id: str) -> None:
        """Its prefill tokens stop counting as its instance's active prefill."""
        if request_id in self._prefilling:
            self._prefilling.remove(request_id)
            seq = self._active[request_id]
            self._prefill_tokens_on[seq.instance_id] -= seq.num_prefill_tokens

    def _forget(self, request_id: str) -> None:
        self._end_prefill(request_id)
        seq = self._active.pop(request_id, None)
        if seq is None:
            return
        active = self._blocks_on[seq.instance_id]
        for block in seq.blocks:
            active[block] -= 1
            if not active[block]:
                del active[block]

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        self._end_prefill(request.request_id)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self._forget(report.request.request_id)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self._forget(request.request_id)
