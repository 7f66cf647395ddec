"""A tiny per-instance reference of GoodServe's placement rules, in plain Python.

The product scores every instance in compiled passes over columns
(`app/routing/goodserve/scoring.py`); this module writes the same rules one instance
at a time, readable line by line, so a property test can hold the compiled path to
the same decisions on random views. `ReferencePlacer` stands in for
`JustEnoughPlacer` in a policy or a watchdog.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig, JustEnoughVariant
from app.routing.goodserve.scoring import SHORT_SPAN_TOKENS, kv_wait_s
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest


@dataclass(frozen=True)
class Candidate:
    """One instance scored for one request."""

    instance_id: InstanceId
    latency_s: float
    slack_s: float
    capability_s_per_token: float
    has_memory_room: bool
    latency_floor_s: float
    stall_s: float
    shortest_stall_s: float
    uncached_tokens: int
    queue_s: float
    reserved: bool = False

    def meets_deadline(self, headroom: float = 0.0) -> bool:
        return self.slack_s >= headroom * self.latency_s

    def harmless(self) -> bool:
        return self.has_memory_room and self.stall_s <= self.shortest_stall_s

    def admissible(self) -> bool:
        return not self.reserved and self.harmless()

    def feasible(self, headroom: float = 0.0) -> bool:
        return self.meets_deadline(headroom) and self.admissible()


def score(request: RouteRequest, instances: Sequence[InstanceView], view: ClusterView,
          status: StatusEstimator, output_tokens: float, floor_output_tokens: float,
          now: float, budgets: SlackBudgets | None, config: GoodServeConfig
          ) -> list[Candidate]:
    """T(r,g) = q_g + (L_in - H_rg) p_g + L_out d_g and what do-no-harm needs, per
    instance, with the per-token figures scaled to the request's context."""
    scored = []
    wait = kv_wait_s(request, now)
    context = request.num_context_tokens
    for inst in instances:
        hit = view.prefix_hit_tokens(inst.instance_id, request)
        estimate = status.estimate(inst, now, priority=request.priority)
        prefill_per_token, decode = estimate.prefill_s_per_token, estimate.decode_s_per_token
        uncached = max(context - hit, 1)
        if config.long_context_estimates:
            span = hit + uncached / 2
            prefill_per_token *= max(1.0, 1.0 + inst.spec.prefill_span_slope
                                     * (span - SHORT_SPAN_TOKENS))
            decode *= max(1.0, 1.0 + inst.spec.decode_context_slope
                          * (context - SHORT_SPAN_TOKENS))
        prefill = 0.0 if request.kv_ready_s is not None else uncached * prefill_per_token
        ahead = estimate.queue_delay_s + prefill

        def latency(tokens: float, ahead: float = ahead, decode: float = decode) -> float:
            return wait + (ahead + max(tokens - request.num_generated_tokens, 1.0) * decode)

        scored.append(Candidate(
            inst.instance_id, latency(output_tokens),
            request.deadline_s - (now + latency(output_tokens)),
            inst.spec.unloaded_decode_s_per_token, inst.kv_free_tokens >= context - hit,
            latency(floor_output_tokens), config.charged_stall_factor * prefill,
            budgets.shortest_stall_s(inst.instance_id) if budgets else math.inf,
            max(context - hit, 0), estimate.queue_delay_s))
    return scored


def pick_just_enough(candidates: Sequence[Candidate], variant: JustEnoughVariant,
                     headroom: float, affinity_tokens: int | None) -> Candidate | None:
    feasible = [c for c in candidates if c.feasible(headroom)]
    if affinity_tokens is not None and feasible:
        least = min(c.uncached_tokens for c in feasible)
        feasible = [c for c in feasible if c.uncached_tokens <= least + affinity_tokens]
    if not feasible:
        return None
    if variant == JustEnoughVariant.LEAST_SLACK:
        return min(feasible, key=lambda c: (c.slack_s, c.instance_id))
    return min(feasible, key=lambda c: (-c.capability_s_per_token, c.slack_s, c.instance_id))


@dataclass(frozen=True)
class ReferenceScored:
    """Every instance's `Candidate` at one length, with `Scored`'s questions."""

    candidates: list[Candidate]

    def meets_deadline(self) -> bool:
        return any(c.feasible(0.0) for c in self.candidates)

    def fastest_s(self) -> float:
        return min(c.latency_s for c in self.candidates)

    def fallback(self, triage: bool, affinity_tokens: int | None = None,
                 session_home: bool = False) -> Candidate:
        candidates = self.candidates
        meeting = [c for c in candidates if c.feasible(0.0)]
        if meeting:
            chosen = pick_just_enough(meeting, JustEnoughVariant.WEAKEST, 0.0, affinity_tokens)
            assert chosen is not None
            return chosen
        if triage and not any(c.slack_s + c.latency_s - c.latency_floor_s >= 0
                              for c in candidates):
            room = [c for c in candidates if c.has_memory_room]
            pool = [c for c in room if c.admissible()] or room or candidates
            return max(pool, key=lambda c: (c.latency_s, c.instance_id))
        pool = [c for c in candidates if c.admissible()] or candidates
        if session_home:
            pool = [c for c in pool if c.slack_s + c.queue_s >= 0] or pool
        return min(pool, key=lambda c: (c.latency_s, c.instance_id))


@dataclass(frozen=True)
class ReferenceScoring:
    placer: ReferencePlacer
    request: RouteRequest
    instances: Sequence[InstanceView]
    view: ClusterView
    now: float

    def place(self, output_tokens: float, cold: bool = False,
              floor_output_tokens: float = 1.0) -> tuple[Candidate | None, ReferenceScored]:
        placer, config = self.placer, self.placer.config
        budgets = placer.budgets if config.protect_admitted else None
        candidates = placer.reserve(self.request, score(
            self.request, self.instances, self.view, placer.status, output_tokens,
            floor_output_tokens, self.now, budgets, config), self.view)
        if cold:
            spare = [c for c in candidates if c.feasible(config.headroom)
                     and not placer.admissions.contended(c.instance_id)]
            if spare:
                return min(spare, key=lambda c: (c.latency_s, c.instance_id)), \
                    ReferenceScored(candidates)
        chosen = pick_just_enough(candidates, config.variant, config.headroom,
                                  config.cache_affinity_tokens)
        return chosen, ReferenceScored(candidates)

    def record(self, scored: ReferenceScored) -> None:
        headroom = self.placer.config.headroom
        candidates = scored.candidates
        turned_away = [i for i, c in enumerate(candidates)
                       if c.meets_deadline(headroom) and not c.admissible()]
        stranded = []
        if not any(c.meets_deadline() and c.harmless() for c in candidates):
            stranded = [i for i, c in enumerate(candidates)
                        if c.meets_deadline() and not c.harmless()]
        self.placer.admissions.record_outcomes(
            self.request, [c.instance_id for c in candidates],
            np.array(turned_away, dtype=np.int64), np.array(stranded, dtype=np.int64))


@dataclass(frozen=True)
class ReferencePlacer:
    status: StatusEstimator
    config: GoodServeConfig
    budgets: SlackBudgets
    admissions: RecentAdmissions

    def score(self, request: RouteRequest, instances: Sequence[InstanceView],
              view: ClusterView, now: float) -> ReferenceScoring:
        return ReferenceScoring(self, request, instances, view, now)

    def reserve(self, request: RouteRequest, candidates: list[Candidate],
                view: ClusterView) -> list[Candidate]:
        quantile, admissions = self.config.reservation_quantile, self.admissions
        if quantile >= 1.0 or not candidates or not admissions.any_stranding():
            return candidates
        strongest = min(v.spec.unloaded_decode_s_per_token for v in view.instances)
        return [replace(c, reserved=True)
                if c.capability_s_per_token == strongest
                and admissions.stranding_rows((c.instance_id,))[0]
                and request.slo_s > admissions.slo_span_quantile_s(quantile) else c
                for c in candidates]

    def admit(self, request: RouteRequest, chosen: Candidate) -> None:
        if request.has_deadline and chosen.slack_s > 0:
            self.budgets.admit(chosen.instance_id, request.request_id, chosen.slack_s)


def use_reference(owner: object) -> None:
    """Swap the placer of a `JustEnoughPolicy` or `SloWatchdog` for the reference."""
    placer = owner.placer  # type: ignore[attr-defined]
    owner.placer = ReferencePlacer(placer.status, placer.config,  # type: ignore[attr-defined]
                                   placer.budgets, placer.admissions)
