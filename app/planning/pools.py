"""Controller-facing pool sizing: observed rate and length moments -> (k_p, k_d).

The SARA controller actor calls `size_pools` every interval; it is pure and cheap,
so the actor only adds hysteresis, draining and engine creation around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from app.hardware.specs import GPU_CATALOG
from app.planning.allocator import (
    DEFAULT_KV_PRICE_PER_GBPS_HOUR,
    LengthMoments,
    PoolSizing,
    StageSizer,
)
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.queues import Method

NOT_FOR_SALE = frozenset({"cpu"})  # the fitted vllm-cpu profile is a test fixture
MAX_GPUS_PER_INSTANCE = 8


@dataclass(frozen=True)
class Observation:
    """What the controller measured over its last interval (the observe stage)."""

    rate_rps: float
    mean_input_len: float
    cv_input_len: float
    mean_output_len: float
    # prompt tokens not cached where the request ran (agent steps); None: whole prompts
    mean_uncached_len: float | None = None
    cv_uncached_len: float | None = None
    # tokens of session context held on the decoders between steps (agent sessions in a
    # tool wait), total over the pool; None: no sessions observed
    held_kv_tokens: float | None = None

    def __post_init__(self) -> None:
        if not (self.rate_rps >= 0 and math.isfinite(self.rate_rps)):
            raise ValueError(f"observed rate must be >= 0, got {self.rate_rps}")
        if self.held_kv_tokens is not None and not self.held_kv_tokens >= 0:
            raise ValueError(f"held KV must be >= 0 tokens, got {self.held_kv_tokens}")
        if (self.mean_uncached_len is None) != (self.cv_uncached_len is None):
            raise ValueError("give both the uncached length's mean and CV, or neither")

    @property
    def workload(self) -> LengthMoments:
        input_len = LengthDist.from_moments(self.mean_input_len, self.cv_input_len)
        uncached = (None if self.mean_uncached_len is None else
                    LengthDist.from_moments(self.mean_uncached_len, self.cv_uncached_len))
        return LengthMoments(input_len, self.mean_output_len, uncached)


@dataclass(frozen=True)
class PoolPolicy:
    """Predict and clamp knobs."""

    headroom: float = 0.1  # size for observed rate * (1 + headroom)
    min_prefill: int = 1
    min_decode: int = 1
    max_cost_per_hour: float | None = None  # scale pools down proportionally above this
    kv_price_per_gbps_hour: float = DEFAULT_KV_PRICE_PER_GBPS_HOUR
    method: Method = Method.REFINED

    def __post_init__(self) -> None:
        if self.headroom < 0:
            raise ValueError(f"headroom must be >= 0, got {self.headroom}")
        if self.min_prefill < 0 or self.min_decode < 0:
            raise ValueError("pool floors must be >= 0")


@dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for the controller; `meets_slo` is False after a budget clamp."""

    rate_rps: float  # the predicted rate the pools are sized for
    num_prefill: int  # k_p instances of `gpus_per_prefill` GPUs
    num_decode: int  # k_d decode devices
    max_batch_size: int  # N_bat for the decode pool
    kv_bandwidth_gbps: float  # B
    prefill_gpu: str
    decode_gpu: str
    gpus_per_prefill: int
    cost_per_hour: float
    stage_constraints: dict[str, str] = field(default_factory=dict)  # stage -> constraint
    stability_cost_per_hour: float = 0.0  # cheapest rho<1 / C3-only pools at this rate
    slo_tax_per_hour: float = 0.0  # SLO-sized cost above the stability-only cost
    clamped_by: str = ""  # "", "floor" or "budget"
    meets_slo: bool = True
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def device_candidates(
    gpus: Sequence[str] | None, model: ModelParams, role: str
) -> tuple[DeviceParams, ...]:
    """GPUs as prefill instances or decode devices; empty `gpus` means the whole catalog."""
    names = list(gpus) if gpus else catalog_gpus(model)
    if role == "prefill":
        return tuple(DeviceParams.instance_for(name, model) for name in names)
    if role == "decode":
        return tuple(DeviceParams.named(name) for name in names)
    raise ValueError(f"unknown pool role {role!r}; expected 'prefill' or 'decode'")


def catalog_gpus(model: ModelParams) -> list[str]:
    """Purchasable catalog GPUs that hold the weights with at most MAX_GPUS_PER_INSTANCE."""
    return [
        gpu.name
        for gpu in GPU_CATALOG.values()
        if gpu.name not in NOT_FOR_SALE
        and gpu.price_per_hour > 0
        and DeviceParams.instance_for(gpu.name, model).devices <= MAX_GPUS_PER_INSTANCE
    ]


def size_pools(
    observation: Observation,
    slo: SloTargets,
    *,
    model: str,
    prefill_gpu: str,
    decode_gpu: str,
    policy: PoolPolicy = PoolPolicy(),
) -> PoolPlan:
    """observe -> predict -> size -> clamp for fixed GPU types per pool (the controller's call)."""
    params = ModelParams.named(model)
    rate = observation.rate_rps * (1.0 + policy.headroom)
    return plan_for_rate(
        rate,
        observation.workload,
        slo,
        params,
        (DeviceParams.instance_for(prefill_gpu, params),),
        (DeviceParams.named(decode_gpu),),
        policy,
    )


def plan_for_rate(
    rate_rps: float,
    workload: LengthMoments,
    slo: SloTargets,
    model: ModelParams,
    prefill_devices: tuple[DeviceParams, ...],
    decode_devices: tuple[DeviceParams, ...],
    policy: PoolPolicy = PoolPolicy(),
) -> PoolPlan:
    """Size and clamp the pools for one rate; several candidate devices pick the cheapest."""
    sizer = StageSizer(model, workload, slo, policy.method, policy.kv_price_per_gbps_hour)
    sizing = sizer.size(rate_rps, prefill_devices, decode_devices)
    if sizing is None:
        return PoolPlan(
            rate_rps,
            policy.min_prefill,
            max(policy.min_decode, 1),
            0,
            0.0,
            prefill_devices[0].gpu,
            decode_devices[0].gpu,
            prefill_devices[0].devices,
            0.0,
            meets_slo=False,
            reason="prefill service time alone misses the TTFT SLO",
        )
    stability = sizer.stability_cost(rate_rps, prefill_devices, decode_devices)
    return _clamp(sizer, sizing, policy, stability)


def _clamp(
    sizer: StageSizer, sizing: PoolSizing, policy: PoolPolicy, stability_cost: float
) -> PoolPlan:
    """Floors first, then a proportional scale-down to the budget (Dynamo's order)."""
    num_prefill = max(sizing.prefill.num_instances, policy.min_prefill)
    num_decode = max(sizing.decode.num_devices, policy.min_decode)
    clamped_by = (
        "floor"
        if (num_prefill, num_decode) != (sizing.prefill.num_instances, sizing.decode.num_devices)
        else ""
    )
    prefill_price = sizing.prefill_device.price_per_hour
    decode_price = sizing.decode_device.price_per_hour
    kv_cost = sizing.stage_costs["kv"]
    cost = num_prefill * prefill_price + num_decode * decode_price + kv_cost
    limit = policy.max_cost_per_hour
    decode = sizer.decode_stage(sizing.decode_device)
    if limit is not None and cost > limit:
        scale = max(limit - kv_cost, 0.0) / (cost - kv_cost)
        weights_floor = decode.device_floors(0.0)[0]
        num_prefill = max(policy.min_prefill, math.floor(num_prefill * scale))
        num_decode = max(policy.min_decode, weights_floor, math.floor(num_decode * scale))
        clamped_by = "budget"
        cost = num_prefill * prefill_price + num_decode * decode_price + kv_cost
    bounds = decode.batch_bounds(num_decode, sizing.rate_rps, sizer.slo, sizer.method)
    return PoolPlan(
        rate_rps=sizing.rate_rps,
        num_prefill=num_prefill,
        num_decode=num_decode,
        max_batch_size=max(bounds.upper, 0),
        kv_bandwidth_gbps=sizing.kv.bandwidth_gbps,
        prefill_gpu=sizing.prefill_device.gpu,
        decode_gpu=sizing.decode_device.gpu,
        gpus_per_prefill=sizing.prefill_device.devices,
        cost_per_hour=cost,
        stage_constraints=sizing.stage_constraints,
        stability_cost_per_hour=stability_cost,
        slo_tax_per_hour=sizing.cost_per_hour - stability_cost,
        clamped_by=clamped_by,
        meets_slo=clamped_by != "budget",
        reason="scaled down to the cost limit; SLOs not guaranteed"
        if clamped_by == "budget"
        else "",
    )
