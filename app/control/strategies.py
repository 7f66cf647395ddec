"""Scaling strategies the SARA controller is compared with, behind the same interface.

Each turns the interval's observations and the engine registry into a `ControlStep`;
all share the `PoolPlanner` (draining, reactivation), so they differ in how many
engines they want and in the delays their own systems use:
- `StaticScaler`: fixed pools (provisioned for the peak or for the mean).
- `QueueLengthScaler`: Ray Serve's default rule, ceil(ongoing requests / 2) replicas
  per pool, 30 s upscale and 600 s downscale delay.
- `ThroughputScaler`: NVIDIA Dynamo's planner in throughput mode, ceil(predicted
  demand / one engine's throughput within the SLO) per pool, every 180 s.
- `SaturationScaler`: llm-d's variant autoscaler, +1 engine when a pool is saturated
  (KV >= 0.8 or queue >= 5 on every engine, or too little spare), -1 when a simulated
  redistribution of its load onto one engine fewer keeps the spare margins.
The counting strategies keep the engines a pool has and add from the kind with the
lowest price per unit of the role's hardware throughput (the next kind once its stock
is used); shrinking, the least preferred kinds leave first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.control.controller import ControlStep
from app.control.observe import IntervalStats, LoadWindow, RatePredictor
from app.control.plan import (
    EngineRecord,
    EngineState,
    PoolPlanner,
    ScalingRules,
    engines_by_pool,
)
from app.hardware.specs import InstanceSpec, make_instance
from app.planning.inventory import DECODE, PREFILL, UNIFIED, PoolLimits, PoolTargets, Stock
from app.planning.split import EngineKind

DECODE_CONTEXT_TOKENS = 1024  # context at which decode throughput ranks engine kinds


@dataclass
class ScalerBase:
    """Window, planner and interval shared by every strategy."""

    interval_s: float = 30.0
    rules: ScalingRules = field(default_factory=ScalingRules)
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval must be > 0 s, got {self.interval_s}")
        self.window = LoadWindow(self.start_s)
        self.planner = PoolPlanner(self.rules)

    def step(self, now: float, engines: Sequence[EngineRecord]) -> ControlStep:
        stats = self.window.close(now)
        forecast, targets = self.targets(stats, engines)
        return ControlStep(stats, forecast, targets, self.planner.diff(now, targets, engines))

    def targets(self, stats: IntervalStats,
                engines: Sequence[EngineRecord]) -> tuple[float, PoolTargets]:
        raise NotImplementedError


@dataclass
class StaticScaler(ScalerBase):
    """Fixed pools: the targets never change."""

    fixed: PoolTargets = field(kw_only=True)

    def targets(self, stats: IntervalStats,
                engines: Sequence[EngineRecord]) -> tuple[float, PoolTargets]:
        return stats.rate_rps, self.fixed


@dataclass
class CountingScaler(ScalerBase):
    """Strategies that decide an engine count per pool, filled by preferred kind."""

    model: str = field(kw_only=True)
    roles: tuple[str, ...] = field(kw_only=True)
    stock: tuple[Stock, ...] = field(kw_only=True)
    limits: PoolLimits = field(default_factory=PoolLimits, kw_only=True)

    def spec(self, kind: EngineKind) -> InstanceSpec:
        return make_instance(kind.gpu, self.model, kind.tp)

    def preferred_kinds(self, role: str) -> list[Stock]:
        """Stock by price per unit of the role's hardware throughput (cheapest first)."""
        def price_per_throughput(stock: Stock) -> float:
            spec = self.spec(stock.kind)
            batch = stock.kind.max_num_seqs or 256
            prefill = spec.unloaded_prefill_s_per_token
            decode = spec.decode_time_per_token_s(DECODE_CONTEXT_TOKENS, batch) / batch
            seconds = {PREFILL: prefill, DECODE: decode, UNIFIED: prefill + decode}[role]
            return stock.price_per_hour * seconds
        return sorted((s for s in self.stock if s.count > 0),
                      key=lambda s: (price_per_throughput(s), s.kind.name))

    def fill(self, counts: dict[str, int], engines: Sequence[EngineRecord]) -> PoolTargets:
        """Engines per role (clamped to the limits): the pool keeps the engines it has
        (least preferred kinds leave first) and grows from the preferred kind's stock."""
        present = engines_by_pool(engines)
        left = {s.kind: s.count for s in self.stock}
        for role in self.roles:
            for kind, n in present.get(role, {}).items():
                left[kind] = left.get(kind, 0) - n
        targets: dict[str, dict[EngineKind, int]] = {}
        short = []
        for role in self.roles:
            want = min(max(counts[role], self.limits.floor(role)), self.limits.ceiling(role))
            order = [s.kind for s in self.preferred_kinds(role)]
            have = present.get(role, {})
            kept = sorted(have, key=lambda k: order.index(k) if k in order else len(order))
            pool: dict[EngineKind, int] = {}
            for kind in kept:
                take = min(have[kind], want - sum(pool.values()))
                if take > 0:
                    pool[kind] = take
            for kind in order:
                take = min(want - sum(pool.values()), max(left.get(kind, 0), 0))
                if take > 0:
                    pool[kind] = pool.get(kind, 0) + take
                    left[kind] -= take
            if sum(pool.values()) < want:
                short.append(f"{role}: stock holds {sum(pool.values())} of {want}")
            targets[role] = pool
        prices = {s.kind: s.price_per_hour for s in self.stock}
        cost = sum(prices.get(k, 0.0) * n for pool in targets.values() for k, n in pool.items())
        return PoolTargets(0.0, targets, cost, not short, "; ".join(short),
                           "stock" if short else "rate")

    @staticmethod
    def serving(engines: Sequence[EngineRecord], role: str) -> list[EngineRecord]:
        return [e for e in engines if e.role == role and e.state is EngineState.ACTIVE]


@dataclass
class QueueLengthScaler(CountingScaler):
    """Ray Serve's default autoscaling: target ongoing requests per replica."""

    target_ongoing_requests: float = field(default=2.0, kw_only=True)

    def targets(self, stats: IntervalStats,
                engines: Sequence[EngineRecord]) -> tuple[float, PoolTargets]:
        counts = {role: math.ceil(sum(e.running for e in self.serving(engines, role))
                                  / self.target_ongoing_requests) for role in self.roles}
        return stats.rate_rps, self.fill(counts, engines)


@dataclass
class ThroughputScaler(CountingScaler):
    """Dynamo's planner, throughput mode: demand / per-engine throughput within the SLO.

    Per engine: prefill tokens/s at full speed; decode tokens/s at the largest batch
    (up to max_num_seqs) whose step stays within `tpot_s` at the mean context."""

    tpot_s: float = field(kw_only=True)
    predictor: RatePredictor = field(default_factory=RatePredictor, kw_only=True)

    def per_engine(self, role: str, stats: IntervalStats) -> tuple[float, float]:
        """(prefill, decode) tokens/s of one engine of the role's preferred kind."""
        kind = self.preferred_kinds(role)[0].kind
        spec = self.spec(kind)
        prefill = 1.0 / spec.prefill_time_per_token_s(max(1, round(stats.mean_input_len)))
        context = round(stats.mean_input_len + stats.mean_output_len / 2)
        decode = 0.0
        for batch in range(1, (kind.max_num_seqs or 256) + 1):
            step_s = spec.decode_time_per_token_s(context, batch)
            if step_s > self.tpot_s:
                break
            decode = batch / step_s
        return prefill, max(decode, 1.0 / spec.decode_time_per_token_s(context, 1))

    def targets(self, stats: IntervalStats,
                engines: Sequence[EngineRecord]) -> tuple[float, PoolTargets]:
        forecast = self.predictor.update(stats.rate_rps)
        prefill_demand = forecast * stats.mean_input_len
        decode_demand = forecast * stats.mean_output_len
        counts = {}
        for role in self.roles:
            prefill, decode = self.per_engine(role, stats)
            busy = {PREFILL: prefill_demand / prefill, DECODE: decode_demand / decode,
                    UNIFIED: prefill_demand / prefill + decode_demand / decode}[role]
            counts[role] = math.ceil(busy)
        return forecast, self.fill(counts, engines)


@dataclass
class SaturationScaler(CountingScaler):
    """llm-d's variant autoscaler: one engine more or fewer per pool and interval."""

    kv_saturated: float = field(default=0.8, kw_only=True)
    queue_saturated: float = field(default=5.0, kw_only=True)
    kv_spare_min: float = field(default=0.1, kw_only=True)
    queue_spare_min: float = field(default=3.0, kw_only=True)

    def wanted(self, members: Sequence[EngineRecord]) -> int:
        n = len(members)
        if n == 0:
            return 1
        open_ = [e for e in members if e.kv_usage < self.kv_saturated
                 and e.waiting < self.queue_saturated]
        if not open_:
            return n + 1
        kv_spare = sum(self.kv_saturated - e.kv_usage for e in open_) / len(open_)
        queue_spare = sum(self.queue_saturated - e.waiting for e in open_) / len(open_)
        if kv_spare < self.kv_spare_min or queue_spare < self.queue_spare_min:
            return n + 1
        if n > 1:  # would n - 1 engines keep the margins with this pool's load?
            kv = sum(e.kv_usage for e in members) / (n - 1)
            queue = sum(e.waiting for e in members) / (n - 1)
            if (self.kv_saturated - kv >= self.kv_spare_min
                    and self.queue_saturated - queue >= self.queue_spare_min):
                return n - 1
        return n

    def targets(self, stats: IntervalStats,
                engines: Sequence[EngineRecord]) -> tuple[float, PoolTargets]:
        present = [e for e in engines if e.state is not EngineState.DRAINING]
        counts = {}
        for role in self.roles:
            members = [e for e in present if e.role == role]
            booting = any(e.state is EngineState.STARTING for e in members)
            counts[role] = len(members) if booting else self.wanted(self.serving(engines, role))
        return stats.rate_rps, self.fill(counts, engines)
