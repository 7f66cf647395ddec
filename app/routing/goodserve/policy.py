"""GoodServe's routing policy: just-enough among the instances that meet the deadline."""

from __future__ import annotations

from app.engines.messages import EngineStatus
from app.routing.base import Reject, RejectCode, RouteDecision, RoutingPolicy
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig
from app.routing.goodserve.placer import JustEnoughPlacer, RequestScoring
from app.routing.goodserve.scoring import Candidate, Scored
from app.routing.instance_view import InstanceId
from app.routing.length import OutputLengthEstimator, bounded_output
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, RouteRequest, StepReport


def continues_session(request: RouteRequest) -> bool:
    """A later step of an agent session: turning it away would end a session already
    admitted, wasting its earlier steps and failing its later ones."""
    return request.session_id is not None and request.step_index > 0


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
            return Reject(f"no instance can hold {request.num_context_tokens} tokens",
                          RejectCode.CONTEXT_TOO_LONG)
        output = bounded_output(request, self.length.expected_output(request))
        cold = self.config.fast_while_cold and not self.length.warm(
            self.config.confidence_quantile)
        scoring = self.placer.score(request, holding, view, now)
        chosen, scored = self._place_confidently(scoring, request, output, cold)
        if chosen is None:
            chosen, scored = scoring.place(output, cold, self._optimistic_output(request, output))
        scoring.record(scored)
        if chosen is not None:
            self.admissions.record(chosen.instance_id, chosen.latency_s)
        elif (self.config.admission_control and request.has_deadline
              and not continues_session(request) and not scored.meets_deadline()):
            return Reject(
                f"no instance can meet the deadline: best estimate "
                f"{scored.fastest_s():.2f} s for {request.deadline_s - now:.2f} s left"
            )
        else:
            chosen = scored.fallback(self.triages(request), self.config.cache_affinity_tokens,
                                     self.homes(request))
        self.placer.admit(request, chosen)
        return chosen.instance_id

    def _place_confidently(
        self, scoring: RequestScoring, request: RouteRequest, output: float, cold: bool
    ) -> tuple[Candidate | None, Scored | None]:
        """Just-enough by the confident length, when it says more than the point
        estimate `output`: (None, None) when there is none or no instance qualifies.
        While the estimator is cold, a request with max_tokens is placed by that cap
        (whatever the quantile): its worst case is known, so the weakest instance that
        meets it is safe."""
        if cold and request.max_output_tokens is not None:
            return scoring.place(float(request.max_output_tokens))
        if self.config.confidence_quantile <= 0.5:  # off: the point estimate alone
            return None, None
        confident = self.length.confident_output(request, self.config.confidence_quantile)
        if confident is None:
            return None, None
        confident = bounded_output(request, confident)
        if confident <= output:
            return None, None
        return scoring.place(confident, cold)

    def triages(self, request: RouteRequest) -> bool:
        """Whether a hopeless `request` goes to the triage sink: always when triage is
        on; else when its context is long enough that its latency is mostly the known
        queue and prefill, not the guessed output (`triage_min_context_tokens`). A
        session's step only with `triage_session_steps`."""
        if request.session_id is not None and not self.config.triage_session_steps:
            return False
        if self.config.triage:
            return True
        floor = self.config.triage_min_context_tokens
        return floor is not None and request.num_context_tokens >= floor

    def homes(self, request: RouteRequest) -> bool:
        """Whether best effort places `request` as its session's home
        (`Scored.fallback`, `session_homes`)."""
        return self.config.session_homes and request.session_id is not None

    def _optimistic_output(self, request: RouteRequest, output: float) -> float:
        """The output length triage assumes before calling a request hopeless: the
        estimator's `triage_quantile` when it knows its spread, else one more token."""
        if not self.triages(request):
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
