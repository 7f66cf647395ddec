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

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from app.engine_types import EngineStatus
from app.hardware import InstanceSpec
from app.routing.base import ActiveRequest, Reject, RouteDecision, RoutingPolicy, Watchdog
from app.routing.budgets import SlackBudgets
from app.routing.length import OutputLengthEstimator, PredictorLength, bounded_output
from app.routing.quantiles import nearest_rank_quantile
from app.routing.status import InstanceEstimate, StatusEstimator
from app.routing.view import (
    ClusterView,
    FinishReport,
    InstanceId,
    InstanceView,
    RouteRequest,
    StepReport,
)

# The watchdog moves a request only when it would finish later than its deadline by
# more than this fraction of its time left. With the migration cost gate below no
# margin is needed (dev runs, six workload seeds at 190 req/s: with the gate, margin 0
# beat margin 1 by 2.8 req/s at SLO scale 2); a margin of 1 was the default before the
# gate, when margin 0 moved ~300 requests a minute, four fifths of which met their
# deadline without moving.
DEFAULT_MIGRATION_MARGIN = 0.0

# Admitted requests' budgets (slack) are refreshed every this many iterations of their
# instance, more often than tau: a budget set from a stale prediction closes the
# instance to requests it could take, or leaves it open to ones that hurt
# (190 req/s, scale 2, seed 0, no migration, with the former per-token budgets:
# refresh every 10 / 50 / 100 / 200 iterations -> 173.4 / 166.5 / 152.2 / 145.6 req/s).
DEFAULT_BUDGET_REFRESH_ITERATIONS = 10

# A move may take no more of its target than this quantile of the estimated latency T
# of the new requests just-enough recently placed there: goodput counts requests, so a
# move that costs the target more than the typical arrival it displaces loses on
# average. Only contended targets are gated (`RecentAdmissions.contended`): at light
# load a gate everywhere blocked the moves that rescue under-predicted requests. 190
# req/s, six workload seeds (docs/goodserve-routing.md, "migration cost gate"):
# GoodServe vs no migration +0.2 / -1.7 / +0.7 / -1.0 / +2.7 req/s at SLO scales 1 /
# 1.5 / 2 / 2.5 / 3; without the gate (margin 1) migration cost 4.0 / 1.3 / 3.0 / 0.2
# req/s at scales 1-2.5.
DEFAULT_MIGRATION_COST_QUANTILE = 0.5
RECENT_ADMISSIONS_WINDOW = 200

# When the strongest instances strand requests (one turned away, for lack of capacity,
# an arrival that then had no feasible instance at all), they take only requests whose
# SLO span (deadline - arrival) is within this quantile of recent arrivals' spans: under
# overload the strong GPU's capacity goes to the many tight-deadline requests that can
# meet nowhere else rather than to the loosest, which hold it longest (an SLO is
# usually set in proportion to the work asked for). 190 req/s, six workload seeds, SLO
# scales 1 / 1.5 / 2 / 2.5 / 3: +17.5 / +9.2 / +3.3 / +4.3 / +0.7 req/s over the policy
# without it (docs/goodserve-routing.md, "strongest-GPU reservation"); picked from 0.8
# / 0.9 / 0.95 on seeds 0-1: lower quantiles lose at scale 2, where the loose requests
# could still meet.
DEFAULT_RESERVATION_QUANTILE = 0.9
# The do-no-harm check charges a newcomer's whole prefill estimate against the smallest
# admitted slack. The estimate overstates the real stall (p_g is measured over whole
# iterations), so the factor sets how hard the check throttles admissions, and the
# right strength depends on the length estimator: a trained predictor over-predicts
# the requests it calls late (seed 0, scale 1: median predicted / true 1.10 among those
# the H800 took although estimated late; 99% met), so a lighter charge lets the strong
# GPU take them. MoE, 190 req/s: 0.5 was picked from 0.25 / 0.5 / 0.75 / 1 / 2 on
# workload seeds 0-1; against 1.0 at SLO scales 1 / 1.5 / 2 / 2.5 / 3 it gains
# +8.3 / +0.6 / +0.0 / +1.2 / +0.2 req/s on seeds 0-5 and +9.6 / -0.3 / -2.2 / -0.5 /
# +0.4 on held-out seeds 6-11, and only 0.5 keeps GoodServe above slo-pack at scale 1
# on every seed. With exact lengths (the oracle) "estimated late" means late and 0.5
# floods the H800 (seed 0, scale 1: 23.9 against 90.5 req/s); the label-free running
# history loses 5% at scale 3 with it (docs/goodserve-routing.md, "stall factor"). So
# the registry picks the factor per estimator (`stall_factor_for`) unless RoutingOptions
# pins one.
DEFAULT_STALL_FACTOR = 1.0  # exact or label-free lengths
TRAINED_PREDICTOR_STALL_FACTOR = 0.5  # a trained predictor (`PredictorLength`)
# Just-enough first places a request by a confident length - this quantile of the
# length estimator's spread, when it has one (the label-free running history does) -
# and falls back to the point estimate only when no instance meets the deadline with
# it. The history's median sits in the short mode of a bimodal workload, so a long
# generation looked loose and went to the weakest GPU, where it missed (the seeded
# small-cluster workload, `benchmarks.bimodal_goodput`, five seeds: README, "Without a
# trained predictor"). 0.9 was set before measuring; 0.75 and 0.95 score alike there.
DEFAULT_CONFIDENCE_QUANTILE = 0.9
RECENT_SLO_WINDOW = 1000  # arrivals whose SLO spans set the reservation's limit
MIN_SLO_SAMPLES = 100  # no reservation before this many arrivals were seen


class JustEnoughVariant(StrEnum):
    WEAKEST = "weakest"  # the paper's rule: weakest capable instance
    LEAST_SLACK = "least-slack"  # finish closest to the deadline


def stall_factor_for(length: OutputLengthEstimator) -> float:
    """The do-no-harm charge that suits `length`'s errors (see TRAINED_PREDICTOR_STALL_FACTOR)."""
    if isinstance(length, PredictorLength):
        return TRAINED_PREDICTOR_STALL_FACTOR
    return DEFAULT_STALL_FACTOR


def capability_s_per_token(spec: InstanceSpec) -> float:
    """Unloaded decode time per token: larger = weaker. Load never changes the rank."""
    return spec.unloaded_decode_s_per_token


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
    """Prefill of the uncached context (prompt + generated ids when resumed)."""
    return max(request.num_context_tokens - prefix_hit_tokens, 1) * estimate.prefill_s_per_token


@dataclass(frozen=True)
class Candidate:
    """One instance scored for one request."""

    instance_id: InstanceId
    latency_s: float  # T(r,g)
    slack_s: float  # deadline - (now + T)
    capability_s_per_token: float
    has_memory_room: bool
    # what its prefill charges against admitted requests' slack (stall_factor x estimate)
    stall_s: float = 0.0
    shortest_stall_s: float = math.inf  # smallest stall an admitted request tolerates
    reserved: bool = False  # kept for tighter deadlines (`reserve_strongest`)

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
    budgets: SlackBudgets | None = None,
    stall_factor: float = DEFAULT_STALL_FACTOR,
) -> list[Candidate]:
    """T(r,g), slack, memory room and admitted budgets per instance for `request` (O(M));
    the stall its prefill charges is `stall_factor` x the prefill estimate."""
    scored = []
    for inst in instances:
        hit = view.prefix_hit_tokens(inst.instance_id, request)
        estimate = status.estimate(inst, now)
        prefill = prefill_time_s(request, estimate, hit)
        latency = latency_with_prefill_s(request, estimate, prefill, output_tokens)
        iid = inst.instance_id
        scored.append(Candidate(
            instance_id=inst.instance_id,
            latency_s=latency,
            slack_s=request.deadline_s - (now + latency),
            capability_s_per_token=capability_s_per_token(inst.spec),
            has_memory_room=inst.kv_free_tokens >= request.num_context_tokens - hit,
            stall_s=stall_factor * prefill,
            shortest_stall_s=budgets.shortest_stall_s(iid) if budgets else math.inf,
        ))
    return scored


def pick_just_enough(
    candidates: Sequence[Candidate], variant: JustEnoughVariant, headroom: float = 0.0
) -> Candidate | None:
    """The feasible candidate the variant prefers; None when none is feasible.

    `headroom` keeps part of the slack in reserve: a request admitted with zero slack
    misses as soon as later arrivals slow its instance down.
    """
    feasible = [c for c in candidates if c.feasible(headroom)]
    if not feasible:
        return None
    if variant == JustEnoughVariant.LEAST_SLACK:
        return min(feasible, key=lambda c: (c.slack_s, c.instance_id))
    return min(feasible, key=lambda c: (-c.capability_s_per_token, c.slack_s, c.instance_id))


def pick_while_cold(
    candidates: Sequence[Candidate],
    variant: JustEnoughVariant,
    headroom: float,
    admissions: RecentAdmissions,
) -> Candidate | None:
    """Just-enough while the length estimator is cold (`OutputLengthEstimator.warm`):
    the fastest feasible instance with capacity to spare, else the variant's pick.

    A cold estimate is a lower bound, so a long request looks short and the weakest
    feasible GPU is where it misses; on a fast instance the same error costs least,
    and one that has not turned an arrival away lately displaces nobody. Bimodal
    workload, five seeds, 20 req/s, met at SLO scales 1 / 2 / 3: 2,249 / 4,380 / 5,537
    against 2,264 / 4,160 / 5,106 with the weakest pick throughout; the fastest
    feasible instance regardless of contention floods the H800 at scale 1 (1,855)
    (docs/goodserve-routing.md, "cold start").
    """
    spare = [c for c in candidates
             if c.feasible(headroom) and not admissions.contended(c.instance_id)]
    if spare:
        return min(spare, key=lambda c: (c.latency_s, c.instance_id))
    return pick_just_enough(candidates, variant, headroom)


def fallback(candidates: Sequence[Candidate]) -> Candidate:
    """Best effort when no instance can meet the deadline: the minimum T among the
    instances that can take the request without breaking an admitted request's
    budget and are not reserved (all of them when none can). Plain min-T would herd
    every late request onto the fastest instance and make the requests already there
    late too."""
    admissible = [c for c in candidates if c.admissible()] or candidates
    return min(admissible, key=lambda c: (c.latency_s, c.instance_id))


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
class JustEnoughConfig:
    """How just-enough picks; shared by the router and the watchdog."""

    variant: JustEnoughVariant = JustEnoughVariant.WEAKEST
    # slack kept in reserve, as a fraction of T: instances that would finish with less
    # spare time count as infeasible, so later arrivals cannot push them past deadline
    # (0.5 = finish within 2/3 of the time left; chosen by benchmarks/goodput_experiments)
    headroom: float = 0.5
    admission_control: bool = False  # reject early when no instance can make it
    # "do no harm": skip instances where this request's prefill would stall a request
    # already placed there past its slack (see app/routing/budgets.py)
    protect_admitted: bool = True
    # stranding strongest instances take only requests whose SLO span is within this
    # quantile of recent arrivals' (`reserve_strongest`); 1 = no reservation
    reservation_quantile: float = DEFAULT_RESERVATION_QUANTILE
    # share of a newcomer's prefill estimate (L_in x p_g, p_g over whole iterations:
    # 12-31x a prompt token's marginal cost under load) charged against admitted
    # requests' slack; in effect the admission throttle's strength (0 = no throttle)
    stall_factor: float = DEFAULT_STALL_FACTOR
    # place by this quantile of the predicted length first, when the length estimator
    # knows its spread; the point estimate only when that finds no instance
    # (0.5 = the point estimate alone)
    confidence_quantile: float = DEFAULT_CONFIDENCE_QUANTILE
    # while the length estimator is cold (its lengths are lower bounds), take the
    # fastest feasible instance with capacity to spare (`pick_while_cold`)
    fast_while_cold: bool = True

    def __post_init__(self) -> None:
        if self.headroom < 0:
            raise ValueError(f"headroom must be >= 0, got {self.headroom}")
        if self.stall_factor < 0:
            raise ValueError(f"stall_factor must be >= 0, got {self.stall_factor}")
        if not 0.5 <= self.confidence_quantile <= 1.0:
            raise ValueError(
                f"confidence_quantile must be in [0.5, 1], got {self.confidence_quantile}")
        if not 0.0 <= self.reservation_quantile <= 1.0:
            raise ValueError(
                f"reservation_quantile must be in [0, 1], got {self.reservation_quantile}")


@dataclass(frozen=True)
class JustEnoughPlacer:
    """The placement step the router and the watchdog share: score the instances,
    reserve the stranding strongest ones, pick just-enough, and record the chosen
    instance's budget for the request."""

    status: StatusEstimator
    config: JustEnoughConfig
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
    ) -> tuple[Candidate | None, list[Candidate]]:
        """(the chosen candidate or None, every scored candidate); `cold`: the length
        estimate is a lower bound (`pick_while_cold`)."""
        guard = self.budgets if self.config.protect_admitted else None
        candidates = reserve_strongest(
            request,
            score_instances(request, instances, view, self.status, output_tokens, now, guard,
                            self.config.stall_factor),
            view, self.admissions, self.config.reservation_quantile,
        )
        if cold:
            chosen = pick_while_cold(candidates, self.config.variant, self.config.headroom,
                                     self.admissions)
        else:
            chosen = pick_just_enough(candidates, self.config.variant, self.config.headroom)
        if chosen is not None:
            self._admit(request, chosen)
        return chosen, candidates

    def place_best_effort(
        self, request: RouteRequest, candidates: Sequence[Candidate]
    ) -> Candidate:
        """The fallback when `place` found nothing feasible; a request that can still
        make it there (positive slack) is protected like any other."""
        chosen = fallback(candidates)
        self._admit(request, chosen)
        return chosen

    def _admit(self, request: RouteRequest, chosen: Candidate) -> None:
        if request.has_deadline and chosen.slack_s > 0:  # hopeless requests are not protected
            self.budgets.admit(chosen.instance_id, request.request_id, chosen.slack_s)


class RecentAdmissions:
    """What recent arrivals cost each instance and whether it had to turn any away:
    the yardstick for what a migration may take there, and for when the strongest
    instances reserve themselves.

    Per instance, the estimated latency T of the last `window` new requests placed on
    it with room to spare; and whether, within the last `window` arrivals, it turned
    away one that would have met its deadline there - contended: it has arrivals a
    move could displace - and whether it did so for lack of capacity (memory or an
    admitted request's budget) when the arrival had no feasible instance at all -
    stranding (a reservation's own refusals do not count, or it would feed itself).
    Across instances, the SLO spans of the last `slo_window` arrivals.
    """

    def __init__(
        self, window: int = RECENT_ADMISSIONS_WINDOW, slo_window: int = RECENT_SLO_WINDOW
    ) -> None:
        if window < 1 or slo_window < 1:
            raise ValueError(f"windows must be >= 1, got {window} and {slo_window}")
        self.window = window
        self._latencies: dict[InstanceId, deque[float]] = {}
        self._num_arrivals = 0
        self._last_turned_away: dict[InstanceId, int] = {}  # arrival number
        self._last_stranded: dict[InstanceId, int] = {}  # arrival number
        self._last_any_stranded: int | None = None
        self._slo_spans: deque[float] = deque(maxlen=slo_window)
        self._span_quantile: tuple[tuple[int, float], float] = ((-1, 0.0), math.inf)

    def record_arrival(
        self, request: RouteRequest, candidates: Sequence[Candidate], headroom: float
    ) -> None:
        """A new request was scored against `candidates`."""
        self._num_arrivals += 1
        if request.has_deadline:
            self._slo_spans.append(request.slo_s)
        turned_away = [c for c in candidates if c.meets_deadline(headroom) and not c.admissible()]
        if not turned_away:
            return
        stranded = not any(c.meets_deadline(headroom) and c.harmless() for c in candidates)
        for c in turned_away:
            self._last_turned_away[c.instance_id] = self._num_arrivals
            if stranded and not c.harmless():  # for lack of capacity, not by reservation
                self._last_stranded[c.instance_id] = self._num_arrivals
                self._last_any_stranded = self._num_arrivals

    def record(self, instance_id: InstanceId, latency_s: float) -> None:
        """A new request was placed on `instance_id` with estimated latency T."""
        latencies = self._latencies.get(instance_id)
        if latencies is None:
            latencies = self._latencies[instance_id] = deque(maxlen=self.window)
        latencies.append(latency_s)

    def contended(self, instance_id: InstanceId) -> bool:
        return self._within_window(self._last_turned_away.get(instance_id))

    def stranding(self, instance_id: InstanceId) -> bool:
        return self._within_window(self._last_stranded.get(instance_id))

    def any_stranding(self) -> bool:
        return self._within_window(self._last_any_stranded)

    def _within_window(self, arrival_number: int | None) -> bool:
        return arrival_number is not None and self._num_arrivals - arrival_number < self.window

    def slo_span_quantile_s(self, q: float) -> float:
        """The q-quantile (nearest rank below) of recent arrivals' SLO spans; inf while
        fewer than MIN_SLO_SAMPLES were seen."""
        if len(self._slo_spans) < MIN_SLO_SAMPLES:
            return math.inf
        key = (self._num_arrivals, q)  # the spans change only with arrivals
        if self._span_quantile[0] != key:
            self._span_quantile = (key, nearest_rank_quantile(self._slo_spans, q))
        return self._span_quantile[1]

    def quantile_s(self, instance_id: InstanceId, q: float) -> float:
        """The q-quantile (nearest rank below) of recent T; inf before any admission."""
        latencies = self._latencies.get(instance_id)
        return nearest_rank_quantile(latencies, q) if latencies else math.inf


class JustEnoughPolicy(RoutingPolicy):
    """GoodServe's router: just-enough among instances that meet the deadline.

    When none can: best effort (`fallback`: the minimum T among instances where it
    harms no admitted request), or, with admission control, reject early with the
    reason. `status` and `length` learn from the substrate's
    callbacks through this policy (a watchdog sharing them must not re-forward).
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        config: JustEnoughConfig = JustEnoughConfig(),
        budgets: SlackBudgets | None = None,
        admissions: RecentAdmissions | None = None,
    ) -> None:
        self.status = status
        self.length = length
        self.config = config
        self.budgets = budgets if budgets is not None else SlackBudgets()
        self.admissions = admissions if admissions is not None else RecentAdmissions()
        self.placer = JustEnoughPlacer(status, config, self.budgets, self.admissions)
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
            chosen, candidates = self.placer.place(request, holding, view, output, now, cold)
        self.admissions.record_arrival(request, candidates, self.config.headroom)
        if chosen is not None:
            self.admissions.record(chosen.instance_id, chosen.latency_s)
            return chosen.instance_id
        if self.config.admission_control and request.has_deadline:
            fastest = min(c.latency_s for c in candidates)
            return Reject(
                f"no instance can meet the deadline: best estimate {fastest:.2f} s "
                f"for {request.deadline_s - now:.2f} s left"
            )
        return self.placer.place_best_effort(request, candidates).instance_id

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


class SloWatchdog(Watchdog):
    """Every `budget_refresh_iterations`: refresh the budgets of an instance's
    requests; every tau iterations also migrate those that would miss their deadline.

    Expected finish of an active request = now + (queue delay if still waiting) +
    re-predicted remaining tokens x d_g of its instance. A request on track gets its
    budget (slack) recomputed from its progress and re-predicted length (a budget
    fixed at admission forgets the slack a request gains by running ahead). One that
    would miss moves to the just-enough choice among *stronger* instances whose
    estimate (re-prefill of prompt + generated ids, then the remaining decode) still
    meets the deadline, at most `max_migrations_per_request` times; if it stays, it
    loses its protection (it would close the instance to requests that can make it).

    `migration_margin` moves only requests whose expected lateness exceeds that
    fraction of their time left: a move costs a re-prefill on a strong instance and
    the capacity it takes there, and many requests judged barely late still finish in
    time where they are. `migration_cost_quantile` refuses moves to a contended target
    (one that recently turned away an arrival for lack of capacity) whose T there
    (re-prefill + remaining decode) exceeds that quantile of the T of the new requests
    recently placed there (`RecentAdmissions`, shared with the policy): one saved
    request must not displace more than one typical arrival; 1 = no limit.

    The substrate calls `check` every gcd(tau, refresh) iterations; moves happen when
    the instance has done another tau iterations since the last move check; between
    them a late request only loses its budget.
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        tau_iterations: int = 50,
        max_migrations_per_request: int = 1,
        config: JustEnoughConfig = JustEnoughConfig(),
        budgets: SlackBudgets | None = None,
        migration_margin: float = DEFAULT_MIGRATION_MARGIN,
        budget_refresh_iterations: int | None = None,  # None: every tau
        admissions: RecentAdmissions | None = None,
        migration_cost_quantile: float = DEFAULT_MIGRATION_COST_QUANTILE,
    ) -> None:
        super().__init__(tau_iterations)
        refresh = tau_iterations if budget_refresh_iterations is None else (
            budget_refresh_iterations)
        if refresh < 1:
            raise ValueError(f"budget_refresh_iterations must be >= 1, got {refresh}")
        self._check_period = math.gcd(tau_iterations, refresh)
        self._move_epochs: dict[InstanceId, int] = {}  # num_iterations // tau at last move
        self.budgets = budgets if budgets is not None else SlackBudgets()
        if max_migrations_per_request < 0:
            raise ValueError("max_migrations_per_request must be >= 0")
        if migration_margin < 0:
            raise ValueError(f"migration_margin must be >= 0, got {migration_margin}")
        self.migration_margin = migration_margin
        if not 0.0 <= migration_cost_quantile <= 1.0:
            raise ValueError(
                f"migration_cost_quantile must be in [0, 1], got {migration_cost_quantile}")
        self.migration_cost_quantile = migration_cost_quantile
        self.admissions = admissions if admissions is not None else RecentAdmissions()
        self.status = status
        self.length = length
        self.max_migrations_per_request = max_migrations_per_request
        self.config = config
        self.placer = JustEnoughPlacer(status, config, self.budgets, self.admissions)
        self.needs_true_output_length = length.needs_true_output_length
        self.req_to_num_migrations: dict[str, int] = {}

    @property
    def check_period_iterations(self) -> int:
        return self._check_period

    def _crossed_tau(self, source: InstanceView) -> bool:
        """True once per tau iterations of `source` (by its iteration count, so a
        poller that sees several check periods at once still moves on time)."""
        epoch = source.num_iterations // self.tau_iterations
        if epoch <= self._move_epochs.get(source.instance_id, 0):
            return False
        self._move_epochs[source.instance_id] = epoch
        return True

    def time_left_s(self, active: ActiveRequest, estimate: InstanceEstimate, now: float) -> float:
        """Time until the deadline, less the queue delay still ahead of a waiting request."""
        waiting = 0.0 if active.is_running else estimate.queue_delay_s
        return active.request.deadline_s - now - waiting

    def check(
        self,
        instance_id: InstanceId,
        active: Sequence[ActiveRequest],
        view: ClusterView,
        now: float,
    ) -> Mapping[str, InstanceId]:
        source = view.get(instance_id)
        may_move = self._check_period == self.tau_iterations or self._crossed_tau(source)
        source_capability = capability_s_per_token(source.spec)
        stronger = [
            v for v in view.instances if capability_s_per_token(v.spec) < source_capability
        ]
        watched = [a for a in active if a.request.has_deadline]
        moves: dict[str, InstanceId] = {}
        if not watched:
            return moves
        estimate = self.status.estimate(source, now, joining=0)
        self.length.on_progress({a.request.request_id: a.num_generated_tokens for a in watched})
        totals = self.length.predict_totals(
            [a.request for a in watched], [a.num_generated_tokens for a in watched]
        )
        for item, predicted in zip(watched, totals, strict=True):
            total = bounded_output(item.request, predicted)
            rid = item.request.request_id
            remaining = max(total - item.num_generated_tokens, 1.0)
            time_left = self.time_left_s(item, estimate, now)
            late_s = remaining * estimate.decode_s_per_token - time_left
            if late_s <= 0:  # on track: what it can afford now is its budget
                self.budgets.admit(instance_id, rid, -late_s)
                continue
            target = None
            if may_move and stronger and late_s > self.migration_margin * max(time_left, 0.0):
                target = self._target(item, total, stronger, view, now)
            if target is None:
                self.budgets.remove(rid)
                continue
            moves[rid] = target
            self.req_to_num_migrations[rid] = self.req_to_num_migrations.get(rid, 0) + 1
        return moves

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.req_to_num_migrations.pop(report.request.request_id, None)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self.req_to_num_migrations.pop(request.request_id, None)

    def _target(
        self,
        item: ActiveRequest,
        total: float,
        stronger: Sequence[InstanceView],
        view: ClusterView,
        now: float,
    ) -> InstanceId | None:
        if self.req_to_num_migrations.get(item.request.request_id, 0) >= (
            self.max_migrations_per_request
        ):
            return None
        resumed = _as_resumed(item.request, item.num_generated_tokens)
        holding = [v for v in stronger if v.can_hold(resumed.num_context_tokens)]
        chosen, _ = self.placer.place(resumed, holding, view, total, now)
        if chosen is None or not self._affordable(chosen):
            return None  # the caller drops the budget place() recorded
        return chosen.instance_id

    def _affordable(self, target: Candidate) -> bool:
        """The target has capacity to spare, or the move costs it no more than its
        typical recent arrival."""
        if self.migration_cost_quantile >= 1.0 or not self.admissions.contended(
                target.instance_id):
            return True
        limit = self.admissions.quantile_s(target.instance_id, self.migration_cost_quantile)
        return target.latency_s <= limit


def _as_resumed(request: RouteRequest, num_generated: int) -> RouteRequest:
    """The request as a migration target sees it: prompt + generated ids to re-prefill."""
    return replace(request, num_generated_tokens=num_generated)


def make_goodserve(
    length: OutputLengthEstimator,
    *,
    alpha: float = 0.2,
    tau_iterations: int = 50,
    migration: bool = True,
    max_migrations_per_request: int = 1,
    migration_margin: float = DEFAULT_MIGRATION_MARGIN,
    budget_refresh_iterations: int = DEFAULT_BUDGET_REFRESH_ITERATIONS,
    migration_cost_quantile: float = DEFAULT_MIGRATION_COST_QUANTILE,
    config: JustEnoughConfig = JustEnoughConfig(),
) -> tuple[JustEnoughPolicy, SloWatchdog]:
    """Policy + watchdog sharing one status estimator, length estimator, budgets and
    record of recent admissions.

    Without migration the watchdog still runs (it keeps the budgets current) but
    never moves a request, so the ablation removes exactly the migrations.
    """
    status, budgets, admissions = StatusEstimator(alpha), SlackBudgets(), RecentAdmissions()
    policy = JustEnoughPolicy(status, length, config, budgets, admissions)
    moves = max_migrations_per_request if migration else 0
    watchdog = SloWatchdog(status, length, tau_iterations, moves, config, budgets,
                           migration_margin, budget_refresh_iterations, admissions,
                           migration_cost_quantile)
    return policy, watchdog


__all__ = [
    "DEFAULT_BUDGET_REFRESH_ITERATIONS",
    "DEFAULT_CONFIDENCE_QUANTILE",
    "DEFAULT_MIGRATION_COST_QUANTILE",
    "DEFAULT_MIGRATION_MARGIN",
    "DEFAULT_RESERVATION_QUANTILE",
    "DEFAULT_STALL_FACTOR",
    "TRAINED_PREDICTOR_STALL_FACTOR",
    "Candidate",
    "JustEnoughConfig",
    "JustEnoughPolicy",
    "JustEnoughVariant",
    "RecentAdmissions",
    "SloWatchdog",
    "capability_s_per_token",
    "estimate_latency_s",
    "make_goodserve",
    "stall_factor_for",
]
