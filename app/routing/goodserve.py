"""GoodServe: just-enough routing and the SLO watchdog (DESIGN section 4).

Latency estimate (paper Eq. 2):  T(r,g) = q_g + (L_in - H_rg) p_g + L_out_hat d_g.
Just-enough: among instances that can finish r by its deadline, pick the one with
the weakest computing capability (unloaded speed, not current load), so strong
GPUs stay free for urgent requests; ties go to the smaller slack. The watchdog
re-checks running requests every tau iterations and moves those that would miss
their deadline to a stronger instance that can still make it, by token IDs.
Pure, clock-agnostic logic shared by the simulator and the live router.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from app.hardware import InstanceSpec
from app.routing.base import ActiveRequest, Reject, RouteDecision, RoutingPolicy, Watchdog
from app.routing.length import OutputLengthEstimator
from app.routing.status import InstanceEstimate, StatusEstimator
from app.routing.view import (
    ClusterView,
    FinishReport,
    InstanceId,
    InstanceView,
    RouteRequest,
    StepReport,
)


class JustEnoughVariant(StrEnum):
    WEAKEST = "weakest"  # the paper's rule: weakest capable instance
    LEAST_SLACK = "least-slack"  # finish closest to the deadline


def capability_s_per_token(spec: InstanceSpec) -> float:
    """Unloaded decode time per token: larger = weaker. Load never changes the rank."""
    return spec.unloaded_decode_s_per_token


def estimate_latency_s(
    request: RouteRequest, estimate: InstanceEstimate, prefix_hit_tokens: int, output_tokens: float
) -> float:
    """T(r,g): queue + prefill of the uncached context + decode of the remaining output."""
    prefill_tokens = max(request.num_context_tokens - prefix_hit_tokens, 1)
    remaining = max(output_tokens - request.num_generated_tokens, 1.0)
    return (
        estimate.queue_delay_s
        + prefill_tokens * estimate.prefill_s_per_token
        + remaining * estimate.decode_s_per_token
    )


@dataclass(frozen=True)
class Candidate:
    """One instance scored for one request."""

    instance_id: InstanceId
    latency_s: float  # T(r,g)
    slack_s: float  # deadline - (now + T)
    capability_s_per_token: float
    has_memory_room: bool

    @property
    def feasible(self) -> bool:
        return self.slack_s >= 0 and self.has_memory_room


def score_instances(
    request: RouteRequest,
    instances: Sequence[InstanceView],
    view: ClusterView,
    status: StatusEstimator,
    output_tokens: float,
    now: float,
) -> list[Candidate]:
    """T(r,g), slack and memory room of each instance for `request` (O(M))."""
    scored = []
    for inst in instances:
        hit = view.prefix_hit_tokens(inst.instance_id, request)
        latency = estimate_latency_s(request, status.estimate(inst, now), hit, output_tokens)
        room = inst.kv_free_tokens >= request.num_context_tokens - hit
        scored.append(
            Candidate(inst.instance_id, latency, request.deadline_s - (now + latency),
                      capability_s_per_token(inst.spec), room)
        )
    return scored


def pick_just_enough(
    candidates: Sequence[Candidate], variant: JustEnoughVariant
) -> Candidate | None:
    """The feasible candidate the variant prefers; None when none is feasible."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    if variant == JustEnoughVariant.LEAST_SLACK:
        return min(feasible, key=lambda c: (c.slack_s, c.instance_id))
    return min(feasible, key=lambda c: (-c.capability_s_per_token, c.slack_s, c.instance_id))


class JustEnoughPolicy(RoutingPolicy):
    """GoodServe's router: just-enough among instances that meet the deadline.

    When none can: route to the minimum T (best effort), or, with admission control,
    reject early with the reason. `status` and `length` learn from the substrate's
    callbacks through this policy (a watchdog sharing them must not re-forward).
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        variant: JustEnoughVariant = JustEnoughVariant.WEAKEST,
        admission_control: bool = False,
    ) -> None:
        self.status = status
        self.length = length
        self.variant = JustEnoughVariant(variant)
        self.admission_control = admission_control
        self.needs_true_output_length = length.needs_true_output_length

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        holding = view.holding(request)
        if not holding:
            return Reject(f"no instance can hold {request.num_context_tokens} tokens")
        output = self.length.expected_output(request)
        candidates = score_instances(
            request, holding, view, self.status, output, now
        )
        chosen = pick_just_enough(candidates, self.variant)
        if chosen is not None:
            return chosen.instance_id
        fastest = min(candidates, key=lambda c: (c.latency_s, c.instance_id))
        if self.admission_control and request.has_deadline:
            return Reject(
                f"no instance can meet the deadline: best estimate {fastest.latency_s:.2f} s "
                f"for {request.deadline_s - now:.2f} s left"
            )
        return fastest.instance_id

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self.status.on_step(instance_id, report, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.length.on_finish(report, now)


class SloWatchdog(Watchdog):
    """Every tau iterations: migrate requests that would miss their deadline.

    Expected finish of an active request = now + (queue delay if still waiting) +
    re-predicted remaining tokens x d_g of its instance. If that passes the deadline,
    move it to the just-enough choice among *stronger* instances whose estimate
    (re-prefill of prompt + generated ids, then the remaining decode) still meets
    it. At most `max_migrations_per_request` moves per request.
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        tau_iterations: int = 50,
        max_migrations_per_request: int = 1,
        variant: JustEnoughVariant = JustEnoughVariant.WEAKEST,
    ) -> None:
        super().__init__(tau_iterations)
        if max_migrations_per_request < 0:
            raise ValueError("max_migrations_per_request must be >= 0")
        self.status = status
        self.length = length
        self.max_migrations_per_request = max_migrations_per_request
        self.variant = JustEnoughVariant(variant)
        self.needs_true_output_length = length.needs_true_output_length
        self.req_to_num_migrations: dict[str, int] = {}

    def expected_finish_s(self, active: ActiveRequest, source: InstanceView, now: float) -> float:
        estimate = self.status.estimate(source, now)
        remaining = self.length.remaining(active.request, active.num_generated_tokens)
        waiting = 0.0 if active.is_running else estimate.queue_delay_s
        return now + waiting + remaining * estimate.decode_s_per_token

    def check(
        self,
        instance_id: InstanceId,
        active: Sequence[ActiveRequest],
        view: ClusterView,
        now: float,
    ) -> Mapping[str, InstanceId]:
        source = view.get(instance_id)
        source_capability = capability_s_per_token(source.spec)
        stronger = [
            v for v in view.instances if capability_s_per_token(v.spec) < source_capability
        ]
        moves: dict[str, InstanceId] = {}
        if not stronger:
            return moves
        for item in active:
            request = item.request
            rid = request.request_id
            if not request.has_deadline:
                continue
            if self.req_to_num_migrations.get(rid, 0) >= self.max_migrations_per_request:
                continue
            if self.expected_finish_s(item, source, now) <= request.deadline_s:
                continue
            target = self._target(item, stronger, view, now)
            if target is not None:
                moves[rid] = target
                self.req_to_num_migrations[rid] = self.req_to_num_migrations.get(rid, 0) + 1
        return moves

    def _target(
        self, item: ActiveRequest, stronger: Sequence[InstanceView], view: ClusterView, now: float
    ) -> InstanceId | None:
        resumed = _as_resumed(item.request, item.num_generated_tokens)
        holding = [v for v in stronger if v.can_hold(resumed.num_context_tokens)]
        total = self.length.predict_total(item.request, item.num_generated_tokens)
        candidates = score_instances(
            resumed, holding, view, self.status, total, now
        )
        chosen = pick_just_enough(candidates, self.variant)
        return None if chosen is None else chosen.instance_id


def _as_resumed(request: RouteRequest, num_generated: int) -> RouteRequest:
    """The request as a migration target sees it: prompt + generated ids to re-prefill."""
    return replace(request, num_generated_tokens=num_generated)


def make_goodserve(
    length: OutputLengthEstimator,
    *,
    alpha: float = 0.2,
    tau_iterations: int = 50,
    migration: bool = True,
    admission_control: bool = False,
    variant: JustEnoughVariant = JustEnoughVariant.WEAKEST,
    max_migrations_per_request: int = 1,
) -> tuple[JustEnoughPolicy, SloWatchdog | None]:
    """Policy + watchdog sharing one status estimator and one length estimator."""
    status = StatusEstimator(alpha)
    policy = JustEnoughPolicy(status, length, variant, admission_control)
    if not migration:
        return policy, None
    watchdog = SloWatchdog(status, length, tau_iterations, max_migrations_per_request, variant)
    return policy, watchdog


__all__ = [
    "Candidate",
    "JustEnoughPolicy",
    "JustEnoughVariant",
    "SloWatchdog",
    "capability_s_per_token",
    "estimate_latency_s",
    "make_goodserve",
]
