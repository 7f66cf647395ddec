"""The just-enough placer, shared by the router and the watchdog (docs/goodserve-routing.md).

Placing a request is four pure steps: score every instance (`score_instances`), mark
the strongest ones reserved when they strand tight-deadline requests
(`reserve_strongest`), and pick - the weakest feasible instance (the paper's rule), or,
while the length estimator is cold, the fastest one with capacity to spare
(`pick_while_cold`). When nothing is feasible, `fallback` is the best effort. Probing
changes no state: the caller that acts on a choice records its budget with `admit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig, JustEnoughVariant
from app.routing.goodserve.latency import Candidate, capability_s_per_token, score_instances
from app.routing.instance_view import InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest


def pick_just_enough(
    candidates: Sequence[Candidate], variant: JustEnoughVariant, headroom: float = 0.0,
    affinity_tokens: int | None = None,
) -> Candidate | None:
    """The feasible candidate the variant prefers; None when none is feasible.

    `headroom` keeps part of the slack in reserve: a request admitted with zero slack
    misses as soon as later arrivals slow its instance down. `affinity_tokens` narrows
    the choice to the feasible instances that hold the request's context cached
    (`near_cache`).
    """
    feasible = near_cache([c for c in candidates if c.feasible(headroom)], affinity_tokens)
    if not feasible:
        return None
    if variant == JustEnoughVariant.LEAST_SLACK:
        return min(feasible, key=lambda c: (c.slack_s, c.instance_id))
    return min(feasible, key=lambda c: (-c.capability_s_per_token, c.slack_s, c.instance_id))


def near_cache(feasible: list[Candidate], affinity_tokens: int | None) -> list[Candidate]:
    """Cache affinity (project addition): the candidates whose uncached prompt is within
    `affinity_tokens` of the least uncached one. Just-enough ranks by speed alone, so a
    long context cached on one GPU would be recomputed on a weaker one that still
    meets the deadline: the recompute costs that GPU's time, and every request queued
    behind it. Short prompts are within any sensible margin, so it changes nothing there.
    """
    if affinity_tokens is None or not feasible:
        return feasible
    least = min(c.uncached_tokens for c in feasible)
    return [c for c in feasible if c.uncached_tokens <= least + affinity_tokens]


def pick_while_cold(
    candidates: Sequence[Candidate],
    variant: JustEnoughVariant,
    headroom: float,
    admissions: RecentAdmissions,
    affinity_tokens: int | None = None,
) -> Candidate | None:
    """Just-enough while the length estimator is cold (`OutputLengthEstimator.warm`):
    the fastest feasible instance with capacity to spare, else the variant's pick.

    A cold estimate is a lower bound, so a long request looks short and the weakest
    feasible GPU is where it misses; on a fast instance the same error costs least,
    and one that has not turned an arrival away lately displaces nobody
    (docs/goodserve-routing.md, "cold start").
    """
    spare = [c for c in candidates
             if c.feasible(headroom) and not admissions.contended(c.instance_id)]
    if spare:
        return min(spare, key=lambda c: (c.latency_s, c.instance_id))
    return pick_just_enough(candidates, variant, headroom, affinity_tokens)


def fallback(candidates: Sequence[Candidate], triage: bool,
             affinity_tokens: int | None = None, session_home: bool = False) -> Candidate:
    """Best effort when no instance meets the deadline with headroom.

    First the just-enough pick among instances that meet it with none to spare. Else,
    with `triage`, a hopeless request (late everywhere even with its optimistic
    length) goes to `triage_sink`. Else the minimum T among the instances that can
    take the request without breaking an admitted request's budget and are not
    reserved (all of them when none can): plain min-T would herd every late request
    onto the fastest instance and make the requests already there late too.

    `session_home` (an agent session's step): only instances `capable` of the request
    once their queues drain, where there are any. The step's context stays cached where
    it runs, so its session's next steps are drawn there; a GPU too slow for the
    session's deadlines would hold them all late.
    """
    meeting = [c for c in candidates if c.feasible(headroom=0.0)]
    if meeting:
        return pick_just_enough(meeting, JustEnoughVariant.WEAKEST, 0.0, affinity_tokens)
    if triage and not any(c.could_meet_deadline() for c in candidates):
        return triage_sink(candidates)
    admissible = [c for c in candidates if c.admissible()] or candidates
    if session_home:
        admissible = [c for c in admissible if c.capable()] or admissible
    return min(admissible, key=lambda c: (c.latency_s, c.instance_id))


def triage_sink(candidates: Sequence[Candidate]) -> Candidate:
    """Where a hopeless request takes the least from requests that can still meet their
    deadlines (project addition, "triage"): the instance with the largest T, already
    the most backlogged, among those it does no harm to and with KV room. A burst's
    hopeless part piles up there instead of queueing ahead of the feasible requests
    on every instance, as min-T placement spreads it."""
    room = [c for c in candidates if c.has_memory_room]
    pool = [c for c in room if c.admissible()] or room or list(candidates)
    return max(pool, key=lambda c: (c.latency_s, c.instance_id))


def reserve_strongest(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    view: ClusterView,
    admissions: RecentAdmissions,
    quantile: float,
) -> list[Candidate]:
    """Mark the pool's strongest instances reserved for `request` when they are
    stranding requests and its SLO span is beyond `quantile` of recent arrivals'.

    A request without a deadline has the loosest span of all. Applies to moves as to
    arrivals: a request kept off the strong GPU on arrival must not take it by moving.
    """
    if quantile >= 1.0 or not candidates or not admissions.any_stranding():
        return list(candidates)
    strongest = min(capability_s_per_token(v.spec) for v in view.instances)
    limit: float | None = None
    marked = []
    for c in candidates:
        if c.capability_s_per_token == strongest and admissions.stranding(c.instance_id):
            if limit is None:
                limit = admissions.slo_span_quantile_s(quantile)
            if request.slo_s > limit:
                c = replace(c, reserved=True)
        marked.append(c)
    return marked


@dataclass(frozen=True)
class JustEnoughPlacer:
    """`place` scores, reserves and picks for one request and changes nothing; `admit`
    records the budget of the choice the caller acts on."""

    status: StatusEstimator
    config: GoodServeConfig  # stall factor resolved for the length estimator
    budgets: SlackBudgets
    admissions: RecentAdmissions

    def place(
        self,
        request: RouteRequest,
        instances: Sequence[InstanceView],
        view: ClusterView,
        output_tokens: float,
        now: float,
        cold: bool = False,
        floor_output_tokens: float = 1.0,
    ) -> tuple[Candidate | None, list[Candidate]]:
        """(the chosen candidate or None, every scored candidate); `cold`: the length
        estimate is a lower bound (`pick_while_cold`); `floor_output_tokens`: the
        optimistic length the candidates' latency floors assume."""
        guard = self.budgets if self.config.protect_admitted else None
        scored = score_instances(request, instances, view, self.status, output_tokens, now,
                                 guard, self.config.charged_stall_factor, floor_output_tokens,
                                 self.config.long_context_estimates)
        candidates = reserve_strongest(request, scored, view, self.admissions,
                                       self.config.reservation_quantile)
        affinity = self.config.cache_affinity_tokens
        if cold:
            chosen = pick_while_cold(candidates, self.config.variant, self.config.headroom,
                                     self.admissions, affinity)
        else:
            chosen = pick_just_enough(candidates, self.config.variant, self.config.headroom,
                                      affinity)
        return chosen, candidates

    def admit(self, request: RouteRequest, chosen: Candidate) -> None:
        """Protect `request` on the instance it goes to with the slack it has there; a
        hopeless request (no slack) is not protected."""
        if request.has_deadline and chosen.slack_s > 0:
            self.budgets.admit(chosen.instance_id, request.request_id, chosen.slack_s)
