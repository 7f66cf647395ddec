"""From pool targets to a plan diff: which engines to start, drain, stop or migrate.

Scaling up is immediate unless `scale_up_after_s` asks a pool to want more for that
long first; engines still starting count as present, so a target is never bought
twice while engines boot. Scaling down waits: a pool must stay above its
target for `scale_down_after_s`, and not within `cooldown_s` of its last scale-up
(hysteresis against flapping). A pool that needs engines back reactivates its own
draining ones before starting new ones. Removal drains: an engine picked to leave
(starting ones first, then the fewest running requests) stops taking requests, is
stopped once empty, and after `drain_deadline_s` its remaining requests are migrated
by token ids. Make before break: a role keeps at least min(its target, its serving
engines) serving, so when the targets switch kinds the old engines drain only as their
replacements start serving (a role left without a serving engine would turn requests
away, and with them the agent sessions they belong to). Plain Python, `now` is an
argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from app.planning.inventory import PoolTargets
from app.planning.split import EngineKind

Pool = tuple[str, EngineKind]  # (role, kind)


class EngineState(StrEnum):
    STARTING = "starting"  # created, not serving yet
    ACTIVE = "active"  # takes new requests
    DRAINING = "draining"  # takes no new requests; stopped when empty


@dataclass(frozen=True)
class EngineRecord:
    """One engine as the controller's registry sees it."""

    engine_id: str
    role: str
    kind: EngineKind
    state: EngineState
    since_s: float  # when it entered `state`
    running: int = 0  # requests it holds, queued ones and KV on its way included
    waiting: int = 0  # of those, requests not scheduled yet
    kv_usage: float = 0.0  # share of its KV blocks in use

    @property
    def pool(self) -> Pool:
        return self.role, self.kind


def engines_by_pool(engines: Sequence[EngineRecord]) -> dict[str, dict[EngineKind, int]]:
    """role -> kind -> engines not draining (serving or starting)."""
    present: dict[str, dict[EngineKind, int]] = {}
    for e in engines:
        if e.state is not EngineState.DRAINING:
            pool = present.setdefault(e.role, {})
            pool[e.kind] = pool.get(e.kind, 0) + 1
    return present


@dataclass(frozen=True)
class ScalingRules:
    """Hysteresis, cool-down and draining knobs (seconds)."""

    scale_down_after_s: float = 60.0
    cooldown_s: float = 120.0
    drain_deadline_s: float = 30.0
    scale_up_after_s: float = 0.0  # a pool must want more this long (Ray Serve's upscale delay)

    def __post_init__(self) -> None:
        for name in ("scale_down_after_s", "cooldown_s", "drain_deadline_s", "scale_up_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class PlanDiff:
    """What to do now; empty when nothing changes."""

    start: tuple[Pool, ...] = ()  # new engines, one entry each
    reactivate: tuple[str, ...] = ()  # draining engines taken back
    drain: tuple[str, ...] = ()  # active engines to stop sending to
    stop: tuple[str, ...] = ()  # engines to kill now (empty, or never started serving)
    migrate: tuple[str, ...] = ()  # draining engines past the deadline: move their requests

    @property
    def changes_membership(self) -> bool:
        """True when the set of engines that take requests changes."""
        return bool(self.start or self.reactivate or self.drain or self.stop)

    @property
    def is_empty(self) -> bool:
        return not (self.changes_membership or self.migrate)


@dataclass
class PoolPlanner:
    """Per-pool hysteresis state between intervals."""

    rules: ScalingRules = field(default_factory=ScalingRules)
    _above_since: dict[Pool, float] = field(default_factory=dict)
    _below_since: dict[Pool, float] = field(default_factory=dict)
    _last_up: dict[Pool, float] = field(default_factory=dict)

    def diff(self, now: float, targets: PoolTargets,
             engines: Sequence[EngineRecord]) -> PlanDiff:
        pools = {e.pool for e in engines} | {
            (role, kind) for role, kinds in targets.engines.items() for kind in kinds}
        start: list[Pool] = []
        reactivate: list[str] = []
        drain: list[str] = []
        stop: list[str] = []
        drainable = {role: _drainable(role, targets, engines) for role, _ in pools}
        for pool in sorted(pools, key=lambda p: (p[0], p[1].name)):
            members = [e for e in engines if e.pool == pool]
            present = [e for e in members if e.state is not EngineState.DRAINING]
            want = targets.count(*pool)
            if want > len(present):
                self._above_since.pop(pool, None)
                since = self._below_since.setdefault(pool, now)
                if now - since < self.rules.scale_up_after_s:
                    continue
                self._below_since.pop(pool, None)
                self._last_up[pool] = now
                back = sorted((e for e in members if e.state is EngineState.DRAINING),
                              key=lambda e: e.running, reverse=True)[:want - len(present)]
                reactivate += [e.engine_id for e in back]
                start += [pool] * (want - len(present) - len(back))
            elif want < len(present):
                self._below_since.pop(pool, None)
                since = self._above_since.setdefault(pool, now)
                if (now - since >= self.rules.scale_down_after_s
                        and now - self._last_up.get(pool, -float("inf")) >= self.rules.cooldown_s):
                    leaving = sorted(present, key=_leave_order)[:len(present) - want]
                    stop += [e.engine_id for e in leaving if e.state is EngineState.STARTING]
                    serving = [e.engine_id for e in leaving if e.state is EngineState.ACTIVE]
                    allowed = serving[:drainable[pool[0]]]
                    drainable[pool[0]] -= len(allowed)
                    drain += allowed
                    if len(allowed) == len(serving):  # else the rest leave once they may
                        self._above_since.pop(pool, None)
            else:
                self._above_since.pop(pool, None)
                self._below_since.pop(pool, None)
        draining = [e for e in engines if e.state is EngineState.DRAINING
                    and e.engine_id not in reactivate]
        stop += [e.engine_id for e in draining if e.running == 0]
        migrate = [e.engine_id for e in draining if e.running > 0
                   and now - e.since_s >= self.rules.drain_deadline_s]
        return PlanDiff(tuple(start), tuple(reactivate), tuple(drain), tuple(stop),
                        tuple(migrate))


def _drainable(role: str, targets: PoolTargets, engines: Sequence[EngineRecord]) -> int:
    """Serving engines of `role` that may start draining now: those beyond
    min(the role's target, its serving engines)."""
    serving = sum(e.role == role and e.state is EngineState.ACTIVE for e in engines)
    return serving - min(targets.total(role), serving)


def _leave_order(engine: EngineRecord) -> tuple[int, int, float]:
    """Starting engines leave first, then the emptiest, then the newest."""
    return (engine.state is not EngineState.STARTING, engine.running, -engine.since_s)
