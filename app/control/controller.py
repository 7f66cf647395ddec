"""The SARA controller's decision loop, Ray-free: observe -> predict -> size -> plan diff.

Every interval the controller closes its load window (what the routers reported),
forecasts the next interval's rate, sizes the pools for it (plus headroom, plus the
rate that drains the requests queued on the engines within one start-up time) from the
GPU stock under the budget (`InventorySizer`), and turns the targets into a plan diff
with hysteresis (`PoolPlanner`). Engines take `startup_s` to serve after they are
started; the targets are sized for the rate expected once they are up, i.e. the
forecast is extended over the start-up time by the trend. With agent sessions the rate
sized for is never below the steps already committed: what the open sessions will still
send over the next start-up (closed loop), plus a first step per session starting at the
observed rate (`SessionTracker`). The simulator and the controller actor both drive this
object; `now` is always an argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from app.control.observe import IntervalStats, LoadWindow, RatePredictor
from app.control.plan import (
    EngineRecord,
    EngineState,
    PlanDiff,
    PoolPlanner,
    ScalingRules,
    engines_by_pool,
)
from app.hardware.specs import InstanceSpec
from app.planning.allocator import LengthMoments
from app.planning.inventory import PREFILL, UNIFIED, InventorySizer, PoolLimits, PoolTargets, Stock
from app.planning.params import ModelParams, SloTargets
from app.planning.pools import Observation
from app.planning.served import ServedCapacity
from app.planning.split import DEFAULT_P_SLO, stage_slos


class CapacityModel(StrEnum):
    """What sizes the pools (`InventorySizer`)."""

    SARA = "sara"  # SARA's stage models at the mean request's stage targets
    SERVED = "served"  # the served-system models (app/planning/served.py)


@dataclass(frozen=True)
class StageSlo:
    """Where the stage targets come from: fixed values, or a deadline scale over the
    solo time on a reference instance (`stage_slos`)."""

    reference: InstanceSpec
    slo_scale: float = 2.0
    fixed: SloTargets | None = None
    p_slo: float = DEFAULT_P_SLO

    def targets(self, stats: IntervalStats) -> SloTargets:
        return self.targets_for(stats.observation(1.0).workload)

    def targets_for(self, workload: LengthMoments) -> SloTargets:
        if self.fixed is not None:
            return self.fixed
        return stage_slos(self.reference, workload, self.slo_scale, self.p_slo)


@dataclass(frozen=True)
class ControllerSettings:
    """Everything the decision loop needs, already validated."""

    model: str
    roles: tuple[str, ...]  # ("prefill", "decode") or ("unified",)
    stock: tuple[Stock, ...]
    slo: StageSlo
    limits: PoolLimits = PoolLimits()
    rules: ScalingRules = ScalingRules()
    interval_s: float = 30.0
    headroom: float = 0.1  # size for the forecast x (1 + headroom)
    startup_s: float = 60.0  # an engine serves this long after it is started
    trend_damping: float = 1.0  # per interval, on the trend extended over the start-up
    switch_margin: float = 0.1  # keep a pool's engines while within this of the cheapest
    capacity_factors: Mapping[str, float] = field(default_factory=dict)  # measured / modelled
    capacity_model: CapacityModel = CapacityModel.SARA

    @property
    def parks_context(self) -> bool:
        """Whether the sizing counts the context sessions park on the engines between
        steps: the served models do, on unified engines."""
        return self.capacity_model is CapacityModel.SERVED and self.roles == (UNIFIED,)

    def sizer(self, observation: Observation, per_engine_share: int = 1) -> InventorySizer:
        """The inventory sizer for observed traffic, on the configured capacity model;
        the context sessions park between steps is spread over `per_engine_share`
        engines. Only unified engines keep it: a disaggregated decoder receives each
        step's context with the step and frees it after (the prefill engines' prefix
        caches hold it, evictable)."""
        lengths = observation.workload
        served = None
        if self.capacity_model is CapacityModel.SERVED:
            parked = observation.held_kv_tokens if self.parks_context else None
            held = (parked or 0.0) / max(per_engine_share, 1)
            served = ServedCapacity.from_moments(
                self.model, lengths, self.slo.reference, self.slo.slo_scale, self.slo.p_slo,
                held_kv_tokens=held)
        return InventorySizer(ModelParams.named(self.model), lengths,
                              self.slo.targets_for(lengths), self.stock,
                              factors=self.capacity_factors, served=served)

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval must be > 0 s, got {self.interval_s}")
        if self.headroom < 0 or self.startup_s < 0 or self.switch_margin < 0:
            raise ValueError("headroom, start-up time and switch margin must be >= 0")
        if not 0 <= self.trend_damping <= 1:
            raise ValueError(f"trend damping must be in [0, 1], got {self.trend_damping}")

    @property
    def trend_intervals(self) -> float:
        """How many intervals of the current trend the look-ahead adds: the start-up's
        intervals h, each damped by phi (Gardner's damped trend, sum of phi^k for k = 1..h;
        h itself when phi is 1)."""
        h, phi = self.startup_s / self.interval_s, self.trend_damping
        return h if phi == 1 else phi * (1 - phi**h) / (1 - phi)


@dataclass(frozen=True)
class ControlStep:
    """One interval's decision, with what it was based on (for logs and metrics)."""

    stats: IntervalStats
    forecast_rps: float
    targets: PoolTargets
    diff: PlanDiff

    def summary(self) -> dict[str, Any]:
        """JSON-ready: when, what was seen and forecast, the targets and the changes."""
        diff = self.diff
        return {
            "time_s": self.stats.end_s,
            "rate_rps": round(self.stats.rate_rps, 3),
            "forecast_rps": round(self.forecast_rps, 3),
            "targets": {role: {k.name: n for k, n in kinds.items()}
                        for role, kinds in self.targets.engines.items()},
            "start": [f"{role}:{kind.name}" for role, kind in diff.start],
            "drain": list(diff.drain), "reactivate": list(diff.reactivate),
            "stop": list(diff.stop), "migrate": list(diff.migrate),
        }

    def figures(self, engines: Sequence[EngineRecord], stock: Sequence[Stock],
                budget_per_hour: float | None) -> dict[str, Any]:
        """The step as `ControllerMetrics.step` exports it: targets and engines held
        per pool and GPU type, what each costs, the rates, the binding constraint and
        the plan's changes. `engines` are those held when the step decided."""
        prices = {s.kind: s.price_per_hour for s in stock}
        targets: dict[tuple[str, str], int] = {}
        for role, kinds in self.targets.engines.items():
            for kind, n in kinds.items():
                targets[role, kind.gpu] = targets.get((role, kind.gpu), 0) + n
        held: dict[tuple[str, str, str], int] = {}
        for e in engines:
            targets.setdefault((e.role, e.kind.gpu), 0)  # a pool wanted empty reads 0
            key = (e.role, e.kind.gpu, e.state.value)
            held[key] = held.get(key, 0) + 1
        for role, gpu in targets:  # states with no engine read 0, not their last value
            for state in EngineState:
                held.setdefault((role, gpu, state.value), 0)
        diff = self.diff
        return {
            "targets": targets, "engines": held,
            "target_cost": self.targets.cost_per_hour,
            "cost": sum(prices.get(e.kind, 0.0) for e in engines),
            "budget": budget_per_hour, "binding": self.targets.binding,
            "rates": {"observed": self.stats.rate_rps, "forecast": self.forecast_rps,
                      "sized": self.targets.rate_rps},
            "changes": {"start": len(diff.start), "drain": len(diff.drain),
                        "reactivate": len(diff.reactivate), "stop": len(diff.stop),
                        "migrate": len(diff.migrate)},
        }


@dataclass
class Controller:
    settings: ControllerSettings
    start_s: float
    window: LoadWindow = field(init=False)
    predictor: RatePredictor = field(default_factory=RatePredictor)
    planner: PoolPlanner = field(init=False)

    def __post_init__(self) -> None:
        self.window = LoadWindow(self.start_s, commit_horizon_s=self.horizon_s)
        self.planner = PoolPlanner(self.settings.rules)
        self._model = ModelParams.named(self.settings.model)
        self._previous_forecast: float | None = None

    @property
    def interval_s(self) -> float:
        return self.settings.interval_s

    @property
    def horizon_s(self) -> float:
        """How far ahead a decision must hold: until engines started now serve."""
        return max(self.settings.startup_s, self.settings.interval_s)

    def step(self, now: float, engines: Sequence[EngineRecord]) -> ControlStep:
        """Close the window at `now` and decide what changes."""
        stats = self.window.close(now)
        forecast = self.predictor.update(stats.rate_rps)
        # extend by the trend over the start-up time: engines started now serve then
        trend = 0.0 if self._previous_forecast is None else forecast - self._previous_forecast
        self._previous_forecast = forecast
        # never below what was just observed: a falling trend must not undershoot it
        ahead = max(forecast + trend * self.settings.trend_intervals,
                    forecast, stats.rate_rps, committed_rps(stats))
        sized = ahead * (1 + self.settings.headroom)
        holders = sum(e.state is EngineState.ACTIVE and e.role != PREFILL for e in engines)
        sizer = self.settings.sizer(stats.observation(sized), holders)
        rate = sized + self._backlog_rate(sizer, sized, engines)
        targets = sizer.size(rate, self.settings.roles, self.settings.limits,
                             engines_by_pool(engines), self.settings.switch_margin)
        return ControlStep(stats, forecast, targets, self.planner.diff(now, targets, engines))

    def _backlog_rate(self, sizer: InventorySizer, rate: float,
                      engines: Sequence[EngineRecord]) -> float:
        """The extra rate that clears the requests queued on the engines within one
        start-up: only the part the serving engines' spare capacity over `rate` does
        not clear before new engines could serve (engines bought for a queue that is
        gone by the time they boot are pure cost, e.g. once arrivals stop)."""
        active = [e for e in engines if e.state is EngineState.ACTIVE]
        backlog = sum(e.waiting for e in active)
        if backlog == 0:
            return 0.0
        horizon = max(self.settings.startup_s, self.settings.interval_s)
        serving = engines_by_pool(active)
        carried = min(sizer.carried(role, serving.get(role, {})) for role in self.settings.roles)
        return max(backlog - max(carried - rate, 0.0) * horizon, 0.0) / horizon



def committed_rps(stats: IntervalStats) -> float:
    """Steps/s already committed by agent sessions: the open sessions' remaining steps
    over the horizon, plus one first step per session starting at the observed rate (0
    without sessions, or before the estimate has a finished session to go by)."""
    if stats.committed_rps is None:
        return 0.0
    return stats.committed_rps + stats.session_start_rps
