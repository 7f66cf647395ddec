"""SARA: SLO-aware resource allocation for disaggregated (prefill/decode) serving.

Pure, Ray-free and clock-agnostic. Start with `allocate` (goodput under a budget) or
`size_pools` (the controller's per-interval call); README.md documents the models.
"""

from app.planning.allocator import AllocationInputs, AllocationPlan, LengthMoments, allocate
from app.planning.distributions import LengthDist, TailKind
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.pools import (
    Observation,
    PoolPlan,
    PoolPolicy,
    device_candidates,
    plan_for_rate,
    size_pools,
)
from app.planning.queues import Method

__all__ = [
    "AllocationInputs",
    "AllocationPlan",
    "DeviceParams",
    "LengthDist",
    "Method",
    "ModelParams",
    "Observation",
    "PoolPlan",
    "PoolPolicy",
    "SloTargets",
    "TailKind",
    "LengthMoments",
    "allocate",
    "device_candidates",
    "plan_for_rate",
    "size_pools",
]
