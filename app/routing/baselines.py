"""Load-balancing baselines: SLO-unaware, one short class each.

Every policy routes only to instances whose KV capacity can hold the request and
rejects the request when none can. Ties are broken with the policy's own RNG so
a cold cluster does not pile everything onto the first instance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from app.routing.base import Reject, RejectCode, RouteDecision, RoutingPolicy
from app.routing.instance_view import InstanceView
from app.routing.view import ClusterView, RouteRequest


def no_fit(request: RouteRequest) -> Reject:
    return Reject(f"no instance can hold {request.num_context_tokens} tokens",
                  RejectCode.CONTEXT_TOO_LONG)


class SeededPolicy(RoutingPolicy):
    """Base for policies that need randomness: one private RNG per object."""

    deadline_aware: ClassVar[bool] = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)

    def least_outstanding(self, candidates: Sequence[InstanceView]) -> InstanceView:
        fewest = min(v.num_outstanding for v in candidates)
        return self.rng.choice([v for v in candidates if v.num_outstanding == fewest])


class RandomPolicy(SeededPolicy):
    """Uniformly random among the instances that can hold the request."""

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        return self.rng.choice(candidates).instance_id


class PowerOfTwoPolicy(SeededPolicy):
    """Power of two choices: sample two instances, take the one with fewer requests."""

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        n = len(candidates)
        if n == 1:
            return candidates[0].instance_id
        i, j = self.rng.randrange(n), self.rng.randrange(n - 1)  # two distinct, O(1)
        pair = (candidates[i], candidates[j + (j >= i)])
        return self.least_outstanding(pair).instance_id


class LeastRequestPolicy(SeededPolicy):
    """Fewest outstanding (waiting + running) requests, random among ties."""

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        return self.least_outstanding(candidates).instance_id


class RoundRobinPolicy(SeededPolicy):
    """Cycles through the instances in view order, skipping ones that cannot hold it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.num_routed = 0

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        chosen = candidates[self.num_routed % len(candidates)]
        self.num_routed += 1
        return chosen.instance_id
