"""Pool sizes from a GPU inventory with counts and prices: the controller's allocator.

SARA sizes a homogeneous pool exactly: k_p from the M/G/k prefill model, a decode
engine's rate from C1-C4 (`split.engine_capacity`). An inventory offers several
engine kinds in limited numbers, so a pool is a union of homogeneous sub-pools,
filled in order of price per unit of capacity: the cheapest kind takes as much of the
rate as its stock allows, the next kind the rest; as soon as a kind not used yet can
carry the whole remainder, the cheapest such kind finishes the pool.
- Prefill engines of one kind share one queue (M/G/n; least-TTFT routing approximates
  it), so a sub-pool is sized by `PrefillStage.min_instances`.
- Decode engines each run their own batch: n engines carry n times one engine's rate.
- Unified engines time-share the two stages: n engines carry
  1 / (1 / r_prefill(n) + 1 / r_decode(n)), the rate at which the two stages' busy
  fractions add up to one (an approximation: chunked prefill overlaps some of it).
Prefill and decode draw on the same stock: both orders are tried and the cheaper plan
kept. Above the budget the pools are sized for the highest rate the budget buys
(problem P1 by bisection on the rate) and the targets say the SLOs are not met.
The KV link is the cluster's, not sized here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from app.planning.allocator import LengthMoments
from app.planning.params import ModelParams, SloTargets
from app.planning.prefill import PrefillStage
from app.planning.queues import Method
from app.planning.search import first_true, max_feasible_rate
from app.planning.split import (
    EngineCapacity,
    EngineKind,
    engine_capacity,
    prefill_stage,
    split_inventory,
)

PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
BUDGET_RATE_RTOL = 1e-3


@dataclass(frozen=True)
class Stock:
    """What the inventory offers of one engine kind: engines at once, USD/h each."""

    kind: EngineKind
    count: int
    price_per_hour: float

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"{self.kind.name}: stock count must be >= 0, got {self.count}")
        if not (self.price_per_hour >= 0 and math.isfinite(self.price_per_hour)):
            raise ValueError(f"{self.kind.name}: price must be >= 0, got {self.price_per_hour}")


@dataclass(frozen=True)
class PoolLimits:
    """Floors and ceilings per role (engines), and the budget (USD/h, None: unlimited)."""

    min_engines: Mapping[str, int] = field(default_factory=dict)
    max_engines: Mapping[str, int] = field(default_factory=dict)
    budget_per_hour: float | None = None

    def floor(self, role: str) -> int:
        return self.min_engines.get(role, 1)

    def ceiling(self, role: str) -> int:
        return self.max_engines.get(role, math.inf)


@dataclass(frozen=True)
class PoolTargets:
    """Engines per role and kind for a predicted rate."""

    rate_rps: float  # the rate the pools are sized for (below the prediction if clamped)
    engines: dict[str, dict[EngineKind, int]]  # role -> kind -> engines
    cost_per_hour: float
    meets_slo: bool  # False: the stock or the budget cannot carry the predicted rate
    reason: str = ""
    binding: str = "rate"  # what set the size: the rate, or the budget or stock short of it

    def count(self, role: str, kind: EngineKind) -> int:
        return self.engines.get(role, {}).get(kind, 0)

    def total(self, role: str) -> int:
        return sum(self.engines.get(role, {}).values())


class InventorySizer:
    """Sizes pools from a stock for one workload and SLO; caches per-kind capacities."""

    def __init__(self, model: ModelParams, workload: LengthMoments, slo: SloTargets,
                 stock: Sequence[Stock], method: Method = Method.REFINED,
                 factors: Mapping[str, float] | None = None) -> None:
        """`factors`: measured / modelled rate per pool and kind (`capacity_key`), from
        a calibration against the engines; 1 where absent."""
        names = [s.kind.name for s in stock]
        if len(set(names)) < len(names):
            raise ValueError(f"each engine kind appears once in the stock, got {names}")
        self.model, self.workload, self.slo, self.method = model, workload, slo, method
        self.stock = {s.kind: s for s in stock if s.count > 0}
        self._capacity: dict[EngineKind, EngineCapacity] = {}
        self._prefill_rate: dict[tuple[EngineKind, int], float] = {}
        self.factors = dict(factors or {})
        for key, value in self.factors.items():
            if not value > 0:
                raise ValueError(f"capacity factor {key} must be > 0, got {value}")

    def factor(self, role: str, kind: EngineKind) -> float:
        return self.factors.get(capacity_key(role, kind), 1.0)

    def capacity(self, kind: EngineKind) -> EngineCapacity:
        if kind not in self._capacity:
            self._capacity[kind] = engine_capacity(kind, self.model, self.workload, self.slo,
                                                   self.method)
        return self._capacity[kind]

    def _prefill_stage(self, kind: EngineKind) -> PrefillStage:
        return prefill_stage(kind, self.model, self.workload)

    def rate_of(self, role: str, kind: EngineKind, engines: int) -> float:
        """Largest rate `engines` engines of `kind` carry in `role` within the SLOs."""
        if engines <= 0:
            return 0.0
        if role == DECODE:
            return engines * self.capacity(kind).decode_rps * self.factor(DECODE, kind)
        key = (kind, engines)
        if key not in self._prefill_rate:
            stage = self._prefill_stage(kind)
            rate = 0.0
            if self.capacity(kind).prefill_rps > 0:
                rate = max_feasible_rate(
                    lambda r: stage.meets_slo(r, engines, self.slo.ttft_s, self.slo.p_slo,
                                              self.method),
                    engines / stage.service.mean)
            self._prefill_rate[key] = rate
        prefill = self._prefill_rate[key]
        if role == PREFILL:
            return prefill * self.factor(PREFILL, kind)
        if role != UNIFIED:
            raise ValueError(f"unknown role {role!r}")
        decode = engines * self.capacity(kind).decode_rps
        if prefill == 0 or decode == 0:
            return 0.0
        return self.factor(UNIFIED, kind) / (1.0 / prefill + 1.0 / decode)

    def carried(self, role: str, engines: Mapping[EngineKind, int]) -> float:
        """The rate a pool of `engines` (kind -> count) carries in `role`."""
        return sum(self.rate_of(role, kind, n) for kind, n in engines.items())

    def engines_for(self, role: str, kind: EngineKind, rate: float) -> int:
        """Fewest engines of `kind` carrying `rate` in `role` (its stock permitting or not)."""
        if rate <= 0:
            return 0
        if role == PREFILL:
            sizing = self._prefill_stage(kind).min_instances(
                rate / self.factor(PREFILL, kind), self.slo.ttft_s, self.slo.p_slo, self.method)
            return math.inf if sizing is None else sizing.num_instances
        if self.rate_of(role, kind, 1) == 0:
            return math.inf
        if role == DECODE:
            return math.ceil(rate / self.rate_of(DECODE, kind, 1))
        return first_true(lambda n: self.rate_of(role, kind, n) >= rate, 0)

    def fill(self, role: str, rate: float, available: Mapping[EngineKind, int],
             ceiling: float = math.inf) -> tuple[dict[EngineKind, int], float]:
        """Engines per kind for `rate`, cheapest capacity first; and the rate left over.

        Whenever some kind not used yet can carry the whole remainder, the cheapest
        such finish ends the fill: a small rate goes to one cheap engine rather than to
        the kind with the best price per capacity (which only pays at scale)."""
        usable = [k for k, n in available.items() if n > 0 and self.rate_of(role, k, 1) > 0]
        usable.sort(key=lambda k: (self.stock[k].price_per_hour / self.rate_of(role, k, 1),
                                   k.name))
        chosen: dict[EngineKind, int] = {}
        left = rate
        for i, kind in enumerate(usable):
            room_left = ceiling - sum(chosen.values())
            if left <= 0 or room_left <= 0:
                break
            finish = self._cheapest_finish(role, left, usable[i:], available, room_left)
            if finish is not None:
                chosen[finish[0]] = finish[1]
                left = 0.0
                break
            chosen[kind] = min(available[kind], room_left)
            left -= self.rate_of(role, kind, chosen[kind])
        return chosen, max(left, 0.0)

    def _cheapest_finish(self, role: str, rate: float, kinds: Sequence[EngineKind],
                         available: Mapping[EngineKind, int],
                         room: float) -> tuple[EngineKind, int] | None:
        """(kind, engines) carrying all of `rate` at the lowest price, if any can."""
        options = []
        for kind in kinds:
            need = self.engines_for(role, kind, rate)
            if need <= min(available[kind], room):
                options.append((need * self.stock[kind].price_per_hour, kind.name, kind, need))
        if not options:
            return None
        _, _, kind, need = min(options)
        return kind, need

    def size(self, rate: float, roles: Sequence[str], limits: PoolLimits,
             present: Mapping[str, Mapping[EngineKind, int]] | None = None,
             switch_margin: float = 0.0) -> PoolTargets:
        """Targets for `rate`; over the budget, for the highest rate it buys. Pool floors
        are met with kinds a role already runs (`present`) before the cheapest ones, so
        an idle interval does not swap engines; and the pools keep the engines they run
        (grown by the cheapest finish, or trimmed of the dearest they can spare) while
        that costs at most `switch_margin` more than the cheapest mix (each switch of
        kind pays a start-up and a drain)."""
        present = present or {}
        targets = self._size_unclamped(rate, roles, limits, present, switch_margin)
        budget = limits.budget_per_hour
        if budget is None or targets.cost_per_hour <= budget:
            return targets
        floor = self._size_unclamped(0.0, roles, limits, present, switch_margin)
        if floor.cost_per_hour > budget:
            return PoolTargets(0.0, floor.engines, floor.cost_per_hour, False,
                               f"budget {budget:g}/h is below the pool floors "
                               f"({floor.cost_per_hour:g}/h)", "budget")
        affordable = max_feasible_rate(
            lambda r: self._size_unclamped(r, roles, limits, present,
                                           switch_margin).cost_per_hour <= budget,
            rate, BUDGET_RATE_RTOL)
        best = self._size_unclamped(affordable, roles, limits, present, switch_margin)
        return PoolTargets(best.rate_rps, best.engines, best.cost_per_hour, False,
                           f"budget {budget:g}/h buys {affordable:.3g} of {rate:.3g} req/s",
                           "budget")

    def _size_unclamped(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                        present: Mapping[str, Mapping[EngineKind, int]],
                        switch_margin: float = 0.0) -> PoolTargets:
        plans = [self._size_in_order(rate, order, limits, present) for order in _orders(roles)]
        feasible = [p for p in plans if p.meets_slo]
        if not feasible:
            return self._whole_stock(rate, roles, limits)
        cheapest = min(feasible, key=lambda t: t.cost_per_hour)
        if switch_margin > 0 and any(present.values()):
            kept = self._incremental(rate, roles, limits, present)
            if (kept.meets_slo
                    and kept.cost_per_hour <= cheapest.cost_per_hour * (1 + switch_margin)):
                return kept
        return cheapest

    def _incremental(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                     present: Mapping[str, Mapping[EngineKind, int]]) -> PoolTargets:
        """The running engines, plus the cheapest finish for what they do not carry, or
        minus the dearest engines they can spare."""

        def pool(role: str, available: Mapping[EngineKind, int]
                 ) -> tuple[dict[EngineKind, int], float]:
            kept = {k: min(n, available.get(k, 0)) for k, n in present.get(role, {}).items()
                    if n > 0 and k in available}
            carried = self.carried(role, kept)
            if carried >= rate:
                return self._trimmed(role, kept, rate, limits.floor(role)), 0.0
            rest = {k: n - kept.get(k, 0) for k, n in available.items()}
            added, left = self.fill(role, rate - carried, rest,
                                    limits.ceiling(role) - sum(kept.values()))
            for k, n in added.items():
                kept[k] = kept.get(k, 0) + n
            return kept, left

        return self._pools(rate, roles, pool)

    def _trimmed(self, role: str, kept: dict[EngineKind, int], rate: float,
                 floor: int) -> dict[EngineKind, int]:
        """`kept` less the dearest engines it can spare while still carrying `rate`."""
        while sum(kept.values()) > floor:
            dear = sorted((k for k, n in kept.items() if n > 0),
                          key=lambda k: -self.stock[k].price_per_hour)
            for k in dear:
                trial = dict(kept)
                trial[k] -= 1
                if self.carried(role, trial) >= rate:
                    kept = trial
                    break
            else:
                break
        return kept

    def _pools(self, rate: float, roles: Sequence[str],
               pool: Callable[[str, Mapping[EngineKind, int]],
                              tuple[dict[EngineKind, int], float]]) -> PoolTargets:
        """Targets from `pool(role, stock left)` -> (engines per kind, rate left over),
        the roles served one after the other from one stock."""
        available = {k: s.count for k, s in self.stock.items()}
        engines: dict[str, dict[EngineKind, int]] = {}
        short: list[str] = []
        for role in roles:
            chosen, left = pool(role, available)
            for kind, n in chosen.items():
                available[kind] -= n
            engines[role] = {k: n for k, n in chosen.items() if n > 0}
            if left > 0:
                short.append(f"{role} short by {left:.3g} req/s")
        return PoolTargets(rate, engines, self._cost(engines), not short, "; ".join(short),
                           "stock" if short else "rate")

    def _whole_stock(self, rate: float, roles: Sequence[str], limits: PoolLimits) -> PoolTargets:
        """The stock cannot carry `rate`: every usable engine, split between the pools so
        that the weaker one is strongest (`split_inventory`)."""
        counts = {k: s.count for k, s in self.stock.items()}
        if tuple(roles) == (UNIFIED,):
            pool, left = self.fill(UNIFIED, rate, counts, limits.ceiling(UNIFIED))
            engines, carried = {UNIFIED: pool}, rate - left
        else:
            split = split_inventory(counts, self.model, self.workload, self.slo, None,
                                    self.method)
            engines = {PREFILL: {}, DECODE: {}}
            for kind, n in counts.items():
                for i in range(n):
                    pool = engines[split.role_of(kind, i)]
                    pool[kind] = pool.get(kind, 0) + 1
            carried = split.goodput_rps
        return PoolTargets(rate, engines, self._cost(engines), False,
                           f"the stock carries about {carried:.3g} of {rate:.3g} req/s", "stock")

    def _cost(self, engines: Mapping[str, Mapping[EngineKind, int]]) -> float:
        return sum(self.stock[k].price_per_hour * n
                   for pool in engines.values() for k, n in pool.items())

    def _size_in_order(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                       present: Mapping[str, Mapping[EngineKind, int]]) -> PoolTargets:
        """Fill the roles one after the other from one stock."""

        def pool(role: str, available: Mapping[EngineKind, int]
                 ) -> tuple[dict[EngineKind, int], float]:
            chosen, left = self.fill(role, max(rate, 0.0), available, limits.ceiling(role))
            return self._with_floor(role, chosen, available, limits.floor(role),
                                    present.get(role, {})), left

        return self._pools(rate, roles, pool)

    def _with_floor(self, role: str, chosen: dict[EngineKind, int],
                    available: Mapping[EngineKind, int], floor: int,
                    running: Mapping[EngineKind, int]) -> dict[EngineKind, int]:
        """Add engines that can serve the role until the floor is met: kinds it already
        runs first, then the cheapest."""
        chosen = dict(chosen)
        candidates = sorted((k for k in available if self.rate_of(role, k, 1) > 0),
                            key=lambda k: (running.get(k, 0) == 0, self.stock[k].price_per_hour,
                                           k.name))
        for kind in candidates:
            while sum(chosen.values()) < floor and chosen.get(kind, 0) < available[kind]:
                chosen[kind] = chosen.get(kind, 0) + 1
        return chosen


def capacity_key(role: str, kind: EngineKind) -> str:
    """'decode:A800', 'unified:V100x2': how calibration factors are keyed."""
    return f"{role}:{kind.name}"


def _orders(roles: Sequence[str]) -> list[tuple[str, ...]]:
    roles = tuple(roles)
    return [roles] if len(roles) < 2 else [roles, roles[::-1]]

