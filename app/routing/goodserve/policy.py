"""GoodServe's routing policy: just-enough among the instances that meet the deadline."""

from __future__ import annotations

from collections.abc import Sequence

from app.engine_types import EngineStatus
from app.routing.base import Reject, RouteDecision, RoutingPolicy
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig
from app.routing.goodserve.latency import Candidate
from app.routing.goodserve.placer import JustEnoughPlacer, fallback
from app.routing.length import OutputLengthEstimator, bounded_output
from app.routing.status import StatusEstimator
from app.routing.view import (
    ClusterView,
    FinishReport,
    InstanceId,
    InstanceView,
    RouteRequest,
    StepReport,
)


class JustEnoughPolicy(RoutingPolicy):
    """GoodServe's router (paper Algorithm 1) with the project's additions named in
    its config: confident placement, the cold-start rule, the strongest-GPU
    reservation and do-no-harm budgets.

    When no instance can meet the deadline: best effort (`fallback`: the minimum T
    among instances where it harms no admitted request), or, with admission control,
    reject early with the reason. `status` and `length` learn from the substrate's
    callbacks through this policy (a watchdog sharing them must not re-forward).
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        config: GoodServeConfig = GoodServeConfig(),
        budgets: SlackBudgets | None = None,
        admissions: RecentAdmissions | None = None,
    ) -> None:
        self.status = status
        self.length = length
        self.config = config.for_length(length)
        self.budgets = budgets if budgets is not None else SlackBudgets()
        self.admissions = admissions if admissions is not None else RecentAdmissions(config)
        self.placer = JustEnoughPlacer(status, self.config, self.budgets, self.admissions)
        self.needs_true_output_length = length.needs_true_output_length

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        holding = view.holding(request)
        if not holding:
            return Reject(f"no instance can hold {request.num_context_tokens} tokens")
        output = bounded_output(request, self.length.expected_output(request))
        cold = self.config.fast_while_cold and not self.length.warm(
            self.config.confidence_quantile)
        chosen, candidates = self._place_confidently(request, holding, view, output, now, cold)
        if chosen is None:
            chosen, candidates = self.placer.place(request, holding, view, output, now, cold,
                                                   self._optimistic_output(request, output))
        self.admissions.record_arrival(request, candidates, self.config.headroom)
        if chosen is not None:
            self.admissions.record(chosen.instance_id, chosen.latency_s)
        elif self.config.admission_control and request.has_deadline:
            fastest = min(c.latency_s for c in candidates)
            return Reject(
                f"no instance can meet the deadline: best estimate {fastest:.2f} s "
                f"for {request.deadline_s - now:.2f} s left"
            )
        else:
            chosen = fallback(candidates, self.config.triage)
        self.placer.admit(request, chosen)
        return chosen.instance_id

    def _place_confidently(
        self,
        request: RouteRequest,
        holding: Sequence[InstanceView],
        view: ClusterView,
        output: float,
        now: float,
        cold: bool,
    ) -> tuple[Candidate | None, list[Candidate]]:
        """Just-enough by the confident length, when it says more than the point
        estimate `output`: (None, []) when there is none or no instance qualifies.
        While the estimator is cold, a request with max_tokens is placed by that cap
        (whatever the quantile): its worst case is known, so the weakest instance that
        meets it is safe."""
        if cold and request.max_output_tokens is not None:
            worst_case = float(request.max_output_tokens)
            return self.placer.place(request, holding, view, worst_case, now)
        if self.config.confidence_quantile <= 0.5:  # off: the point estimate alone
            return None, []
        confident = self.length.confident_output(request, self.config.confidence_quantile)
        if confident is None:
            return None, []
        confident = bounded_output(request, confident)
        if confident <= output:
            return None, []
        return self.placer.place(request, holding, view, confident, now, cold)

    def _optimistic_output(self, request: RouteRequest, output: float) -> float:
        """The output length triage assumes before calling a request hopeless: the
        estimator's `triage_quantile` when it knows its spread, else one more token."""
        if not self.config.triage:
            return output
        low = self.length.confident_output(request, self.config.triage_quantile)
        if low is None:
            return float(request.num_generated_tokens + 1)
        return min(bounded_output(request, low), output)

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self.status.on_step(instance_id, report, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        self.status.on_status(status, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.length.on_finish(report, now)
        self.budgets.remove(report.request.request_id)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self.length.on_drop(request, now)
        self.budgets.remove(request.request_id)
