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
from dataclasses import dataclass, replace

import numpy as np

from app.routing.arrays import ViewArrays
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import JustEnoughVariant
from app.routing.goodserve.latency import SHORT_SPAN_TOKENS, Candidate, kv_wait_s
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, InstanceView, RouteRequest


@dataclass(frozen=True)
class Scored:
    """Every instance scored for one request at one output length (`Candidate`'s
    fields as columns)."""

    arrays: ViewArrays
    latency_s: np.ndarray
    slack_s: np.ndarray
    latency_floor_s: np.ndarray
    has_memory_room: np.ndarray
    stall_s: np.ndarray
    shortest_stall_s: np.ndarray
    reserved: np.ndarray
    uncached_tokens: np.ndarray

    @property
    def capability(self) -> np.ndarray:
        return self.arrays.column("unloaded_decode_s_per_token")

    def meets_deadline(self, headroom: float = 0.0) -> np.ndarray:
        return self.slack_s >= headroom * self.latency_s

    def harmless(self) -> np.ndarray:
        return self.has_memory_room & (self.stall_s <= self.shortest_stall_s)

    def admissible(self) -> np.ndarray:
        return ~self.reserved & self.harmless()

    def feasible(self, headroom: float = 0.0) -> np.ndarray:
        return self.meets_deadline(headroom) & self.admissible()

    def could_meet_deadline(self) -> np.ndarray:
        return self.slack_s + self.latency_s - self.latency_floor_s >= 0

    def candidate(self, i: int) -> Candidate:
        """Row i as the plain path's `Candidate`."""
        return Candidate(self.arrays.ids[i], float(self.latency_s[i]), float(self.slack_s[i]),
                         float(self.capability[i]), bool(self.has_memory_room[i]),
                         float(self.latency_floor_s[i]), float(self.stall_s[i]),
                         float(self.shortest_stall_s[i]), bool(self.reserved[i]),
                         int(self.uncached_tokens[i]))

    def first(self, mask: np.ndarray, *keys: np.ndarray) -> int | None:
        """Row of the smallest (keys..., id) among `mask` (the first key is primary)."""
        rows = np.flatnonzero(mask)
        if len(rows) == 0:
            return None
        order = np.lexsort((self.arrays.id_rank[rows], *(k[rows] for k in reversed(keys))))
        return int(rows[order[0]])

    def last(self, mask: np.ndarray, key: np.ndarray) -> int:
        """Row of the largest (key, id) among `mask` (not empty)."""
        rows = np.flatnonzero(mask)
        order = np.lexsort((self.arrays.id_rank[rows], key[rows]))
        return int(rows[order[-1]])


@dataclass(frozen=True)
class InstanceScorer:
    """What scoring one request reads of every instance, computed once: the terms of
    T that do not depend on the output length."""

    request: RouteRequest
    arrays: ViewArrays
    now: float
    wait_s: float  # until the prompt's KV arrives (disaggregated decode)
    ahead_s: np.ndarray  # q_g + prefill
    decode_s: np.ndarray  # d_g
    has_memory_room: np.ndarray
    stall_s: np.ndarray
    shortest_stall_s: np.ndarray
    uncached_tokens: np.ndarray

    @classmethod
    def build(cls, request: RouteRequest, instances: tuple[InstanceView, ...] | list,
              view: ClusterView, status: StatusEstimator, now: float,
              budgets: SlackBudgets | None, stall_factor: float,
              long_context: bool = True) -> InstanceScorer:
        arrays = view.arrays if instances is view.instances else ViewArrays.of(instances)
        queue, prefill_per_token, decode = status.estimate_arrays(arrays, now)
        context = request.num_context_tokens
        hits = np.asarray(view.prefix_hits_of(request, arrays.ids), dtype=np.float64)
        if long_context:  # `latency.for_context`, column by column
            span = hits + np.maximum(context - hits, 1) / 2
            prefill_per_token = prefill_per_token * np.maximum(
                1.0, 1.0 + arrays.column("prefill_span_slope") * (span - SHORT_SPAN_TOKENS))
            decode = decode * np.maximum(
                1.0, 1.0 + arrays.column("decode_context_slope") * (context - SHORT_SPAN_TOKENS))
        if request.kv_ready_s is not None:
            prefill = np.zeros(len(arrays))
        else:
            prefill = np.maximum(context - hits, 1) * prefill_per_token
        shortest = (budgets.shortest_stalls(arrays.ids) if budgets is not None
                    else np.full(len(arrays), math.inf))
        return cls(request, arrays, now, kv_wait_s(request, now), queue + prefill, decode,
                   arrays.column("kv_free_tokens") >= context - hits,
                   stall_factor * prefill, shortest,
                   np.maximum(context - hits, 0).astype(np.int64))

    def score(self, output_tokens: float, floor_output_tokens: float = 1.0) -> Scored:
        generated = self.request.num_generated_tokens
        # the association of `latency_with_prefill_s`, so the floats are the same
        latency = self.wait_s + (self.ahead_s + max(output_tokens - generated, 1.0)
                                 * self.decode_s)
        floor = self.wait_s + (self.ahead_s + max(floor_output_tokens - generated, 1.0)
                               * self.decode_s)
        return Scored(self.arrays, latency, self.request.deadline_s - (self.now + latency),
                      floor, self.has_memory_room, self.stall_s, self.shortest_stall_s,
                      np.zeros(len(self.arrays), dtype=bool), self.uncached_tokens)


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
    reserved = scored.reserved.copy()
    reserved[stranding] = True
    return replace(scored, reserved=reserved)


def pick_just_enough(scored: Scored, variant: JustEnoughVariant, headroom: float = 0.0,
                     among: np.ndarray | None = None,
                     affinity_tokens: int | None = None) -> int | None:
    """`placer.pick_just_enough` over columns (`among` narrows the rows)."""
    feasible = scored.feasible(headroom)
    if among is not None:
        feasible &= among
    if affinity_tokens is not None and feasible.any():  # `placer.near_cache`
        least = scored.uncached_tokens[feasible].min()
        feasible &= scored.uncached_tokens <= least + affinity_tokens
    if variant == JustEnoughVariant.LEAST_SLACK:
        return scored.first(feasible, scored.slack_s)
    return scored.first(feasible, -scored.capability, scored.slack_s)


def pick_while_cold(scored: Scored, variant: JustEnoughVariant, headroom: float,
                    admissions: RecentAdmissions,
                    affinity_tokens: int | None = None) -> int | None:
    """`placer.pick_while_cold` over columns."""
    spare = scored.feasible(headroom)
    for i in np.flatnonzero(spare):
        spare[i] = not admissions.contended(scored.arrays.ids[i])
    spare_row = scored.first(spare, scored.latency_s)
    if spare_row is not None:
        return spare_row
    return pick_just_enough(scored, variant, headroom, affinity_tokens=affinity_tokens)


def fallback(scored: Scored, triage: bool, affinity_tokens: int | None = None) -> int:
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
    chosen = scored.first(pool, scored.latency_s)
    assert chosen is not None
    return chosen


def triage_sink(scored: Scored) -> int:
    """`placer.triage_sink` over columns."""
    room = scored.has_memory_room
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
