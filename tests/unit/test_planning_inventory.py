"""Pool sizes from a priced GPU stock: SARA's stage models per homogeneous sub-pool."""

from __future__ import annotations

import pytest

from app.planning.allocator import LengthMoments
from app.planning.distributions import LengthDist
from app.planning.inventory import (
    DECODE,
    PREFILL,
    UNIFIED,
    InventorySizer,
    PoolLimits,
    Stock,
)
from app.planning.params import ModelParams, SloTargets
from app.planning.split import EngineKind

pytestmark = pytest.mark.unit

LLAMA = ModelParams.named("llama-3.1-8b")
CHAT = LengthMoments(LengthDist.from_moments(300.0, 1.5), 300.0)
SLO = SloTargets(ttft_s=0.1, kv_s=0.1, tpot_s=0.03, p_slo=0.9)
H800, A800, A40, V100 = (EngineKind("H800", 1, 256), EngineKind("A800", 1, 256),
                         EngineKind("A40", 1, 256), EngineKind("V100", 2, 256))
STOCK = [Stock(H800, 4, 3.5), Stock(A800, 8, 2.0), Stock(A40, 8, 0.8), Stock(V100, 4, 1.8)]
PD = (PREFILL, DECODE)


@pytest.fixture(scope="module")
def sizer() -> InventorySizer:
    return InventorySizer(LLAMA, CHAT, SLO, STOCK)


def test_pools_grow_with_the_rate_and_carry_it(sizer):
    previous = None
    for rate in (5.0, 50.0, 150.0):
        targets = sizer.size(rate, PD, PoolLimits())
        assert targets.meets_slo and targets.rate_rps == rate
        for role in PD:
            carried = sum(sizer.rate_of(role, k, n) for k, n in targets.engines[role].items())
            assert carried >= rate
        if previous is not None:
            assert targets.cost_per_hour >= previous.cost_per_hour
            assert targets.total(DECODE) >= previous.total(DECODE)
        previous = targets


def test_the_cheapest_capacity_fills_first_and_a_useless_kind_is_never_bought(sizer):
    # price per decode req/s: A800 2.0 / 28.8 beats H800 3.5 / 47.3 and 2xV100 1.8 / 23.7
    targets = sizer.size(50.0, PD, PoolLimits())
    assert set(targets.engines[DECODE]) == {A800}
    assert sizer.rate_of(DECODE, A40, 1) == 0.0  # an A40 misses the 30 ms TPOT even alone
    for rate in (5.0, 150.0):
        assert A40 not in sizer.size(rate, PD, PoolLimits()).engines[DECODE]


def test_a_small_rate_goes_to_the_cheapest_engine_that_carries_it(sizer):
    """At scale the best price per capacity wins; a remainder one engine can carry goes
    to the cheapest such engine, not to the kind that is cheapest per req/s."""
    small = sizer.size(5.0, (UNIFIED,), PoolLimits())
    kinds = small.engines[UNIFIED]
    assert sum(kinds.values()) == 1
    (kind,) = kinds
    cheaper = [s.kind for s in STOCK if s.price_per_hour < small.cost_per_hour
               and sizer.rate_of(UNIFIED, s.kind, 1) >= 5.0]
    assert cheaper == [], f"{kind.name} bought while {cheaper} carries 5 req/s for less"
    best_ratio = min((s for s in STOCK if sizer.rate_of(UNIFIED, s.kind, 1) > 0),
                     key=lambda s: s.price_per_hour / sizer.rate_of(UNIFIED, s.kind, 1))
    assert kind != best_ratio.kind  # the greedy-by-ratio pick would have cost more


def test_a_kind_out_of_stock_spills_to_the_next_one(sizer):
    targets = sizer.size(300.0, PD, PoolLimits())
    decode = targets.engines[DECODE]
    assert decode.get(A800) == 8  # all the A800s, then the next-cheapest capacity
    assert sum(decode.values()) > 8
    for kind, n in decode.items():
        assert n + targets.count(PREFILL, kind) <= next(s.count for s in STOCK if s.kind == kind)


def test_prefill_is_sized_as_one_shared_queue(sizer):
    one = sizer.rate_of(PREFILL, H800, 1)
    assert sizer.rate_of(PREFILL, H800, 2) > 2 * one  # pooling gain of M/G/2 over two M/G/1
    assert sizer.engines_for(PREFILL, H800, sizer.rate_of(PREFILL, H800, 3) * 0.99) == 3


def test_unified_engines_time_share_the_stages(sizer):
    prefill, decode = sizer.rate_of(PREFILL, H800, 2), sizer.rate_of(DECODE, H800, 2)
    unified = sizer.rate_of(UNIFIED, H800, 2)
    assert unified == pytest.approx(1 / (1 / prefill + 1 / decode))
    targets = sizer.size(50.0, (UNIFIED,), PoolLimits())
    assert targets.meets_slo and set(targets.engines) == {UNIFIED}
    assert sum(sizer.rate_of(UNIFIED, k, n) for k, n in targets.engines[UNIFIED].items()) >= 50


def test_floors_and_ceilings(sizer):
    floors = sizer.size(0.0, PD, PoolLimits(min_engines={PREFILL: 2, DECODE: 3}))
    assert floors.total(PREFILL) == 2 and floors.total(DECODE) == 3
    capped = sizer.size(150.0, PD, PoolLimits(max_engines={DECODE: 2}))
    assert capped.total(DECODE) <= 2 or not capped.meets_slo
    assert not capped.meets_slo


def test_over_budget_the_pools_carry_what_the_budget_buys(sizer):
    free = sizer.size(150.0, PD, PoolLimits())
    budget = free.cost_per_hour * 0.6
    clamped = sizer.size(150.0, PD, PoolLimits(budget_per_hour=budget))
    assert not clamped.meets_slo and "budget" in clamped.reason
    assert clamped.cost_per_hour <= budget and 0 < clamped.rate_rps < 150.0
    assert sizer.size(clamped.rate_rps * 1.05, PD, PoolLimits()).cost_per_hour > budget
    broke = sizer.size(150.0, PD, PoolLimits(budget_per_hour=0.1))
    assert broke.rate_rps == 0.0 and "below the pool floors" in broke.reason


def test_beyond_the_stock_every_engine_serves_with_both_pools_kept(sizer):
    targets = sizer.size(1000.0, PD, PoolLimits())
    assert not targets.meets_slo and "stock carries" in targets.reason
    assert targets.total(PREFILL) >= 1 and targets.total(DECODE) >= 1
    assert targets.total(PREFILL) + targets.total(DECODE) == sum(s.count for s in STOCK)
    unified = sizer.size(1000.0, (UNIFIED,), PoolLimits())
    assert not unified.meets_slo and A40 not in unified.engines[UNIFIED]


def test_stock_errors():
    with pytest.raises(ValueError, match="count"):
        Stock(H800, -1, 1.0)
    with pytest.raises(ValueError, match="price"):
        Stock(H800, 1, float("nan"))
    with pytest.raises(ValueError, match="once"):
        InventorySizer(LLAMA, CHAT, SLO, [Stock(H800, 1, 1.0), Stock(H800, 2, 1.0)])
    with pytest.raises(ValueError, match="role"):
        InventorySizer(LLAMA, CHAT, SLO, STOCK).rate_of("both", H800, 1)


def test_pools_keep_their_gpu_kinds_within_the_switch_margin(sizer):
    """A decode pool of 2xV100 grows in 2xV100 while that costs at most the margin more
    than the cheapest mix (A800s here: 8.9 vs 7.5 $/h at 50 req/s), and switches beyond."""
    running = {DECODE: {V100: 3}}
    cheapest = sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.0)
    assert cheapest.engines[DECODE] == {A800: 2}
    kept = sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.25)
    assert kept.engines[DECODE] == {V100: 3} and kept.meets_slo
    assert cheapest.cost_per_hour < kept.cost_per_hour <= 1.25 * cheapest.cost_per_hour
    assert sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.1).engines[DECODE] == {
        A800: 2}
    assert sizer.size(50.0, PD, PoolLimits(), {}, switch_margin=0.25).engines[DECODE] == {
        A800: 2}


def test_capacity_factors_scale_what_an_engine_carries_and_so_the_pools():
    """A calibration saying decode A800s carry half what the model says doubles the
    A800 decode engines bought for the same rate (and nothing else changes)."""
    plain = InventorySizer(LLAMA, CHAT, SLO, STOCK)
    halved = InventorySizer(LLAMA, CHAT, SLO, STOCK, factors={"decode:A800": 0.5})
    assert halved.rate_of(DECODE, A800, 3) == pytest.approx(0.5 * plain.rate_of(DECODE, A800, 3))
    assert halved.rate_of(PREFILL, H800, 2) == plain.rate_of(PREFILL, H800, 2)
    assert plain.size(50.0, PD, PoolLimits()).engines[DECODE] == {A800: 2}
    assert halved.engines_for(DECODE, A800, 50.0) == 2 * plain.engines_for(DECODE, A800, 50.0)
    slower = InventorySizer(LLAMA, CHAT, SLO, STOCK, factors={"prefill:H800": 0.5})
    assert slower.engines_for(PREFILL, H800, 200.0) > plain.engines_for(PREFILL, H800, 200.0)
    with pytest.raises(ValueError, match="must be > 0"):
        InventorySizer(LLAMA, CHAT, SLO, STOCK, factors={"decode:A800": 0.0})


def test_controller_config_rejects_capacity_factors_for_unknown_pools():
    from app.control.config import ControllerConfig

    inventory = [{"gpu_type": "A800", "count": 2}]
    ControllerConfig(inventory=inventory, capacity_factors={"decode:A800": 0.8})
    with pytest.raises(ValueError, match="names no pool"):
        ControllerConfig(inventory=inventory, capacity_factors={"decode:H800": 0.8})


def test_running_engines_are_kept_and_grown_or_trimmed_within_the_margin(sizer):
    """With engines running, the pools are those engines plus the cheapest finish for
    what they do not carry, or minus the dearest ones they can spare, while that costs
    at most the margin more than the cheapest mix."""
    running = {PREFILL: {H800: 1}, DECODE: {V100: 2, A800: 1}}
    grown = sizer.size(100.0, PD, PoolLimits(), running, switch_margin=0.25)
    assert grown.engines[DECODE][V100] >= 2 and grown.engines[DECODE][A800] >= 1
    trimmed = sizer.size(20.0, PD, PoolLimits(), running, switch_margin=0.25)
    decode = trimmed.engines[DECODE]
    assert sum(decode.values()) == 1 and trimmed.meets_slo
    fresh = sizer.size(20.0, PD, PoolLimits(), {}, switch_margin=0.25)
    assert trimmed.cost_per_hour <= 1.25 * fresh.cost_per_hour


def test_the_binding_constraint_is_the_rate_unless_budget_or_stock_fall_short(sizer):
    """What the controller exports as `goodserve_pool_binding_constraint`."""
    assert sizer.size(5.0, PD, PoolLimits()).binding == "rate"
    assert sizer.size(1e6, PD, PoolLimits()).binding == "stock"
    assert sizer.size(1e6, PD, PoolLimits(budget_per_hour=10.0)).binding == "budget"
    assert sizer.size(1e6, (UNIFIED,), PoolLimits()).binding == "stock"
