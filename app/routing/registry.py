"""Policy registry keyed by enum: the config or CLI name chooses the implementation."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from app.routing.base import RoutingPolicy
from app.routing.baselines import (
    LeastRequestPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)


class PolicyKind(StrEnum):
    """CLI / config names of the routing policies."""

    RANDOM = "random"
    P2C = "p2c"
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"

    @classmethod
    def from_str(cls, name: str) -> PolicyKind:
        try:
            return cls(name.strip().lower())
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown policy {name!r}; known: {known}") from None


class PolicyRegistry:
    """PolicyKind -> policy class; `get` builds a fresh object per call."""

    def __init__(self) -> None:
        self._classes: dict[PolicyKind, type[RoutingPolicy]] = {}

    def register(self, kind: PolicyKind, cls: type[RoutingPolicy]) -> None:
        self._classes[kind] = cls

    def kinds(self) -> list[PolicyKind]:
        return list(self._classes)

    def get(self, kind: PolicyKind | str, **kwargs: Any) -> RoutingPolicy:
        """Build the policy; kwargs go to its constructor (e.g. `seed`)."""
        key = kind if isinstance(kind, PolicyKind) else PolicyKind.from_str(kind)
        if key not in self._classes:
            raise ValueError(f"policy {key.value!r} is not registered")
        return self._classes[key](**kwargs)


POLICY_REGISTRY = PolicyRegistry()
POLICY_REGISTRY.register(PolicyKind.RANDOM, RandomPolicy)
POLICY_REGISTRY.register(PolicyKind.P2C, PowerOfTwoPolicy)
POLICY_REGISTRY.register(PolicyKind.ROUND_ROBIN, RoundRobinPolicy)
POLICY_REGISTRY.register(PolicyKind.LEAST_REQUEST, LeastRequestPolicy)


def make_policy(kind: PolicyKind | str, **kwargs: Any) -> RoutingPolicy:
    return POLICY_REGISTRY.get(kind, **kwargs)
