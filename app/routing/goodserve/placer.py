"""The just-enough placer, shared by the router and the watchdog (docs/goodserve-routing.md).

Placing a request scores every instance once (`InstanceScorer`), marks the strongest
ones reserved when they strand tight-deadline requests (`JustEnoughPlacer.reserved`),
and picks at each output length the policy asks about - the weakest feasible instance
(the paper's rule), or, while the length estimator is cold, the fastest one with
capacity to spare. When nothing is feasible, `Scored.fallback` is the best effort.
Probing changes no state: the caller that acts on a choice records its budget with
`admit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig
from app.routing.goodserve.scoring import Candidate, InstanceScorer, Scored, warm_up
from app.routing.instance_view import InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest


@dataclass(frozen=True)
class JustEnoughPlacer:
    """`score` scores one request's instances and changes nothing; `admit` records
    the budget of the choice the caller acts on."""

    status: StatusEstimator
    config: GoodServeConfig  # stall factor resolved for the length estimator
    budgets: SlackBudgets
    admissions: RecentAdmissions

    def __post_init__(self) -> None:
        warm_up()

    def score(self, request: RouteRequest, instances: Sequence[InstanceView],
              view: ClusterView, now: float) -> RequestScoring:
        """`request` scored against `instances` (each read once, whatever the number
        of output lengths tried)."""
        config = self.config
        scorer = InstanceScorer.build(
            request, instances, view, self.status, now,
            self.budgets if config.protect_admitted else None, config.charged_stall_factor,
            config.long_context_estimates)
        reserved = self.reserved(request, scorer, view)
        if reserved is not None:
            scorer = replace(scorer, reserved=reserved)
        return RequestScoring(self, scorer)

    def reserved(self, request: RouteRequest, scorer: InstanceScorer,
                 view: ClusterView) -> np.ndarray | None:
        """The pool's strongest instances, reserved from `request` when they are
        stranding requests and its SLO span is beyond `reservation_quantile` of recent
        arrivals' (None: nothing reserved). A request without a deadline has the
        loosest span of all. Applies to moves as to arrivals: a request kept off the
        strong GPU on arrival must not take it by moving."""
        admissions, quantile = self.admissions, self.config.reservation_quantile
        if quantile >= 1.0 or len(scorer.arrays) == 0 or not admissions.any_stranding():
            return None
        strongest = view.arrays.column("unloaded_decode_s_per_token").min()
        reserved = (scorer.capability == strongest) & admissions.stranding_rows(
            scorer.arrays.ids)
        if not reserved.any() or not request.slo_s > admissions.slo_span_quantile_s(quantile):
            return None
        return reserved

    def admit(self, request: RouteRequest, chosen: Candidate) -> None:
        """Protect `request` on the instance it goes to with the slack it has there; a
        hopeless request (no slack) is not protected."""
        slack = chosen.slack_s
        if request.has_deadline and slack > 0:
            self.budgets.admit(chosen.instance_id, request.request_id, slack)


@dataclass(slots=True)
class RequestScoring:
    """One request's instances scored (an arrival, or a move the watchdog weighs):
    `place` at an output length as often as the caller asks, then `record` the
    arrival's outcome. Read-only (slots, not frozen: one is built per decision)."""

    placer: JustEnoughPlacer
    scorer: InstanceScorer

    def place(self, output_tokens: float, cold: bool = False,
              floor_output_tokens: float = 1.0) -> tuple[Candidate | None, Scored]:
        """(the just-enough choice or None, every instance scored at `output_tokens`).

        `cold`: the length estimate is a lower bound, so a long request looks short
        and the weakest feasible GPU is where it misses; on a fast instance the same
        error costs least, and one that has not turned an arrival away lately
        displaces nobody: the fastest feasible instance with capacity to spare, else
        the variant's pick (docs/goodserve-routing.md, "cold start")."""
        config = self.placer.config
        contended = None
        if cold:
            contended = self.placer.admissions.contended_rows(self.scorer.arrays.ids)
        return self.scorer.place(output_tokens, config.variant, config.headroom,
                                 config.cache_affinity_tokens, contended, floor_output_tokens)

    def record(self, scored: Scored) -> None:
        """What an arrival's final scores say of each instance (`RecentAdmissions`)."""
        self.placer.admissions.record_outcomes(self.scorer.request, self.scorer.arrays.ids,
                                               *scored.outcomes(self.placer.config.headroom))
