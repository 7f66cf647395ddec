"""Cost-constrained goodput allocation (paper problem P1) and controller pool sizing.

Stages follow the Dynamo planner: observe -> predict -> size -> clamp.
- observe: workload statistics (rate, length moments) arrive as plain inputs.
- predict: the controller sizes for the observed rate times (1 + headroom).
- size: per stage, the smallest resources meeting its SLO at a rate: k_p by
  enumeration, B in closed form (paper) or by root finding, (k_d, N_bat) from C1-C4.
  With several candidate GPU types per pool the cheapest per pool is taken
  (heterogeneous allocation; the pools are sized independently, so this is exact).
- clamp: pool floors, then the budget. `allocate` bisects on the rate so the cost
  fits the budget; `size_pools` scales pools down proportionally when it does not.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from app.planning.decode import DecodeSizing, DecodeStage
from app.planning.distributions import LengthDist
from app.planning.kv import KvSizing, KvStage
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.prefill import PrefillSizing, PrefillStage
from app.planning.queues import Method
from app.planning.search import check_rate

DEFAULT_KV_PRICE_PER_GBPS_HOUR = 0.01  # USD per (GB/s) of KV link per hour; an assumption
BYTES_PER_GB = 1e9


@dataclass(frozen=True)
class LengthMoments:
    """Length statistics of the traffic (the rate is what the allocator decides)."""

    input_len: LengthDist  # whole prompts: what decode holds and the KV link carries
    mean_output_len: float
    # prompt tokens the serving engine has not cached (an agent step's appended tokens):
    # what prefill computes; None: the whole prompt
    uncached_len: LengthDist | None = None

    def __post_init__(self) -> None:
        if not self.mean_output_len > 0:
            raise ValueError(f"mean output length must be positive, got {self.mean_output_len}")

    @property
    def prefill_len(self) -> LengthDist:
        """Tokens a prefill computes per request."""
        return self.input_len if self.uncached_len is None else self.uncached_len


@dataclass(frozen=True)
class AllocationInputs:
    """Everything `allocate` needs; candidate device tuples enable heterogeneous pools."""

    model: ModelParams
    workload: LengthMoments
    slo: SloTargets
    budget_per_hour: float  # C_max, USD per hour
    prefill_devices: tuple[DeviceParams, ...]  # one entry fixes the prefill GPU type
    decode_devices: tuple[DeviceParams, ...]
    kv_price_per_gbps_hour: float = DEFAULT_KV_PRICE_PER_GBPS_HOUR  # C_KV
    method: Method = Method.REFINED
    rel_tol: float = 1e-3  # bisection stops when (hi - lo) <= rel_tol * hi

    def __post_init__(self) -> None:
        if not (self.budget_per_hour > 0 and math.isfinite(self.budget_per_hour)):
            raise ValueError(f"budget must be positive, got {self.budget_per_hour}")
        if not (self.prefill_devices and self.decode_devices):
            raise ValueError("need at least one prefill and one decode device type")
        if self.kv_price_per_gbps_hour < 0:
            raise ValueError(f"KV price must be >= 0, got {self.kv_price_per_gbps_hour}")


@dataclass(frozen=True)
class PoolSizing:
    """Minimum resources of all three stages for one arrival rate."""

    rate_rps: float
    prefill_device: DeviceParams
    prefill: PrefillSizing
    kv: KvSizing
    decode_device: DeviceParams
    decode: DecodeSizing
    kv_price_per_gbps_hour: float

    @property
    def stage_costs(self) -> dict[str, float]:
        """stage -> USD per hour."""
        return {
            "prefill": self.prefill.num_instances * self.prefill_device.price_per_hour,
            "kv": self.kv.bandwidth_gbps * self.kv_price_per_gbps_hour,
            "decode": self.decode.num_devices * self.decode_device.price_per_hour,
        }

    @property
    def cost_per_hour(self) -> float:
        return sum(self.stage_costs.values())

    @property
    def stage_constraints(self) -> dict[str, str]:
        """stage -> the constraint that set its size."""
        return {
            "prefill": self.prefill.binding,
            "kv": self.kv.binding,
            "decode": self.decode.binding,
        }


@dataclass(frozen=True)
class AllocationPlan:
    """The goodput-maximising allocation r = {k_p, B, k_d, N_bat} under the budget."""

    goodput_rps: float  # max lambda meeting every SLO within the budget
    num_prefill: int  # k_p instances
    prefill_gpu: str
    gpus_per_prefill: int
    kv_bandwidth_gbps: float  # B
    num_decode: int  # k_d devices
    decode_gpu: str
    max_batch_size: int  # N_bat (top of the feasible range)
    min_batch_size: int  # bottom of the feasible range at the goodput
    cost_per_hour: float
    budget_per_hour: float
    binding_constraint: str  # what stops a higher goodput, "stage:constraint"
    stage_constraints: dict[str, str] = field(default_factory=dict)  # stage -> constraint
    stage_costs: dict[str, float] = field(default_factory=dict)  # stage -> USD per hour
    stability_cost_per_hour: float = 0.0  # cheapest rho<1 / C3-only allocation, same rate
    slo_tax_per_hour: float = 0.0  # cost_per_hour - stability_cost_per_hour
    method: str = Method.REFINED.value
    feasible: bool = True
    reason: str = ""

    @classmethod
    def infeasible(cls, inputs: AllocationInputs, reason: str) -> AllocationPlan:
        return cls(
            goodput_rps=0.0,
            num_prefill=0,
            prefill_gpu="",
            gpus_per_prefill=0,
            kv_bandwidth_gbps=0.0,
            num_decode=0,
            decode_gpu="",
            max_batch_size=0,
            min_batch_size=0,
            cost_per_hour=0.0,
            budget_per_hour=inputs.budget_per_hour,
            binding_constraint="unattainable",
            method=inputs.method.value,
            feasible=False,
            reason=reason,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class StageSizer:
    """Sizes the three stages for a rate; owns per-call caches (not shared globally)."""

    def __init__(
        self,
        model: ModelParams,
        workload: LengthMoments,
        slo: SloTargets,
        method: Method,
        kv_price_per_gbps_hour: float,
    ) -> None:
        self.model, self.workload, self.slo, self.method = model, workload, slo, method
        self.kv_price = kv_price_per_gbps_hour
        self.kv = KvStage(model, workload.input_len)
        # device name -> k_d -> (C1 cap, C2 cap): rate-independent, reused across the bisection
        self._decode_caps: dict[str, dict[int, tuple[int, int | None]]] = {}
        self._kv_solved: dict[float, float] = {}  # rate -> utilization at the minimum B

    def prefill_stage(self, device: DeviceParams) -> PrefillStage:
        return PrefillStage(self.model, device, self.workload.prefill_len)

    def decode_stage(self, device: DeviceParams) -> DecodeStage:
        return DecodeStage(
            self.model, device, self.workload.input_len, self.workload.mean_output_len
        )

    def cheapest_prefill(
        self, rate: float, devices: tuple[DeviceParams, ...]
    ) -> tuple[DeviceParams, PrefillSizing] | None:
        """Cheapest (device, k_p) meeting the TTFT SLO; stability costs prune candidates."""
        best = None
        floors = [self.prefill_stage(d).stability_floor(rate) * d.price_per_hour for d in devices]
        for floor_cost, device in sorted(zip(floors, devices, strict=True), key=_first):
            if best is not None and floor_cost >= best[0]:
                break
            sizing = self.prefill_stage(device).min_instances(
                rate, self.slo.ttft_s, self.slo.p_slo, self.method
            )
            if sizing is not None and (
                best is None or sizing.num_instances * device.price_per_hour < best[0]
            ):
                best = (sizing.num_instances * device.price_per_hour, device, sizing)
        return None if best is None else (best[1], best[2])

    def cheapest_decode(
        self, rate: float, devices: tuple[DeviceParams, ...]
    ) -> tuple[DeviceParams, DecodeSizing]:
        best = None
        floors = [self.decode_stage(d).stability_floor(rate) * d.price_per_hour for d in devices]
        for floor_cost, device in sorted(zip(floors, devices, strict=True), key=_first):
            if best is not None and floor_cost >= best[0]:
                break
            caps = self._decode_caps.setdefault(device.name, {})
            sizing = self.decode_stage(device).min_devices(rate, self.slo, self.method, caps)
            cost = sizing.num_devices * device.price_per_hour
            if best is None or cost < best[0]:
                best = (cost, device, sizing)
        return best[1], best[2]

    def kv_sizing(self, rate: float) -> KvSizing:
        """Min B; utilizations solved for earlier rates seed the search (they vary smoothly)."""
        guess = None
        solved = sorted(self._kv_solved.items())
        if len(solved) >= 2 and solved[0][0] <= rate <= solved[-1][0]:
            rates, utilizations = zip(*solved, strict=True)
            guess = float(np.interp(rate, rates, utilizations))
        sizing = self.kv.min_bandwidth(
            rate, self.slo.kv_s, self.slo.p_slo, self.method, rho_guess=guess
        )
        if rate > 0:
            self._kv_solved[rate] = sizing.utilization
        return sizing

    def size(
        self,
        rate: float,
        prefill_devices: tuple[DeviceParams, ...],
        decode_devices: tuple[DeviceParams, ...],
    ) -> PoolSizing | None:
        """Minimum resources for `rate`; None when no prefill pool meets the TTFT SLO."""
        check_rate(rate)
        prefill = self.cheapest_prefill(rate, prefill_devices)
        if prefill is None:
            return None
        kv = self.kv_sizing(rate)
        decode = self.cheapest_decode(rate, decode_devices)
        return PoolSizing(rate, prefill[0], prefill[1], kv, decode[0], decode[1], self.kv_price)

    def stability_cost(
        self,
        rate: float,
        prefill_devices: tuple[DeviceParams, ...],
        decode_devices: tuple[DeviceParams, ...],
    ) -> float:
        """Cheapest allocation with only rho_p < 1, B > lambda g gamma l_i and Eq. 41."""
        prefill = min(
            self.prefill_stage(d).stability_floor(rate) * d.price_per_hour for d in prefill_devices
        )
        decode = min(
            self.decode_stage(d).stability_floor(rate) * d.price_per_hour for d in decode_devices
        )
        kv = self.kv.stability_floor(rate) / BYTES_PER_GB * self.kv_price
        return prefill + kv + decode

    def cost_slope(
        self, prefill_devices: tuple[DeviceParams, ...], decode_devices: tuple[DeviceParams, ...]
    ) -> float:
        """USD per hour per req/s that any allocation must pay (a lower bound)."""
        prefill = min(
            self.prefill_stage(d).service.mean * d.price_per_hour for d in prefill_devices
        )
        decode = min(
            d.price_per_hour
            / (self.decode_stage(d).p0 * self.decode_stage(d).saturation_throughput(1))
            for d in decode_devices
        )
        return prefill + decode + self.kv.transfer_bytes.mean / BYTES_PER_GB * self.kv_price


def _first(pair: tuple) -> float:
    return pair[0]


def allocate(inputs: AllocationInputs) -> AllocationPlan:
    """Max goodput lambda with cost <= budget and every stage SLO met (bisection on lambda)."""
    sizer = StageSizer(
        inputs.model, inputs.workload, inputs.slo, inputs.method, inputs.kv_price_per_gbps_hour
    )
    pools = (inputs.prefill_devices, inputs.decode_devices)
    budget = inputs.budget_per_hour
    base = sizer.size(0.0, *pools)
    if base is None:
        return AllocationPlan.infeasible(inputs, "prefill service time alone misses the TTFT SLO")
    if base.cost_per_hour > budget:
        return AllocationPlan.infeasible(
            inputs, f"budget {budget:.4g}/h is below the smallest pool ({base.cost_per_hour:.4g}/h)"
        )
    lo, lo_sizing = 0.0, base
    hi = budget / sizer.cost_slope(*pools)  # even stability alone costs more above this
    while hi - lo > inputs.rel_tol * hi:
        mid = 0.5 * (lo + hi)
        sizing = sizer.size(mid, *pools)
        if sizing is not None and sizing.cost_per_hour <= budget:
            lo, lo_sizing = mid, sizing
        else:
            hi = mid
    return _plan(inputs, sizer, lo_sizing, _binding(sizer, lo_sizing, hi, pools))


def _binding(
    sizer: StageSizer,
    fits: PoolSizing,
    rate_above: float,
    pools: tuple[tuple[DeviceParams, ...], tuple[DeviceParams, ...]],
) -> str:
    """The stage whose cost grows most just above the goodput, with its constraint."""
    above = sizer.size(rate_above, *pools)
    if above is None:
        return "prefill:ttft_slo"
    growth = {stage: cost - fits.stage_costs[stage] for stage, cost in above.stage_costs.items()}
    stage = max(growth, key=growth.__getitem__)
    return f"{stage}:{above.stage_constraints[stage]}"


def _plan(
    inputs: AllocationInputs, sizer: StageSizer, sizing: PoolSizing, binding: str
) -> AllocationPlan:
    stability = sizer.stability_cost(sizing.rate_rps, inputs.prefill_devices, inputs.decode_devices)
    return AllocationPlan(
        goodput_rps=sizing.rate_rps,
        num_prefill=sizing.prefill.num_instances,
        prefill_gpu=sizing.prefill_device.gpu,
        gpus_per_prefill=sizing.prefill_device.devices,
        kv_bandwidth_gbps=sizing.kv.bandwidth_gbps,
        num_decode=sizing.decode.num_devices,
        decode_gpu=sizing.decode_device.gpu,
        max_batch_size=sizing.decode.max_batch_size,
        min_batch_size=sizing.decode.min_batch_size,
        cost_per_hour=sizing.cost_per_hour,
        budget_per_hour=inputs.budget_per_hour,
        binding_constraint=binding,
        stage_constraints=sizing.stage_constraints,
        stage_costs=sizing.stage_costs,
        stability_cost_per_hour=stability,
        slo_tax_per_hour=sizing.cost_per_hour - stability,
        method=inputs.method.value,
    )
