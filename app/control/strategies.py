"""Scaling strategies the SARA controller is compared with, behind the same interface.

Each one turns the interval's observations and the engine registry into a
`ControlStep`; all share the `PoolPlanner` (same hysteresis and draining), so they
differ only in how many engines of which kind they want.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from app.control.controller import ControlStep
from app.control.observe import LoadWindow
from app.control.plan import EngineRecord, PoolPlanner, ScalingRules
from app.planning.inventory import PoolTargets


@dataclass
class StaticScaler:
    """Fixed pools (provisioned for the peak or for the mean): the engines it starts
    with are the targets, nothing ever changes after the first interval."""

    targets: PoolTargets
    interval_s: float = 30.0
    rules: ScalingRules = field(default_factory=ScalingRules)
    start_s: float = 0.0

    def __post_init__(self) -> None:
        self.window = LoadWindow(self.start_s)
        self.planner = PoolPlanner(self.rules)

    def step(self, now: float, engines: Sequence[EngineRecord]) -> ControlStep:
        stats = self.window.close(now)
        return ControlStep(stats, stats.rate_rps, self.targets,
                           self.planner.diff(now, self.targets, engines))
