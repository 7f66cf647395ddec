"""Goodput allocator and controller pool sizing: boundary, monotonicity, clamps."""

from __future__ import annotations

import pytest

from app.planning.allocator import AllocationInputs, LengthMoments, StageSizer, allocate
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.pools import Observation, PoolPolicy, size_pools
from app.planning.queues import Method

pytestmark = pytest.mark.unit

MODEL = ModelParams("toy-8b", 32, 4096, 14336, 0.25, 16, 16e9, ffn_matrices=3)
FAST = DeviceParams("FAST", 3e14, 1.2e12, 80e9, 4.0)
SLOW = DeviceParams("SLOW", 1e14, 0.6e12, 48e9, 1.0)
SLO = SloTargets(ttft_s=1.5, kv_s=0.2, tpot_s=0.02, p_slo=0.9)


def make_inputs(
    budget: float = 30.0,
    method: Method = Method.REFINED,
    input_len: LengthDist | None = None,
    prefill: tuple[DeviceParams, ...] = (FAST,),
    decode: tuple[DeviceParams, ...] = (FAST,),
) -> AllocationInputs:
    workload = LengthMoments(input_len or LengthDist.lognormal(1024, 2.0), 256.0)
    return AllocationInputs(MODEL, workload, SLO, budget, prefill, decode, method=method)


def cost_at(inputs: AllocationInputs, rate: float) -> float:
    sizer = StageSizer(MODEL, inputs.workload, SLO, inputs.method, inputs.kv_price_per_gbps_hour)
    sizing = sizer.size(rate, inputs.prefill_devices, inputs.decode_devices)
    assert sizing is not None
    return sizing.cost_per_hour


@pytest.mark.parametrize("method", list(Method))
def test_bisection_returns_the_boundary(method: Method) -> None:
    inputs = make_inputs(method=method)
    plan = allocate(inputs)
    assert plan.feasible and plan.goodput_rps > 0
    assert plan.cost_per_hour <= inputs.budget_per_hour
    assert cost_at(inputs, plan.goodput_rps) <= inputs.budget_per_hour * (1 + 1e-6)
    above = plan.goodput_rps * (1 + 3 * inputs.rel_tol)
    assert cost_at(inputs, above) > inputs.budget_per_hour


def test_plan_fields_are_consistent() -> None:
    plan = allocate(make_inputs())
    assert plan.min_batch_size <= plan.max_batch_size
    assert sum(plan.stage_costs.values()) == pytest.approx(plan.cost_per_hour)
    assert plan.slo_tax_per_hour == pytest.approx(plan.cost_per_hour - plan.stability_cost_per_hour)
    assert plan.slo_tax_per_hour >= 0
    assert plan.binding_constraint.split(":")[0] in {"prefill", "kv", "decode"}
    assert set(plan.to_dict()) >= {
        "goodput_rps",
        "num_prefill",
        "kv_bandwidth_gbps",
        "num_decode",
        "max_batch_size",
        "binding_constraint",
    }


def test_more_budget_never_lowers_goodput() -> None:
    goodputs = [allocate(make_inputs(budget=b)).goodput_rps for b in (12.0, 24.0, 48.0)]
    assert goodputs == sorted(goodputs) and goodputs[-1] > goodputs[0]


def test_heavier_tail_never_raises_goodput() -> None:
    light = allocate(make_inputs(input_len=LengthDist.exponential(1024), method=Method.PAPER))
    heavy = allocate(make_inputs(input_len=LengthDist.lognormal(1024, 2.0), method=Method.PAPER))
    assert heavy.goodput_rps <= light.goodput_rps


def test_budget_below_the_smallest_pool_is_infeasible() -> None:
    plan = allocate(make_inputs(budget=1.0))
    assert not plan.feasible and plan.goodput_rps == 0.0
    assert "budget" in plan.reason


def test_heterogeneous_choice_is_at_least_as_good_as_each_type() -> None:
    both = allocate(make_inputs(prefill=(FAST, SLOW), decode=(FAST, SLOW)))
    for prefill in (FAST, SLOW):
        for decode in (FAST, SLOW):
            single = allocate(make_inputs(prefill=(prefill,), decode=(decode,)))
            assert both.goodput_rps >= single.goodput_rps * (1 - 2e-3)


def test_bad_allocation_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="budget"):
        make_inputs(budget=-1.0)
    with pytest.raises(ValueError, match="device"):
        make_inputs(prefill=())


OBSERVATION = Observation(rate_rps=20.0, mean_input_len=1024, cv_input_len=2.0, mean_output_len=256)


def test_size_pools_for_the_controller() -> None:
    plan = size_pools(
        OBSERVATION,
        SLO,
        model="llama-3.1-8b",
        prefill_gpu="H800",
        decode_gpu="A800",
        policy=PoolPolicy(headroom=0.1),
    )
    assert plan.rate_rps == pytest.approx(22.0)
    assert plan.meets_slo and plan.clamped_by == ""
    assert plan.num_prefill >= 1 and plan.num_decode >= 1 and plan.max_batch_size >= 1
    assert (plan.prefill_gpu, plan.decode_gpu) == ("H800", "A800")


def test_more_traffic_never_needs_smaller_pools() -> None:
    sizes = []
    for rate in (5.0, 20.0, 80.0, 160.0):
        observation = Observation(rate, 1024, 2.0, 256)
        plan = size_pools(
            observation,
            SLO,
            model="llama-3.1-8b",
            prefill_gpu="H800",
            decode_gpu="A800",
            policy=PoolPolicy(headroom=0.0),
        )
        sizes.append((plan.num_prefill, plan.num_decode, plan.kv_bandwidth_gbps))
    for before, after in zip(sizes, sizes[1:], strict=False):
        assert all(a >= b for a, b in zip(after, before, strict=True))


def test_size_pools_floors_and_budget_clamp() -> None:
    floored = size_pools(
        OBSERVATION,
        SLO,
        model="llama-3.1-8b",
        prefill_gpu="H800",
        decode_gpu="A800",
        policy=PoolPolicy(min_prefill=3, min_decode=4),
    )
    assert (floored.num_prefill, floored.num_decode, floored.clamped_by) == (3, 4, "floor")
    clamped = size_pools(
        OBSERVATION,
        SLO,
        model="llama-3.1-8b",
        prefill_gpu="H800",
        decode_gpu="A800",
        policy=PoolPolicy(max_cost_per_hour=5.0),
    )
    assert clamped.clamped_by == "budget" and not clamped.meets_slo
    assert clamped.num_decode >= 1 and clamped.max_batch_size >= 1


def test_size_pools_rejects_bad_observations() -> None:
    with pytest.raises(ValueError, match="rate"):
        Observation(-1.0, 1024, 1.0, 256)
    with pytest.raises(ValueError, match="unknown GPU"):
        size_pools(OBSERVATION, SLO, model="llama-3.1-8b", prefill_gpu="X9", decode_gpu="A800")
