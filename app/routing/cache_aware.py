"""Prefix-cache-aware baselines: AIBrix `prefix-cache` and a Preble-style router.

Both read prefix hits from the view's lookup (block hashes), as the live router
does from engines' digests; neither knows deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.routing.base import RouteDecision
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.view import ClusterView, InstanceView, RouteRequest


def hit_tokens_by_instance(
    request: RouteRequest, candidates: Sequence[InstanceView], view: ClusterView
) -> dict[str, int]:
    return {v.instance_id: view.prefix_hit_tokens(v.instance_id, request) for v in candidates}


def longest_hit_holders(
    candidates: Sequence[InstanceView], hits: dict[str, int]
) -> list[InstanceView]:
    """The candidates sharing the longest cached prefix."""
    best = max(hits.values())
    return [v for v in candidates if hits[v.instance_id] == best]


class PrefixCachePolicy(SeededPolicy):
    """AIBrix prefix-cache: the longest prefix hit, unless load is too uneven.

    If the spread of outstanding requests exceeds `imbalance_threshold`, or no
    instance has a hit covering `min_hit_ratio` of the prompt, fall back to the
    least-loaded instance (AIBrix's load-imbalance guard).
    """

    def __init__(self, seed: int = 0, min_hit_ratio: float = 0.5, imbalance_threshold: int = 8):
        super().__init__(seed)
        self.min_hit_ratio = min_hit_ratio
        self.imbalance_threshold = imbalance_threshold

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        loads = [v.num_outstanding for v in candidates]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return self.least_outstanding(candidates).instance_id
        hits = hit_tokens_by_instance(request, candidates, view)
        best = max(hits.values())
        if best < self.min_hit_ratio * request.num_prompt_tokens:
            return self.least_outstanding(candidates).instance_id
        return self.least_outstanding(longest_hit_holders(candidates, hits)).instance_id


class PreblePolicy(SeededPolicy):
    """Preble-style E2: exploit a long cached prefix, otherwise explore by load cost.

    Exploit when the best hit covers more of the prompt than it misses; else pick
    the instance with the least cost = prefill of the missed tokens + the queued
    work ahead (outstanding requests x recent iteration time), both in seconds from
    the instance's own speed figures.
    """

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        hits = hit_tokens_by_instance(request, candidates, view)
        best = max(hits.values())
        if best > request.num_prompt_tokens - best:
            return self.least_outstanding(longest_hit_holders(candidates, hits)).instance_id
        return min(candidates, key=lambda v: (self._cost(v, request, hits[v.instance_id]),
                                              v.instance_id)).instance_id

    @staticmethod
    def _cost(inst: InstanceView, request: RouteRequest, hit_tokens: int) -> float:
        iteration_s = (
            sum(inst.recent_iteration_s) / len(inst.recent_iteration_s)
            if inst.recent_iteration_s else inst.spec.unloaded_decode_s_per_token
        )
        missed = request.num_context_tokens - hit_tokens
        return missed * inst.spec.unloaded_prefill_s_per_token + inst.num_outstanding * iteration_s
