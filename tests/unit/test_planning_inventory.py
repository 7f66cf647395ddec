"""Pool sizes from a priced GPU stock: SARA's stage models per homogeneous sub-pool."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence

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


def test_the_cheapest_mix_beats_the_cheapest_capacity_and_a_useless_kind_is_never_bought(
        sizer):
    # price per decode req/s: A800 2.0 / 28.8 beats H800 3.5 / 47.3 and 2xV100 1.8 / 23.7,
    # but at 50 req/s one A800 and one 2xV100 (3.8 $/h) undercut two A800s (4.0 $/h)
    targets = sizer.size(50.0, PD, PoolLimits())
    assert targets.engines[DECODE] == {A800: 1, V100: 1}
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
    than the cheapest mix (one A800 and one 2xV100 here: 8.9 vs 7.3 $/h at 50 req/s), and
    switches beyond."""
    running = {DECODE: {V100: 3}}
    cheapest = sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.0)
    assert cheapest.engines[DECODE] == {A800: 1, V100: 1}
    kept = sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.25)
    assert kept.engines[DECODE] == {V100: 3} and kept.meets_slo
    assert cheapest.cost_per_hour < kept.cost_per_hour <= 1.25 * cheapest.cost_per_hour
    assert sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.1).engines[DECODE] == {
        A800: 1, V100: 1}
    assert sizer.size(50.0, PD, PoolLimits(), {}, switch_margin=0.25).engines[DECODE] == {
        A800: 1, V100: 1}


def test_capacity_factors_scale_what_an_engine_carries_and_so_the_pools():
    """A calibration saying decode A800s carry half what the model says doubles the
    A800 decode engines a rate needs (and nothing else changes), so the mix drops them."""
    plain = InventorySizer(LLAMA, CHAT, SLO, STOCK)
    halved = InventorySizer(LLAMA, CHAT, SLO, STOCK, factors={"decode:A800": 0.5})
    assert halved.rate_of(DECODE, A800, 3) == pytest.approx(0.5 * plain.rate_of(DECODE, A800, 3))
    assert halved.rate_of(PREFILL, H800, 2) == plain.rate_of(PREFILL, H800, 2)
    assert plain.size(50.0, PD, PoolLimits()).engines[DECODE] == {A800: 1, V100: 1}
    assert A800 not in halved.size(50.0, PD, PoolLimits()).engines[DECODE]
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


def test_idle_pools_keep_the_kinds_they_run_at_their_floors(sizer):
    """At rate 0 the floors go to kinds the pools run, dearer or not, so an idle interval
    does not swap engines; with nothing running, to the cheapest that can serve."""
    running = {PREFILL: {A800: 2}, DECODE: {H800: 3}}
    idle = sizer.size(0.0, PD, PoolLimits(), running)
    assert idle.engines == {PREFILL: {A800: 1}, DECODE: {H800: 1}} and idle.meets_slo
    assert sizer.size(0.0, PD, PoolLimits()).engines == {PREFILL: {A40: 1}, DECODE: {V100: 1}}


def test_keeping_what_runs_stays_within_the_budget(sizer):
    """Kept 2xV100 decoders cost 8.9 $/h at 50 req/s, within the 0.25 margin of the
    cheapest mix's 7.3 but over a budget of 8: the cheapest mix, which meets the SLOs,
    is bought instead; under a binding budget the kept pools fit it too."""
    running = {PREFILL: {H800: 1}, DECODE: {V100: 3}}
    free = sizer.size(50.0, PD, PoolLimits(), running, switch_margin=0.25)
    assert free.engines[DECODE] == {V100: 3} and free.cost_per_hour > 8.0
    capped = sizer.size(50.0, PD, PoolLimits(budget_per_hour=8.0), running, switch_margin=0.25)
    assert capped.meets_slo and capped.cost_per_hour <= 8.0
    assert capped.engines[DECODE] == {A800: 1, V100: 1}
    for budget in (6.0, 8.0, 12.0):
        for rate in (50.0, 150.0):
            bound = sizer.size(rate, PD, PoolLimits(budget_per_hour=budget), running, 0.25)
            assert bound.cost_per_hour <= budget
            assert bound.meets_slo or bound.binding == "budget"


# ---- the exact mix, on made-up rates ---------------------------------------------------

Rates = Mapping[str, Mapping[EngineKind, Callable[[int], float]]]  # role -> kind -> rate(n)


class TableSizer(InventorySizer):
    """The real solver over made-up rates: `rates[role][kind](n)` for n engines."""

    def __init__(self, stock: Sequence[Stock], rates: Rates) -> None:
        super().__init__(LLAMA, CHAT, SLO, stock)
        self.rates = rates

    def rate_of(self, role: str, kind: EngineKind, engines: int) -> float:
        return self.rates[role][kind](engines) if engines > 0 else 0.0


def linear(per_engine: float) -> Callable[[int], float]:
    return lambda n: n * per_engine


def test_the_cheapest_mix_is_exact_where_a_greedy_fill_is_not():
    """13 req/s of decode: A (6 req/s, 5 $/h, one in stock) + 2 x B (4 req/s, 4 $/h)
    carry 14 for 13 $/h, where the greedy fill by price per req/s, finishing with the
    cheapest kind that carries the whole rate alone, bought one C (13 req/s) for 14."""
    a, b, c = EngineKind("A"), EngineKind("B"), EngineKind("C")
    stock = [Stock(a, 1, 5.0), Stock(b, 10, 4.0), Stock(c, 10, 14.0)]
    sizer = TableSizer(stock, {DECODE: {a: linear(6.0), b: linear(4.0), c: linear(13.0)}})
    targets = sizer.size(13.0, (DECODE,), PoolLimits())
    assert targets.engines == {DECODE: {a: 1, b: 2}} and targets.cost_per_hour == 13.0
    assert sizer.fill(DECODE, 13.0, {s.kind: s.count for s in stock}) == ({a: 1, b: 2}, 0.0)
    # floors and ceilings are constraints of the same problem
    assert sizer.size(13.0, (DECODE,), PoolLimits({DECODE: 4})).engines == {DECODE: {b: 4}}
    assert sizer.size(13.0, (DECODE,), PoolLimits(max_engines={DECODE: 1})).engines == {
        DECODE: {c: 1}}
    # what the stock cannot carry, `fill` leaves over after the most it can
    assert sizer.fill(DECODE, 20.0, {a: 1, b: 2}) == ({a: 1, b: 2}, 6.0)


def test_prefill_and_decode_share_the_stock():
    """Three cheap X carry 10 req/s each in either role; 20 req/s in both needs four:
    the two pools split the three X and one dear Y tops up one of them."""
    x, y = EngineKind("X"), EngineKind("Y")
    sizer = TableSizer([Stock(x, 3, 1.0), Stock(y, 4, 5.0)],
                       {role: {x: linear(10.0), y: linear(10.0)} for role in PD})
    targets = sizer.size(20.0, PD, PoolLimits())
    assert targets.count(PREFILL, x) + targets.count(DECODE, x) == 3
    assert targets.count(PREFILL, y) + targets.count(DECODE, y) == 1
    assert targets.cost_per_hour == 8.0 and targets.meets_slo


def pooled(per_engine: float, gain: float) -> Callable[[int], float]:
    """A shared queue: n engines carry more than n times one (the M/G/n gain)."""
    return lambda n: per_engine * n ** gain


def brute_force(sizer: InventorySizer, stock: Sequence[Stock], rate: float,
                limits: PoolLimits) -> tuple[float, float]:
    """(cheapest cost carrying `rate` in both pools, highest rate up to `rate` the budget
    buys), over every engine count per pool and kind; inf and -inf when none."""
    kinds = [s.kind for s in stock]
    pools = list(itertools.product(*(range(s.count + 1) for s in stock)))
    cheapest, most = math.inf, -math.inf
    for counts in itertools.product(pools, repeat=len(PD)):
        if any(sum(c[i] for c in counts) > s.count for i, s in enumerate(stock)):
            continue
        if any(not limits.floor(r) <= sum(c) <= limits.ceiling(r)
               for r, c in zip(PD, counts, strict=True)):
            continue
        carried = min(sum(sizer.rate_of(r, k, n) for k, n in zip(kinds, c, strict=True))
                      for r, c in zip(PD, counts, strict=True))
        cost = sum(s.price_per_hour * n for c in counts for s, n in zip(stock, c, strict=True))
        if carried >= rate:
            cheapest = min(cheapest, cost)
        if limits.budget_per_hour is not None and cost <= limits.budget_per_hour:
            most = max(most, min(carried, rate))
    return cheapest, most


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mix_is_the_cheapest_every_engine_count_finds(seed):
    """Small random stocks (pooled prefill, linear decode, floors and ceilings): the
    sizer's cost is the brute force's, and under a budget the rate it buys too."""
    rng = random.Random(seed)
    kinds = (H800, A800, V100)  # real names: a stock too short goes to `split_inventory`
    for _ in range(8):
        stock = [Stock(k, rng.randint(1, 3), rng.randint(1, 8) / 2) for k in kinds]
        rates = {PREFILL: {k: pooled(rng.uniform(2, 10), rng.uniform(1, 1.5)) for k in kinds},
                 DECODE: {k: linear(rng.uniform(2, 10)) for k in kinds}}
        sizer = TableSizer(stock, rates)
        limits = PoolLimits({role: rng.choice((1, 2)) for role in PD},
                            {role: rng.choice((2, 3, math.inf)) for role in PD})
        rate = rng.uniform(3, 20)
        cheapest, _ = brute_force(sizer, stock, rate, limits)
        targets = sizer.size(rate, PD, limits)
        assert targets.meets_slo == (cheapest < math.inf)
        if not targets.meets_slo:
            continue
        assert targets.cost_per_hour == pytest.approx(cheapest)
        for role in PD:
            assert sizer.carried(role, targets.engines[role]) >= rate
            assert limits.floor(role) <= targets.total(role) <= limits.ceiling(role)
        for s in stock:
            assert targets.count(PREFILL, s.kind) + targets.count(DECODE, s.kind) <= s.count
        floors, _ = brute_force(sizer, stock, 0.0, limits)
        budget = floors + rng.uniform(-0.2, 0.8) * (cheapest - floors)
        budget = math.floor(budget * 2) / 2 + 0.25  # off the 0.5 $/h price grid
        capped = PoolLimits(limits.min_engines, limits.max_engines, budget)
        _, most = brute_force(sizer, stock, rate, capped)
        bought = sizer.size(rate, PD, capped)
        if most == -math.inf:
            assert "below the pool floors" in bought.reason
        else:
            assert bought.rate_rps == pytest.approx(most) and bought.cost_per_hour <= budget
