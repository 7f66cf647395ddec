"""Scoring every instance for one request (paper Eq. 2), compiled:
T(r,g) = q_g + (L_in - H_rg) p_g + L_out_hat d_g.

An arrival reads each instance once (`InstanceScorer`: the terms of T that do not
depend on the output length, and whether taking the request harms no admitted
request); each output length it tries is then one compiled pass over the instances
that scores them and picks the just-enough one (`InstanceScorer.place`). The
fallback, the triage sink and the admission records are compiled passes over the same
columns. Ties go to the smaller instance id (`ViewArrays.id_rank`); a nan key sorts
last, as in a sort.

On a disaggregated decode instance the prefill term is the wait for the prompt's KV
(prefill elsewhere + transfer, `RouteRequest.kv_ready_s`) and no prefill compute.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from app.engines import prefix
from app.hardware.specs import InstanceSpec
from app.routing.arrays import COLUMNS, ViewArrays
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.config import JustEnoughVariant
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.status import (
    TERM_DECODE,
    TERM_PREFILL,
    WHOLE_QUEUES,
    StatusEstimator,
    num_ahead_of,
    queue_of_row,
)
from app.routing.view import ClusterView, RouteRequest

SHORT_SPAN_TOKENS = 1024  # attended span at which the unloaded per-token figures hold
_NO_AFFINITY = -1
# the view table's columns `_instance_terms` reads
_SPAN_SLOPE, _CONTEXT_SLOPE, _KV_FREE = (
    COLUMNS.index(name) for name in ("prefill_span_slope", "decode_context_slope",
                                     "kv_free_tokens"))
_NOT_COLD = np.zeros(0, dtype=np.bool_)


def capability_s_per_token(spec: InstanceSpec) -> float:
    """Unloaded decode time per token: larger = weaker. Load never changes the rank."""
    return spec.unloaded_decode_s_per_token


def kv_wait_s(request: RouteRequest, now: float) -> float:
    """Disaggregated decode: time until the prompt's KV arrives (prefill + transfer)."""
    return 0.0 if request.kv_ready_s is None else max(request.kv_ready_s - now, 0.0)


# ---- compiled passes ---------------------------------------------------------------
@njit(cache=True)
def _at_least_one(x: float) -> float:
    return x if x > 1.0 else 1.0


@njit(cache=True)
def _instance_terms(terms, num_ahead, now, hits, context, view, shortest_stall, stall_factor,
                    long_context, kv_delivered):
    """((q_g, q_g + prefill, d_g, stall charged), (KV room, harmless), uncached tokens)
    per instance, from the status estimator's `terms` and the view's table (`view`, read
    whole rather than as three strided columns). Long contexts: the uncached tokens
    attend to the hit ones and to half of their own on average, and each decode step
    reads the whole context, so both per-token figures grow past SHORT_SPAN_TOKENS
    (never below the short-span ones)."""
    n = len(terms)
    times = np.empty((4, n))  # rows: one array each to box, not four
    queue, ahead, decode_s, stall = times[0], times[1], times[2], times[3]
    flags = np.empty((2, n), dtype=np.bool_)
    room, harmless = flags[0], flags[1]
    uncached_tokens = np.empty(n, dtype=np.int64)
    for i in range(n):
        queue[i] = queue_of_row(terms, num_ahead, i, now)
        left = context - hits[i]
        uncached = left if left > 1.0 else 1.0
        p, d = terms[i, TERM_PREFILL], terms[i, TERM_DECODE]
        if long_context:
            span = hits[i] + uncached / 2
            p = p * _at_least_one(1.0 + view[i, _SPAN_SLOPE] * (span - SHORT_SPAN_TOKENS))
            d = d * _at_least_one(1.0 + view[i, _CONTEXT_SLOPE] * (context - SHORT_SPAN_TOKENS))
        prefill = 0.0 if kv_delivered else uncached * p
        ahead[i] = queue[i] + prefill
        decode_s[i] = d
        room[i] = view[i, _KV_FREE] >= left
        stall[i] = stall_factor * prefill
        uncached_tokens[i] = int(left) if left > 0.0 else 0
        harmless[i] = room[i] and stall[i] <= shortest_stall[i]
    return times, flags, uncached_tokens


@njit(cache=True)
def _before(a: float, b: float) -> bool:
    """a sorts strictly before b, nan last."""
    if a != a:
        return False
    if b != b:
        return True
    return a < b


@njit(cache=True)
def _ties(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


@njit(cache=True)
def _first(mask, primary, secondary, rank) -> int:
    """Row of the smallest (primary, secondary, id) among `mask`; -1 when none."""
    best = -1
    for i in range(len(mask)):
        if not mask[i]:
            continue
        if best < 0 or _before(primary[i], primary[best]) or (
                _ties(primary[i], primary[best]) and (
                    _before(secondary[i], secondary[best]) or (
                        _ties(secondary[i], secondary[best]) and rank[i] < rank[best]))):
            best = i
    return best


@njit(cache=True)
def _last(mask, key, rank) -> int:
    """Row of the largest (key, id) among `mask`; -1 when none."""
    best = -1
    for i in range(len(mask)):
        if mask[i] and (best < 0 or _before(key[best], key[i]) or (
                _ties(key[i], key[best]) and rank[i] > rank[best])):
            best = i
    return best


@njit(cache=True)
def _near_cache(feasible, uncached, affinity_tokens) -> None:
    """Cache affinity (project addition): keep the feasible rows whose uncached prompt
    is within `affinity_tokens` of the least uncached one. Just-enough ranks by speed
    alone, so a long context cached on one GPU would be recomputed on a weaker one that
    still meets the deadline: the recompute costs that GPU's time, and every request
    queued behind it. Short prompts are within any sensible margin."""
    least = -1
    for i in range(len(feasible)):
        if feasible[i] and (least < 0 or uncached[i] < least):
            least = uncached[i]
    for i in range(len(feasible)):
        if feasible[i] and uncached[i] > least + affinity_tokens:
            feasible[i] = False


@njit(cache=True)
def _just_enough(feasible, slack, capability, uncached, rank, least_slack,
                 affinity_tokens) -> int:
    """The feasible row the variant prefers: the weakest GPU (largest unloaded time per
    token), then the least slack; or the least slack alone."""
    if affinity_tokens >= 0:
        _near_cache(feasible, uncached, affinity_tokens)
    if least_slack:
        return _first(feasible, slack, slack, rank)
    return _first(feasible, -capability, slack, rank)


@njit(cache=True)
def _place(ahead, decode, wait, remaining, deadline, now, harmless, reserved, capability,
           uncached, rank, headroom, least_slack, affinity_tokens, contended,
           latency, slack) -> int:
    """Score every row at `remaining` output tokens into `latency` and `slack`, then
    pick: while cold (`contended` not empty), the fastest feasible row that turned no
    arrival away lately, else the just-enough row; -1 when none is feasible.

    Feasible: meets the deadline with `headroom` x T to spare, harmless, not reserved.
    The headroom applies to the new request's own estimate only: the admitted
    requests' budgets already hold the slack they had when they were placed."""
    n = len(ahead)
    feasible = np.empty(n, dtype=np.bool_)
    for i in range(n):
        latency[i] = wait + (ahead[i] + remaining * decode[i])
        slack[i] = deadline - (now + latency[i])
        feasible[i] = slack[i] >= headroom * latency[i] and harmless[i] and not reserved[i]
    if len(contended):
        spare = feasible & ~contended
        row = _first(spare, latency, latency, rank)
        if row >= 0:
            return row
    return _just_enough(feasible, slack, capability, uncached, rank, least_slack,
                        affinity_tokens)


@njit(cache=True)
def _fallback(latency, slack, floor_latency, queue, harmless, reserved, room, capability,
              uncached, rank, triage, affinity_tokens, session_home) -> int:
    """Best effort when no row meets the deadline with headroom (`Scored.fallback`)."""
    n = len(latency)
    meeting = np.empty(n, dtype=np.bool_)
    admissible = np.empty(n, dtype=np.bool_)
    for i in range(n):
        admissible[i] = harmless[i] and not reserved[i]
        meeting[i] = slack[i] >= 0.0 * latency[i] and admissible[i]
    if meeting.any():
        return _just_enough(meeting, slack, capability, uncached, rank, False,
                            affinity_tokens)
    if triage:
        hopeless = True
        for i in range(n):
            if slack[i] + latency[i] - floor_latency[i] >= 0:
                hopeless = False
                break
        if hopeless:
            pool = room & admissible
            if not pool.any():
                pool = room.copy() if room.any() else np.ones(n, dtype=np.bool_)
            return _last(pool, latency, rank)
    pool = admissible if admissible.any() else np.ones(n, dtype=np.bool_)
    if session_home:
        capable = pool & (slack + queue >= 0)
        if capable.any():
            pool = capable
    return _first(pool, latency, latency, rank)


@njit(cache=True)
def _outcome_rows(latency, slack, harmless, reserved, headroom):
    """(rows that turned the arrival away while it would have met its deadline there
    with the headroom, rows that stranded it: `RecentAdmissions.record_outcomes`)."""
    n = len(latency)
    turned_away = np.empty(n, dtype=np.int64)
    stranded = np.empty(n, dtype=np.int64)
    num_turned = num_stranded = 0
    met_harmlessly = False
    for i in range(n):
        if slack[i] >= headroom * latency[i] and not (harmless[i] and not reserved[i]):
            turned_away[num_turned] = i
            num_turned += 1
        if slack[i] >= 0.0 * latency[i]:
            if harmless[i]:
                met_harmlessly = True
            else:
                stranded[num_stranded] = i
                num_stranded += 1
    return turned_away[:num_turned], stranded[:0 if met_harmlessly else num_stranded]


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) every pass before the first request,
    for each array layout routing passes: view columns are strided, except in a
    one-instance view. The prefix directory's pass too: a decision calls it, and the
    substrate may build its directory after the placer."""
    prefix.warm_up()
    table, two = np.ones((2, 6)), np.ones(2)
    yes = np.ones(2, dtype=np.bool_)
    count, rank = np.zeros(2, dtype=np.int64), np.arange(2, dtype=np.int64)
    for column in (table[:, 0], two):  # strided, contiguous
        for contended in (yes, _NOT_COLD):
            _place(two, two, 0.0, 1.0, 1.0, 0.0, yes, ~yes, column, count, rank, 0.0, False,
                   _NO_AFFINITY, contended, np.empty(2), np.empty(2))
        _fallback(two, two, two, two, yes, ~yes, yes, column, count, rank, True, 0, True)
    for num_ahead in (WHOLE_QUEUES, two):
        _instance_terms(table, num_ahead, 0.0, count, 1, np.ones((2, len(COLUMNS))), two, 1.0,
                        True, False)
    _outcome_rows(two, two, yes, ~yes, 0.0)


# ---- the scored columns --------------------------------------------------------------
@dataclass(slots=True)
class InstanceScorer:
    """What scoring one request reads of every instance, computed once: the terms of
    T that do not depend on the output length, whether it harms no admitted request
    (KV room, and its prefill stalls the instance no more than its admitted requests
    tolerate), and which instances are reserved for tighter deadlines. Read-only once
    built (slots, not frozen: a frozen dataclass's init costs a decision microseconds)."""

    request: RouteRequest
    arrays: ViewArrays
    now: float
    wait_s: float  # until the prompt's KV arrives (disaggregated decode)
    queue_s: np.ndarray  # q_g
    ahead_s: np.ndarray  # q_g + prefill
    decode_s: np.ndarray  # d_g at the request's context
    has_memory_room: np.ndarray
    stall_s: np.ndarray  # what its prefill charges against admitted requests' slack
    shortest_stall_s: np.ndarray  # smallest stall an admitted request tolerates
    uncached_tokens: np.ndarray  # context it would prefill there (cache affinity)
    harmless: np.ndarray
    reserved: np.ndarray  # kept for tighter deadlines (`JustEnoughPlacer.reserved`)

    @classmethod
    def build(cls, request: RouteRequest, instances: tuple[InstanceView, ...] | list,
              view: ClusterView, status: StatusEstimator, now: float,
              budgets: SlackBudgets | None, stall_factor: float,
              long_context: bool = True) -> InstanceScorer:
        """`budgets` None: nothing is protected; `long_context`: the per-token
        estimates are scaled to the request's context."""
        arrays = view.arrays if instances is view.instances else ViewArrays.of(instances)
        hits = np.asarray(view.prefix_hits_of(request, arrays.ids), dtype=np.int64)
        shortest = (budgets.shortest_stalls(arrays.ids) if budgets is not None
                    else np.full(len(arrays), math.inf))
        times, flags, uncached = _instance_terms(
            status.terms(arrays), num_ahead_of(arrays, request.priority), now, hits,
            request.num_context_tokens, arrays.table, shortest, stall_factor, long_context,
            request.kv_ready_s is not None)
        queue, ahead, decode, stall = times
        room, harmless = flags
        return cls(request, arrays, now, kv_wait_s(request, now), queue, ahead, decode, room,
                   stall, shortest, uncached, harmless, np.zeros(len(arrays), dtype=np.bool_))

    @property
    def capability(self) -> np.ndarray:
        return self.arrays.column("unloaded_decode_s_per_token")

    def remaining_tokens(self, output_tokens: float) -> float:
        return max(output_tokens - self.request.num_generated_tokens, 1.0)

    def latency_s(self, output_tokens: float) -> np.ndarray:
        """T of every instance at `output_tokens`."""
        return self.wait_s + (self.ahead_s + self.remaining_tokens(output_tokens)
                              * self.decode_s)

    def place(self, output_tokens: float, variant: JustEnoughVariant, headroom: float,
              affinity_tokens: int | None, contended: np.ndarray | None = None,
              floor_output_tokens: float = 1.0) -> tuple[Candidate | None, Scored]:
        """Every instance scored at `output_tokens`, and the just-enough one (None when
        none is feasible). `headroom` keeps part of the slack in reserve: a request
        admitted with zero slack misses as soon as later arrivals slow its instance
        down. `contended` (while the length estimator is cold): each instance turned
        an arrival away lately. `floor_output_tokens`: the optimistic length the
        triage asks about (`Scored.fallback`)."""
        latency, slack = np.empty((2, len(self.arrays)))
        row = _place(self.ahead_s, self.decode_s, self.wait_s,
                     self.remaining_tokens(output_tokens), self.request.deadline_s, self.now,
                     self.harmless, self.reserved, self.capability, self.uncached_tokens,
                     self.arrays.id_rank, headroom, variant == JustEnoughVariant.LEAST_SLACK,
                     _NO_AFFINITY if affinity_tokens is None else affinity_tokens,
                     _NOT_COLD if contended is None else contended, latency, slack)
        scored = Scored(self, floor_output_tokens, latency, slack)
        return (None if row < 0 else Candidate(scored, row)), scored


@dataclass(slots=True)
class Scored:
    """Every instance scored for one request at one output length (read-only)."""

    scorer: InstanceScorer
    floor_output_tokens: float
    latency_s: np.ndarray  # T(r,g)
    slack_s: np.ndarray  # deadline - (now + T)

    def meets_deadline(self) -> bool:
        """Whether some instance may take the request and meet its deadline, with no
        headroom to spare (admission control turns away only requests none meets)."""
        s = self.scorer
        return bool(((self.slack_s >= 0.0 * self.latency_s) & s.harmless & ~s.reserved).any())

    def fastest_s(self) -> float:
        return float(self.latency_s.min())

    def fallback(self, triage: bool, affinity_tokens: int | None = None,
                 session_home: bool = False) -> Candidate:
        """Best effort when no instance meets the deadline with headroom.

        First the just-enough pick among instances that meet it with none to spare.
        Else, with `triage`, a hopeless request (late everywhere even with its
        optimistic length) goes where it takes the least from requests that can still
        meet their deadlines (project addition): the instance with the largest T,
        already the most backlogged, among those it does no harm to and with KV room.
        A burst's hopeless part piles up there instead of queueing ahead of the
        feasible requests on every instance, as min-T placement spreads it. Else the
        minimum T among the instances that can take the request without breaking an
        admitted request's budget and are not reserved (all of them when none can):
        plain min-T would herd every late request onto the fastest instance.

        `session_home` (an agent session's step): only instances that would meet the
        deadline once their queues drained, where there are any. The step's context
        stays cached where it runs, so its session's next steps are drawn there; a GPU
        too slow for the session's deadlines would hold them all late."""
        s = self.scorer
        floor = s.latency_s(self.floor_output_tokens) if triage else self.latency_s
        row = _fallback(self.latency_s, self.slack_s, floor, s.queue_s, s.harmless,
                        s.reserved, s.has_memory_room, s.capability, s.uncached_tokens,
                        s.arrays.id_rank, triage,
                        _NO_AFFINITY if affinity_tokens is None else affinity_tokens,
                        session_home)
        return Candidate(self, row)

    def outcomes(self, headroom: float) -> tuple[np.ndarray, np.ndarray]:
        """(the rows of the instances that turned the request away while it would have
        met its deadline there with `headroom`, those that stranded it: would have met
        it with no headroom but lacked capacity, memory or an admitted request's
        budget, when no instance could take it and meet it at all). Stranding asks
        whether the deadline could be met at all, so no headroom: with it, an
        overloaded pool where nothing meets with headroom would never count as
        stranding, and the reservation would switch off exactly when it is needed; a
        reservation's own refusals do not count, or it would feed itself."""
        s = self.scorer
        return _outcome_rows(self.latency_s, self.slack_s, s.harmless, s.reserved, headroom)


class Candidate:
    """One instance scored for one request: a view of one row of `Scored`."""

    __slots__ = ("scored", "row")

    def __init__(self, scored: Scored, row: int) -> None:
        self.scored = scored
        self.row = int(row)

    @property
    def instance_id(self) -> InstanceId:
        return self.scored.scorer.arrays.ids[self.row]

    @property
    def latency_s(self) -> float:
        return float(self.scored.latency_s[self.row])

    @property
    def slack_s(self) -> float:
        return float(self.scored.slack_s[self.row])

    @property
    def queue_s(self) -> float:
        return float(self.scored.scorer.queue_s[self.row])

    @property
    def uncached_tokens(self) -> int:
        return int(self.scored.scorer.uncached_tokens[self.row])

    @property
    def reserved(self) -> bool:
        return bool(self.scored.scorer.reserved[self.row])

    def __repr__(self) -> str:
        return (f"Candidate({self.instance_id!r}, latency_s={self.latency_s:.4g}, "
                f"slack_s={self.slack_s:.4g})")
