"""Pool sizes from a GPU inventory with counts and prices: the controller's allocator.

SARA sizes a homogeneous pool exactly: k_p from the M/G/k prefill model, a decode
engine's rate from C1-C4 (`split.engine_capacity`). An inventory offers several
engine kinds in limited numbers, so a pool is a union of homogeneous sub-pools:
- Prefill engines of one kind share one queue (M/G/n; least-TTFT routing approximates
  it), so n engines carry more than n times one (`PrefillStage.min_instances`).
- Decode engines each run their own batch: n engines carry n times one engine's rate.
- Unified engines time-share the two stages: n engines carry
  1 / (1 / r_prefill(n) + 1 / r_decode(n)), the rate at which the two stages' busy
  fractions add up to one (an approximation: chunked prefill overlaps some of it).
The cheapest mix is solved exactly, all roles at once, as one MILP (`scipy.optimize.milp`):
a binary per role, kind and engine count n picks how many engines of each kind a pool
runs, so the rate n engines carry is the model's for n, not a linear extrapolation;
the roles share each kind's stock, and the pool floors and ceilings are constraints.
Above the budget the pools are sized for the highest rate the budget buys (problem P1,
the same MILP maximising the rate under a cost cap) and the targets say the SLOs are
not met; beyond the stock every engine serves, split by `split_inventory`. The KV
link is the cluster's, not sized here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from app.planning.allocator import LengthMoments
from app.planning.params import ModelParams, SloTargets
from app.planning.prefill import PrefillStage
from app.planning.queues import Method
from app.planning.search import first_true, max_feasible_rate
from app.planning.served import ServedCapacity
from app.planning.split import (
    EngineCapacity,
    EngineKind,
    engine_capacity,
    prefill_stage,
    split_inventory,
)

PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
ENGINE_TIEBREAK_PER_HOUR = 1e-4  # USD/h added per engine: of two mixes as cheap, the fewer
IDLE_RUNNING_PRICE_SHARE = 1e-3  # at rate 0, a kind a role runs counts at this share of its price
BUDGET_RTOL = 1e-9  # a mix costing the budget to within float rounding is within it
EngineBounds = Mapping[tuple[str, EngineKind], tuple[int, int]]  # (role, kind) -> fewest, most


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


@dataclass(frozen=True)
class _Column:
    """A variable of the engine-mix MILP: each unit of it is `engines` engines of `kind`
    in `role`, carrying `rate_rps`. Either one of the (role, kind)'s binaries, exactly one
    of which is 1 (`pick`: any rate table), or the engine count itself (a linear table)."""

    role: str
    kind: EngineKind
    engines: int
    rate_rps: float
    low: int = 0
    high: int = 1
    pick: bool = True


class _MixMilp:
    """The engine-mix MILP's variables (its columns, then with `extra` the rate to
    maximise) and constraints, one binary picked per (role, kind) where they pick."""

    def __init__(self, columns: Sequence[_Column], extra: bool = False) -> None:
        self.columns, self.extra = list(columns), extra
        self.matrix: list[list[float]] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        groups: dict[tuple[str, EngineKind], set[int]] = {}  # (role, kind) -> its binaries
        for j, column in enumerate(self.columns):
            if column.pick:
                groups.setdefault((column.role, column.kind), set()).add(j)
        for members in groups.values():
            self._row([float(j in members) for j in range(len(self.columns))], 1, 1)

    def add(self, coefficient: Callable[[_Column], float], low: float, high: float,
            extra: float = 0.0) -> None:
        """low <= sum of coefficient(column) x its variable (+ extra x the rate) <= high."""
        self._row([coefficient(c) for c in self.columns], low, high, extra)

    def _row(self, values: list[float], low: float, high: float, extra: float = 0.0) -> None:
        self.matrix.append(values + [extra] if self.extra else values)
        self.lower.append(low)
        self.upper.append(high)

    def solve(self, weights: Sequence[float]) -> dict[tuple[str, EngineKind], int] | None:
        """Engines per (role, kind) minimising `weights` x the variables (the rate, if
        any, between 0 and 1); None if infeasible."""
        bounds = Bounds([c.low for c in self.columns] + [0.0] * self.extra,
                        [c.high for c in self.columns] + [1.0] * self.extra)
        result = milp(weights, integrality=[1] * len(self.columns) + [0] * self.extra,
                      bounds=bounds, options={"mip_rel_gap": 0.0},
                      constraints=LinearConstraint(np.array(self.matrix), self.lower,
                                                   self.upper))
        if result.status == 2:  # infeasible
            return None
        if not result.success:
            raise RuntimeError(f"engine mix MILP: {result.message}")
        engines: dict[tuple[str, EngineKind], int] = {}
        for column, value in zip(self.columns, result.x, strict=False):
            key = (column.role, column.kind)
            engines[key] = engines.get(key, 0) + column.engines * round(value)
        return engines


class InventorySizer:
    """Sizes pools from a stock for one workload and SLO; caches per-kind capacities."""

    def __init__(self, model: ModelParams, workload: LengthMoments, slo: SloTargets,
                 stock: Sequence[Stock], method: Method = Method.REFINED,
                 factors: Mapping[str, float] | None = None,
                 served: ServedCapacity | None = None) -> None:
        """`factors`: measured / modelled rate per pool and kind (`capacity_key`), from
        a calibration against the engines; 1 where absent. `served`: the served-system
        models (`app/planning/served.py`) instead of SARA's stage models."""
        self.served = served
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
        if self.served is not None:
            return self.served.rate(role, kind, engines) * self.factor(role, kind)
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
        if role == PREFILL and self.served is None:
            sizing = self._prefill_stage(kind).min_instances(
                rate / self.factor(PREFILL, kind), self.slo.ttft_s, self.slo.p_slo, self.method)
            return math.inf if sizing is None else sizing.num_instances
        if self.rate_of(role, kind, 1) == 0:
            return math.inf
        if role != PREFILL and (role == DECODE or self.served is not None):
            return math.ceil(rate / self.rate_of(role, kind, 1))
        return first_true(lambda n: self.rate_of(role, kind, n) >= rate, 0)

    def fill(self, role: str, rate: float, available: Mapping[EngineKind, int],
             ceiling: float = math.inf) -> tuple[dict[EngineKind, int], float]:
        """The cheapest engines per kind from `available` that carry `rate` in `role`
        (or, if none do, those carrying the most), and the rate left over."""
        limits = PoolLimits({role: 0}, {role: ceiling})
        counts = {k: n for k, n in available.items() if n > 0}
        chosen = (self._solve(rate, (role,), limits, counts=counts)
                  or self._solve(rate, (role,), limits, counts=counts, max_rate=True))
        pool = chosen[role] if chosen else {}
        return pool, max(rate - self.carried(role, pool), 0.0)

    def size(self, rate: float, roles: Sequence[str], limits: PoolLimits,
             present: Mapping[str, Mapping[EngineKind, int]] | None = None,
             switch_margin: float = 0.0) -> PoolTargets:
        """Targets for `rate` within the budget; over it, for the highest rate it buys.
        The pools keep the engines they run (`present`; grown by the cheapest addition,
        or trimmed to the cheapest subset that carries the rate) while that costs at
        most `switch_margin` more than the cheapest mix: each switch of kind pays a
        start-up and a drain. At rate 0 the floors go to kinds a role runs first, so an
        idle interval does not swap engines. The cost never exceeds the budget unless
        the pool floors alone do."""
        present = present or {}
        budget = limits.budget_per_hour
        sized = self._size_unclamped(rate, roles, limits, present, switch_margin, budget)
        if sized is not None:
            return sized
        if budget is None or self._solve(rate, roles, limits) is None:
            whole = self._whole_stock(rate, roles, limits)
            if budget is None or _within(whole.cost_per_hour, budget):
                return whole
        return self._bought(rate, roles, limits, present, switch_margin, budget)

    def _size_unclamped(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                        present: Mapping[str, Mapping[EngineKind, int]],
                        switch_margin: float, budget: float | None) -> PoolTargets | None:
        """The cheapest pools for `rate` within `budget`, or the running engines kept
        within the margin of them; None if the stock or the budget cannot carry `rate`."""
        cheapest = self._solve(rate, roles, limits, running=present, budget=budget)
        if cheapest is None:
            return None
        if switch_margin > 0 and any(present.values()):
            kept = self._solve(rate, roles, limits, running=present, budget=budget,
                               bounds=self._kept_bounds(rate, roles, limits, present))
            if kept is not None and (self._cost(kept)
                                     <= self._cost(cheapest) * (1 + switch_margin)):
                return self._targets(rate, kept)
        return self._targets(rate, cheapest)

    def _bought(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                present: Mapping[str, Mapping[EngineKind, int]], switch_margin: float,
                budget: float) -> PoolTargets:
        """Pools for the highest rate `budget` buys (problem P1, solved as one MILP), or
        the pool floors when it does not buy them."""
        floors = self._solve(0.0, roles, limits, running=present, budget=budget)
        if floors is None:
            floors = self._solve(0.0, roles, limits, running=present) or {}
            cost = self._cost(floors)
            return PoolTargets(0.0, floors, cost, False,
                               f"budget {budget:g}/h is below the pool floors ({cost:g}/h)",
                               "budget")
        most = self._solve(rate, roles, limits, budget=budget, max_rate=True) or floors
        affordable = min([rate] + [self.carried(role, most[role]) for role in roles])
        best = (self._size_unclamped(affordable, roles, limits, present, switch_margin, budget)
                or self._targets(affordable, most))
        return PoolTargets(affordable, best.engines, best.cost_per_hour, False,
                           f"budget {budget:g}/h buys {affordable:.3g} of {rate:.3g} req/s",
                           "budget")

    def _kept_bounds(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                     present: Mapping[str, Mapping[EngineKind, int]]) -> EngineBounds:
        """Engines per role and kind (fewest, most) that keep what runs: a pool whose
        engines carry `rate` and meet its floor keeps some of them, any other all of
        them and maybe more. The running engines share the stock in role order."""
        counts = {k: s.count for k, s in self.stock.items()}
        left = dict(counts)
        bounds: dict[tuple[str, EngineKind], tuple[int, int]] = {}
        for role in roles:
            kept = {k: min(n, left[k]) for k, n in present.get(role, {}).items()
                    if k in left and n > 0}
            for kind, n in kept.items():
                left[kind] -= n
            spare = (self.carried(role, kept) >= rate
                     and sum(kept.values()) >= self._floor(role, limits, counts))
            for kind, stock in self.stock.items():
                n = kept.get(kind, 0)
                bounds[role, kind] = (0, n) if spare else (n, stock.count)
        return bounds

    def _solve(self, rate: float, roles: Sequence[str], limits: PoolLimits, *,
               counts: Mapping[EngineKind, int] | None = None, bounds: EngineBounds | None = None,
               running: Mapping[str, Mapping[EngineKind, int]] | None = None,
               budget: float | None = None, max_rate: bool = False
               ) -> dict[str, dict[EngineKind, int]] | None:
        """Engines per role and kind: the cheapest carrying `rate` in every role, or with
        `max_rate` the most rate up to `rate` for at most `budget`; None if none do.

        One MILP over all roles: a binary per (role, kind, n) picks n engines of the kind
        (one per role and kind), so n engines carry exactly `rate_of(role, kind, n)`,
        prefill pooling included (a linear table, decode's, is one integer instead);
        the roles share each kind's stock, and floors and ceilings bound each pool."""
        counts = {k: s.count for k, s in self.stock.items()} if counts is None else counts
        if not max_rate and DECODE in roles and rate > sum(  # short of decode: no tables
                self.rate_of(DECODE, k, int(min(n, limits.ceiling(DECODE))))
                for k, n in counts.items()):
            return None
        columns = self._columns(rate, roles, limits, counts, bounds or {})
        if not columns:
            return {role: {} for role in roles} if rate <= 0 or max_rate else None
        problem = _MixMilp(columns, extra=max_rate)
        for role in roles:  # with `max_rate`, the rate is a share of `rate` (solved faster)
            problem.add(lambda c, r=role: c.rate_rps * (c.role == r),
                        0.0 if max_rate else rate, math.inf, extra=-rate if max_rate else 0.0)
            problem.add(lambda c, r=role: c.engines * (c.role == r),
                        self._floor(role, limits, counts), limits.ceiling(role))
        for kind, count in counts.items():
            problem.add(lambda c, k=kind: c.engines * (c.kind == k), -math.inf, count)
        if budget is not None:
            problem.add(lambda c: c.engines * self.stock[c.kind].price_per_hour, -math.inf,
                        budget * (1 + BUDGET_RTOL))
        if max_rate:
            weights = [0.0] * len(columns) + [-1.0]
        else:
            weights = [self._weight(c, running or {}, rate <= 0) for c in columns]
        picked = problem.solve(weights)
        if picked is None:
            return None
        chosen = {role: {k: n for (r, k), n in picked.items() if r == role and n > 0}
                  for role in roles}
        if budget is not None and not _within(self._cost(chosen), budget):
            return None  # the solver's tolerance let a dearer mix through
        return chosen

    def _columns(self, rate: float, roles: Sequence[str], limits: PoolLimits,
                 counts: Mapping[EngineKind, int], bounds: EngineBounds) -> list[_Column]:
        """The MILP's variables: for each role and kind, the engine counts worth trying,
        up to the fewest that carry `rate` alone or meet the floor (more only cost
        more), within the stock, the ceiling and `bounds`."""
        columns = []
        for role in roles:
            floor, ceiling = self._floor(role, limits, counts), limits.ceiling(role)
            for kind in sorted(counts, key=lambda k: k.name):
                fewest, most = bounds.get((role, kind), (0, counts[kind]))
                if self.rate_of(role, kind, 1) > 0:
                    cap = int(min(counts[kind], most, ceiling))
                    most = max(fewest, min(cap, max(self._need(role, kind, rate, cap), floor)))
                else:
                    most = fewest  # a kind that cannot serve the role keeps what it runs
                if most > 0:
                    columns += self._kind_columns(role, kind, fewest, most)
        return columns

    def _kind_columns(self, role: str, kind: EngineKind, fewest: int,
                      most: int) -> list[_Column]:
        """One integer column when n engines carry n times one's rate (decode), else a
        binary per engine count."""
        table = [self.rate_of(role, kind, n) for n in range(most + 1)]
        if all(math.isclose(table[n], n * table[1], rel_tol=1e-12) for n in range(most + 1)):
            return [_Column(role, kind, 1, table[1], fewest, most, pick=False)]
        return [_Column(role, kind, n, table[n]) for n in range(fewest, most + 1)]

    def _need(self, role: str, kind: EngineKind, rate: float, cap: int) -> int:
        """Fewest engines of `kind` carrying `rate` in `role`, or `cap` if fewer."""
        n = 0
        if role == DECODE and rate > 0:  # linear: start just below the quotient
            n = max(0, min(cap, math.floor(rate / self.rate_of(DECODE, kind, 1))) - 1)
        while n < cap and self.rate_of(role, kind, n) < rate:
            n += 1
        return n

    def _floor(self, role: str, limits: PoolLimits, counts: Mapping[EngineKind, int]) -> int:
        """The role's floor, within its ceiling and the engines that can serve it."""
        usable = sum(n for k, n in counts.items() if self.rate_of(role, k, 1) > 0)
        return int(min(limits.floor(role), limits.ceiling(role), usable))

    def _weight(self, column: _Column, running: Mapping[str, Mapping[EngineKind, int]],
                idle: bool) -> float:
        """A column's objective: its price; ties go to fewer engines, then to kinds the
        role runs. Idle (rate 0), the floors go to kinds the role runs first."""
        runs = running.get(column.role, {}).get(column.kind, 0) > 0
        price = self.stock[column.kind].price_per_hour
        if idle and runs:
            price *= IDLE_RUNNING_PRICE_SHARE
        return column.engines * (price + ENGINE_TIEBREAK_PER_HOUR * (1.0 if runs else 1.5))

    def _targets(self, rate: float, engines: dict[str, dict[EngineKind, int]]) -> PoolTargets:
        return PoolTargets(rate, engines, self._cost(engines), True)

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


def _within(cost: float, budget: float) -> bool:
    return cost <= budget * (1 + BUDGET_RTOL)


def capacity_key(role: str, kind: EngineKind) -> str:
    """'decode:A800', 'unified:V100x2': how calibration factors are keyed."""
    return f"{role}:{kind.name}"
