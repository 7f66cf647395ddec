"""Latency estimate and scoring (paper Eq. 2): T(r,g) = q_g + (L_in - H_rg) p_g + L_out_hat d_g.

On a disaggregated decode instance the prefill term is the wait for the prompt's KV
(prefill elsewhere + transfer, `RouteRequest.kv_ready_s`) and no prefill compute.

Every instance is scored for a request as a `Candidate`: its T, the slack left at the
deadline, its unloaded speed (the capability just-enough ranks by), and what the
do-no-harm check needs (the stall its prefill charges, the smallest stall an admitted
request tolerates there). Scoring reads state and changes none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from app.hardware.specs import InstanceSpec
from app.routing.budgets import SlackBudgets
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.status import InstanceEstimate, StatusEstimator
from app.routing.view import ClusterView, RouteRequest


def capability_s_per_token(spec: InstanceSpec) -> float:
    """Unloaded decode time per token: larger = weaker. Load never changes the rank."""
    return spec.unloaded_decode_s_per_token


SHORT_SPAN_TOKENS = 1024  # attended span at which the unloaded per-token figures hold


def context_factors(num_context_tokens: int, prefix_hit_tokens: int, prefill_span_slope: float,
                    decode_context_slope: float) -> tuple[float, float]:
    """How much slower per token this context's prefill and decode are than the figures
    at a short span: the uncached tokens attend to the hit ones and to half of their own
    on average; each decode step reads the whole context. Never below 1, so contexts
    under SHORT_SPAN_TOKENS keep the figures as they are."""
    uncached = max(num_context_tokens - prefix_hit_tokens, 1)
    span = prefix_hit_tokens + uncached / 2
    return (max(1.0, 1.0 + prefill_span_slope * (span - SHORT_SPAN_TOKENS)),
            max(1.0, 1.0 + decode_context_slope * (num_context_tokens - SHORT_SPAN_TOKENS)))


def for_context(estimate: InstanceEstimate, spec: InstanceSpec, request: RouteRequest,
                prefix_hit_tokens: int) -> InstanceEstimate:
    """The instance's (p_g, d_g) for this request's own context (`context_factors`)."""
    prefill, decode = context_factors(request.num_context_tokens, prefix_hit_tokens,
                                      spec.prefill_span_slope, spec.decode_context_slope)
    if prefill == 1.0 and decode == 1.0:
        return estimate
    return replace(estimate, prefill_s_per_token=estimate.prefill_s_per_token * prefill,
                   decode_s_per_token=estimate.decode_s_per_token * decode)


def estimate_latency_s(
    request: RouteRequest, estimate: InstanceEstimate, prefix_hit_tokens: int, output_tokens: float
) -> float:
    """T(r,g): queue + prefill of the uncached context + decode of the remaining output."""
    prefill = prefill_time_s(request, estimate, prefix_hit_tokens)
    return latency_with_prefill_s(request, estimate, prefill, output_tokens)


def latency_with_prefill_s(
    request: RouteRequest, estimate: InstanceEstimate, prefill_s: float, output_tokens: float
) -> float:
    """T(r,g) given its prefill term (the scorer needs that term on its own too)."""
    remaining = max(output_tokens - request.num_generated_tokens, 1.0)
    return estimate.queue_delay_s + prefill_s + remaining * estimate.decode_s_per_token


def prefill_time_s(
    request: RouteRequest, estimate: InstanceEstimate, prefix_hit_tokens: int
) -> float:
    """Prefill of the uncached context (prompt + generated ids when resumed); none on
    a decode instance the prompt's KV is delivered to."""
    if request.kv_ready_s is not None:
        return 0.0
    return max(request.num_context_tokens - prefix_hit_tokens, 1) * estimate.prefill_s_per_token


def kv_wait_s(request: RouteRequest, now: float) -> float:
    """Disaggregated decode: time until the prompt's KV arrives (prefill + transfer)."""
    return 0.0 if request.kv_ready_s is None else max(request.kv_ready_s - now, 0.0)


@dataclass(frozen=True)
class Candidate:
    """One instance scored for one request."""

    instance_id: InstanceId
    latency_s: float  # T(r,g)
    slack_s: float  # deadline - (now + T)
    capability_s_per_token: float
    has_memory_room: bool
    # T were the output as short as the length estimator's optimistic bound
    # (`triage_quantile`): a request late by this bound everywhere is hopeless
    latency_floor_s: float = 0.0
    # what its prefill charges against admitted requests' slack (stall_factor x estimate)
    stall_s: float = 0.0
    shortest_stall_s: float = math.inf  # smallest stall an admitted request tolerates
    reserved: bool = False  # kept for tighter deadlines (`reserve_strongest`)
    uncached_tokens: int = 0  # context it would prefill there (cache affinity)
    queue_s: float = 0.0  # the queue part of T (q_g)

    def feasible(self, headroom: float = 0.0) -> bool:
        """Meets the deadline with `headroom` x T to spare and may take the request."""
        return self.meets_deadline(headroom) and self.admissible()

    def admissible(self) -> bool:
        """Harmless and not reserved for tighter deadlines."""
        return not self.reserved and self.harmless()

    def meets_deadline(self, headroom: float = 0.0) -> bool:
        """Finishes with `headroom` x T to spare, whatever it does to the others.

        The reserve applies to the new request's own estimate only: the admitted
        requests' budgets already hold the slack they had when they were placed.
        """
        return self.slack_s >= headroom * self.latency_s

    def could_meet_deadline(self) -> bool:
        """Would meet the deadline were its output as short as the optimistic bound."""
        return self.slack_s + self.latency_s - self.latency_floor_s >= 0

    def capable(self) -> bool:
        """Would meet the deadline once its queue drained: the GPU itself is fast
        enough for the request where it would run (its cache hit included)."""
        return self.slack_s + self.queue_s >= 0

    def harmless(self) -> bool:
        """Has KV room and its prefill does not stall the instance past what its
        admitted requests tolerate (their slack)."""
        return self.has_memory_room and self.stall_s <= self.shortest_stall_s


def score_instances(
    request: RouteRequest,
    instances: Sequence[InstanceView],
    view: ClusterView,
    status: StatusEstimator,
    output_tokens: float,
    now: float,
    budgets: SlackBudgets | None,
    stall_factor: float,
    floor_output_tokens: float = 1.0,
    long_context: bool = True,
) -> list[Candidate]:
    """T(r,g), slack, memory room and admitted budgets per instance for `request` (O(M));
    the stall its prefill charges is `stall_factor` x the prefill estimate; without
    `budgets` nothing is protected. The latency floor is T at `floor_output_tokens`.
    `long_context`: the per-token estimates are scaled to the request's context
    (`for_context`)."""
    scored = []
    wait = kv_wait_s(request, now)
    for inst in instances:
        hit = view.prefix_hit_tokens(inst.instance_id, request)
        estimate = status.estimate(inst, now, priority=request.priority)
        if long_context:
            estimate = for_context(estimate, inst.spec, request, hit)
        prefill = prefill_time_s(request, estimate, hit)
        latency = wait + latency_with_prefill_s(request, estimate, prefill, output_tokens)
        floor = wait + latency_with_prefill_s(request, estimate, prefill, floor_output_tokens)
        iid = inst.instance_id
        scored.append(Candidate(
            instance_id=inst.instance_id,
            latency_s=latency,
            slack_s=request.deadline_s - (now + latency),
            capability_s_per_token=capability_s_per_token(inst.spec),
            has_memory_room=inst.kv_free_tokens >= request.num_context_tokens - hit,
            latency_floor_s=floor,
            stall_s=stall_factor * prefill,
            shortest_stall_s=budgets.shortest_stall_s(iid) if budgets else math.inf,
            uncached_tokens=max(request.num_context_tokens - hit, 0),
            queue_s=estimate.queue_delay_s,
        ))
    return scored


