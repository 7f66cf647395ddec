"""Just-enough placement over columns: `score_instances` and the placer's picks as
numpy operations on every instance at once, with no object per instance.

The rules are `latency.py`'s and `placer.py`'s, figure for figure and tie for tie (ties
go to the smaller instance id, as `min(..., id)` does there); a property test on random
views holds the two paths to the same decisions. An arrival scores each instance once
(`InstanceScorer`) and re-evaluates only the output-dependent terms for each length it
tries (point estimate, confident length, cap while cold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from app.routing.arrays import ViewArrays
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import JustEnoughVariant
from app.routing.goodserve.latency import SHORT_SPAN_TOKENS, Candidate, kv_wait_s
from app.routing.instance_view import InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest


@dataclass(frozen=True)
class Scored:
    """Every instance scored for one request at one output length (`Candidate`'s
    fields as columns). The masks are computed once each and kept: a placement and
    its record read them several times."""

    scorer: InstanceScorer
    floor_output_tokens: float
    latency_s: np.ndarray
    slack_s: np.ndarray
    reserved: np.ndarray | None = None  # None: no instance reserved
    _masks: dict[tuple[str, float], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def arrays(self) -> ViewArrays:
        return self.scorer.arrays

    @property
    def capability(self) -> np.ndarray:
        return self.arrays.column("unloaded_decode_s_per_token")

    @cached_property
    def latency_floor_s(self) -> np.ndarray:
        return self.scorer.latency_s(self.floor_output_tokens)

    def meets_deadline(self, headroom: float = 0.0) -> np.ndarray:
        mask = self._masks.get(("meets", headroom))
        if mask is None:
            mask = self._masks["meets", headroom] = self.slack_s >= headroom * self.latency_s
        return mask

    def harmless(self) -> np.ndarray:
        return self.scorer.harmless

    @cached_property
    def _admissible(self) -> np.ndarray:
        harmless = self.scorer.harmless
        return harmless if self.reserved is None else ~self.reserved & harmless

    def admissible(self) -> np.ndarray:
        return self._admissible

    def feasible(self, headroom: float = 0.0) -> np.ndarray:
        mask = self._masks.get(("feasible", headroom))
        if mask is None:
            mask = self._masks["feasible", headroom] = (self.meets_deadline(headroom)
                                                        & self._admissible)
        return mask

    def could_meet_deadline(self) -> np.ndarray:
        return self.slack_s + self.latency_s - self.latency_floor_s >= 0

    def capable(self) -> np.ndarray:
        return self.slack_s + self.scorer.queue_s >= 0

    def candidate(self, i: int) -> Candidate:
        """Row i as the plain path's `Candidate`."""
        scorer = self.scorer
        return Candidate(self.arrays.ids[i], float(self.latency_s[i]), float(self.slack_s[i]),
                         float(self.capability[i]), bool(scorer.has_memory_room[i]),
                         float(self.latency_floor_s[i]), float(scorer.stall_s[i]),
                         float(scorer.shortest_stall_s[i]),
                         self.reserved is not None and bool(self.reserved[i]),
                         int(scorer.uncached_tokens[i]), float(scorer.queue_s[i]))

    def first(self, mask: np.ndarray, *keys: np.ndarray) -> int | None:
        """Row of the smallest (keys..., id) among `mask` (the first key is primary):
        the rows tied at each key's least value narrow down key by key, cheaper than
        sorting them. A nan key is largest, as in a sort (`fmin` skips it)."""
        rows = np.flatnonzero(mask)
        for key in keys:
            if len(rows) <= 1:
                break
            values = key[rows]
            least = np.fmin.reduce(values)
            if least == least:  # not every value is nan
                rows = rows[values == least]
        if len(rows) <= 1:
            return int(rows[0]) if len(rows) else None
        return int(rows[np.argmin(self.arrays.id_rank[rows])])

    def last(self, mask: np.ndarray, key: np.ndarray) -> int:
        """Row of the largest (key, id) among `mask` (not empty)."""
        rows = np.flatnonzero(mask)
        order = np.lexsort((self.arrays.id_rank[rows], key[rows]))
        return int(rows[order[-1]])


@dataclass(frozen=True)
class InstanceScorer:
    """What scoring one request reads of every instance, computed once: the terms of
    T that do not depend on the output length, and whether taking the request harms
    no admitted request (`Candidate.harmless`)."""

    request: RouteRequest
    arrays: ViewArrays
    now: float
    wait_s: float  # until the prompt's KV arrives (disaggregated decode)
    queue_s: np.ndarray  # q_g
    ahead_s: np.ndarray  # q_g + prefill
    decode_s: np.ndarray  # d_g
    has_memory_room: np.ndarray
    stall_s: np.ndarray
    shortest_stall_s: np.ndarray
    uncached_tokens: np.ndarray
    harmless: np.ndarray

    @classmethod
    def build(cls, request: RouteRequest, instances: tuple[InstanceView, ...] | list,
              view: ClusterView, status: StatusEstimator, now: float,
              budgets: SlackBudgets | None, stall_factor: float,
              long_context: bool = True) -> InstanceScorer:
        arrays = view.arrays if instances is view.instances else ViewArrays.of(instances)
        queue, prefill_per_token, decode = status.estimate_arrays(arrays, now,
                                                                  priority=request.priority)
        context = request.num_context_tokens
        hits = np.asarray(view.prefix_hits_of(request, arrays.ids), dtype=np.float64)
        uncached = np.maximum(context - hits, 1)
        if long_context:  # `latency.for_context`, column by column
            span = hits + uncached / 2
            prefill_per_token = prefill_per_token * np.maximum(
                1.0, 1.0 + arrays.column("prefill_span_slope") * (span - SHORT_SPAN_TOKENS))
            decode = decode * np.maximum(
                1.0, 1.0 + arrays.column("decode_context_slope") * (context - SHORT_SPAN_TOKENS))
        if request.kv_ready_s is not None:
            prefill = np.zeros(len(arrays))
        else:
            prefill = uncached * prefill_per_token
        shortest = (budgets.shortest_stalls(arrays.ids) if budgets is not None
                    else np.full(len(arrays), math.inf))
        room = arrays.column("kv_free_tokens") >= context - hits
        stall = stall_factor * prefill
        return cls(request, arrays, now, kv_wait_s(request, now), queue, queue + prefill, decode,
                   room, stall, shortest, np.maximum(context - hits, 0).astype(np.int64),
                   room & (stall <= shortest))

    def latency_s(self, output_tokens: float) -> np.ndarray:
        """T at `output_tokens` (the association of `latency_with_prefill_s`, so the
        floats are the same)."""
        generated = self.request.num_generated_tokens
        return self.wait_s + (self.ahead_s + max(output_tokens - generated, 1.0)
                              * self.decode_s)

    def score(self, output_tokens: float, floor_output_tokens: float = 1.0) -> Scored:
        latency = self.latency_s(output_tokens)
        return Scored(self, floor_output_tokens, latency,
                      self.request.deadline_s - (self.now + latency))


def reserve_strongest(request: RouteRequest, scored: Scored, view: ClusterView,
                      admissions: RecentAdmissions, quantile: float) -> Scored:
    """`placer.reserve_strongest` over columns."""
    if quantile >= 1.0 or len(scored.arrays) == 0 or not admissions.any_stranding():
        return scored
    strongest = view.arrays.column("unloaded_decode_s_per_token").min()
    rows = np.flatnonzero(scored.capability == strongest)
    stranding = [i for i in rows if admissions.stranding(scored.arrays.ids[i])]
    if not stranding or not request.slo_s > admissions.slo_span_quantile_s(quantile):
        return scored
    reserved = np.zeros(len(scored.arrays), dtype=bool)
    reserved[stranding] = True
    return replace(scored, reserved=reserved)


def pick_just_enough(scored: Scored, variant: JustEnoughVariant, headroom: float = 0.0,
                     among: np.ndarray | None = None,
                     affinity_tokens: int | None = None) -> int | None:
    """`placer.pick_just_enough` over columns (`among` narrows the rows)."""
    feasible = scored.feasible(headroom)  # kept by `scored`: narrowed into a new mask
    if among is not None:
        feasible = feasible & among
    if affinity_tokens is not None and feasible.any():  # `placer.near_cache`
        uncached = scored.scorer.uncached_tokens
        feasible = feasible & (uncached <= uncached[feasible].min() + affinity_tokens)
    if variant == JustEnoughVariant.LEAST_SLACK:
        return scored.first(feasible, scored.slack_s)
    return scored.first(feasible, -scored.capability, scored.slack_s)


def pick_while_cold(scored: Scored, variant: JustEnoughVariant, headroom: float,
                    admissions: RecentAdmissions,
                    affinity_tokens: int | None = None) -> int | None:
    """`placer.pick_while_cold` over columns."""
    spare = scored.feasible(headroom).copy()
    for i in np.flatnonzero(spare):
        spare[i] = not admissions.contended(scored.arrays.ids[i])
    spare_row = scored.first(spare, scored.latency_s)
    if spare_row is not None:
        return spare_row
    return pick_just_enough(scored, variant, headroom, affinity_tokens=affinity_tokens)


def fallback(scored: Scored, triage: bool, affinity_tokens: int | None = None,
             session_home: bool = False) -> int:
    """`placer.fallback` over columns."""
    meeting = scored.feasible(0.0)
    if meeting.any():
        chosen = pick_just_enough(scored, JustEnoughVariant.WEAKEST, 0.0, among=meeting,
                                  affinity_tokens=affinity_tokens)
        assert chosen is not None
        return chosen
    if triage and not scored.could_meet_deadline().any():
        return triage_sink(scored)
    admissible = scored.admissible()
    pool = admissible if admissible.any() else np.ones(len(admissible), dtype=bool)
    if session_home:
        capable = pool & scored.capable()
        pool = capable if capable.any() else pool
    chosen = scored.first(pool, scored.latency_s)
    assert chosen is not None
    return chosen


def triage_sink(scored: Scored) -> int:
    """`placer.triage_sink` over columns."""
    room = scored.scorer.has_memory_room
    admissible_room = room & scored.admissible()
    pool = (admissible_room if admissible_room.any()
            else room if room.any() else np.ones(len(room), dtype=bool))
    return scored.last(pool, scored.latency_s)


def record_arrival(admissions: RecentAdmissions, request: RouteRequest, scored: Scored,
                   headroom: float) -> None:
    """`RecentAdmissions.record_arrival` from columns."""
    ids = scored.arrays.ids
    turned_away = scored.meets_deadline(headroom) & ~scored.admissible()
    met, harmless = scored.meets_deadline(), scored.harmless()
    stranded = [] if (met & harmless).any() else np.flatnonzero(met & ~harmless)
    admissions.record_outcomes(request, [ids[i] for i in np.flatnonzero(turned_away)],
                               [ids[i] for i in stranded])
