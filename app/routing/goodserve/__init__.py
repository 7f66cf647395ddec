"""GoodServe: just-enough routing and the SLO watchdog (docs/goodserve-routing.md).

Latency estimate (paper Eq. 2):  T(r,g) = q_g + (L_in - H_rg) p_g + L_out_hat d_g.
Just-enough: among instances that can finish r by its deadline, pick the one with
the weakest computing capability (unloaded speed, not current load), so strong
GPUs stay free for urgent requests; ties go to the smaller slack. The watchdog
re-checks running requests every tau iterations and moves those that would miss
their deadline to a stronger instance that can still make it, by token IDs.

One module per job: `config` (every knob, once), `scoring` (T and the compiled
passes over every instance), `admissions` (recent-admission statistics), `placer`
(just-enough, pure), `policy`
(the router's policy), `watchdog` (budgets and migration). Pure, clock-agnostic
logic shared by the simulator and the live router.
"""

from __future__ import annotations

from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import (
    DEFAULT_STALL_FACTOR,
    TRAINED_PREDICTOR_STALL_FACTOR,
    GoodServeConfig,
    JustEnoughVariant,
    LengthReestimate,
    goodserve_knobs,
    stall_factor_for,
    stall_factor_label,
)
from app.routing.goodserve.placer import JustEnoughPlacer
from app.routing.goodserve.policy import JustEnoughPolicy
from app.routing.goodserve.scoring import Candidate, capability_s_per_token
from app.routing.goodserve.watchdog import SloWatchdog
from app.routing.length import OutputLengthEstimator
from app.routing.status import StatusEstimator


def make_goodserve(
    length: OutputLengthEstimator, config: GoodServeConfig = GoodServeConfig()
) -> tuple[JustEnoughPolicy, SloWatchdog]:
    """Policy + watchdog sharing one status estimator, length estimator, budgets and
    record of recent admissions.

    With `max_migrations_per_request` 0 the watchdog still runs (it keeps the
    budgets current) but never moves a request, so that ablation removes exactly
    the migrations.
    """
    status, budgets, admissions = (
        StatusEstimator(config.alpha), SlackBudgets(), RecentAdmissions(config))
    policy = JustEnoughPolicy(status, length, config, budgets, admissions)
    watchdog = SloWatchdog(status, length, config, budgets, admissions)
    return policy, watchdog


__all__ = [
    "DEFAULT_STALL_FACTOR",
    "TRAINED_PREDICTOR_STALL_FACTOR",
    "Candidate",
    "GoodServeConfig",
    "JustEnoughPlacer",
    "JustEnoughPolicy",
    "JustEnoughVariant",
    "LengthReestimate",
    "RecentAdmissions",
    "SloWatchdog",
    "capability_s_per_token",
    "goodserve_knobs",
    "make_goodserve",
    "stall_factor_for",
    "stall_factor_label",
]
