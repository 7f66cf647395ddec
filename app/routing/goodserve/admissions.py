"""Recent-admission statistics: what arrivals cost each instance and whether it had
to turn any away. They are the yardstick for what a migration may take from its
target (`migration_cost_quantile`) and for when the strongest instances reserve
themselves for tight deadlines (`reservation_quantile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from app.routing.goodserve.config import GoodServeConfig
from app.routing.instance_view import InstanceId
from app.routing.quantiles import SortedWindow
from app.routing.slots import SlotsOfLastList
from app.routing.view import RouteRequest

_NEVER = -(2**62)  # the arrival number of an outcome that never happened


class RecentAdmissions:
    """What recent arrivals cost each instance and whether it had to turn any away:
    the yardstick for what a migration may take there, and for when the strongest
    instances reserve themselves.

    Per instance, the estimated latency T of the last `admissions_window` new
    requests placed on it with room to spare; and whether, within the last
    `admissions_window` arrivals, it turned
    away one that would have met its deadline there with the headroom - contended: it
    has arrivals a move could displace - and whether it turned away for lack of
    capacity (memory or an admitted request's budget) one that would have met its
    deadline there with no headroom, when no instance could take it and meet it at
    all - stranding (a reservation's own refusals do not count, or it would feed
    itself).
    Across instances, the SLO spans of the last `slo_window` arrivals.

    The arrival numbers are arrays indexed by a slot per instance (`slots_of` maps a
    list of instances to theirs once per list), so an arrival's outcomes are written
    and a whole view's contention read with one numpy step each, not a dict entry per
    instance.
    """

    def __init__(self, config: GoodServeConfig = GoodServeConfig()) -> None:
        self.window = config.admissions_window
        self.min_slo_samples = config.min_slo_samples
        self._latencies: dict[InstanceId, SortedWindow] = {}
        self._num_arrivals = 0
        self._slot: dict[InstanceId, int] = {}
        # per slot, the arrival number it last turned one away / stranded one at
        self._last_turned_away = np.full(0, _NEVER, dtype=np.int64)
        self._last_stranded = np.full(0, _NEVER, dtype=np.int64)
        self._last_any_stranded = _NEVER
        self._slo_spans = SortedWindow(config.slo_window)
        self._slots = SlotsOfLastList()

    def slots_of(self, instance_ids: Sequence[InstanceId]) -> np.ndarray:
        """Each instance's slot, new ones added; kept for the last list asked (a view's
        ids are the same tuple from one decision to the next)."""
        return self._slots.of(instance_ids, self._slot_of)

    def _slot_of(self, instance_id: InstanceId) -> int:
        slot = self._slot.get(instance_id)
        if slot is None:
            slot = self._slot[instance_id] = len(self._slot)
            if slot == len(self._last_turned_away):
                grown = np.full(max(2 * slot, 8), _NEVER, dtype=np.int64)
                self._last_turned_away = np.concatenate([self._last_turned_away, grown])
                self._last_stranded = np.concatenate([self._last_stranded, grown])
        return slot

    def record_outcomes(self, request: RouteRequest, instance_ids: Sequence[InstanceId],
                        turned_away: np.ndarray, stranded: np.ndarray) -> None:
        """A new request arrived, scored on `instance_ids`; the rows of those that
        turned it away while it would have met its deadline there with the headroom,
        and of those that stranded it."""
        self._num_arrivals += 1
        if request.has_deadline:
            self._slo_spans.append(request.slo_s)
        if len(turned_away) or len(stranded):
            slots = self.slots_of(instance_ids)
            self._last_turned_away[slots[turned_away]] = self._num_arrivals
            if len(stranded):
                self._last_stranded[slots[stranded]] = self._num_arrivals
                self._last_any_stranded = self._num_arrivals

    def record(self, instance_id: InstanceId, latency_s: float) -> None:
        """A new request was placed on `instance_id` with estimated latency T."""
        latencies = self._latencies.get(instance_id)
        if latencies is None:
            latencies = self._latencies[instance_id] = SortedWindow(self.window)
        latencies.append(latency_s)

    def contended(self, instance_id: InstanceId) -> bool:
        return self._recent(self._last_turned_away, instance_id)

    def contended_rows(self, instance_ids: Sequence[InstanceId]) -> np.ndarray:
        """`contended` of each instance, as a bool array."""
        slots = self.slots_of(instance_ids)  # first: it may grow the arrays
        return self._within_window(self._last_turned_away[slots])

    def stranding_rows(self, instance_ids: Sequence[InstanceId]) -> np.ndarray:
        """`stranding` of each instance, as a bool array."""
        slots = self.slots_of(instance_ids)  # first: it may grow the arrays
        return self._within_window(self._last_stranded[slots])

    def any_stranding(self) -> bool:
        return bool(self._within_window(self._last_any_stranded))

    def _recent(self, last: np.ndarray, instance_id: InstanceId) -> bool:
        slot = self._slot.get(instance_id)
        return slot is not None and bool(self._within_window(last[slot]))

    def _within_window(self, arrival_number: np.ndarray | int) -> np.ndarray:
        return self._num_arrivals - arrival_number < self.window

    def slo_span_quantile_s(self, q: float) -> float:
        """The q-quantile (nearest rank, `quantile_rank`) of recent arrivals' SLO spans; inf while
        fewer than `min_slo_samples` were seen."""
        if len(self._slo_spans) < self.min_slo_samples:
            return math.inf
        return self._slo_spans.quantile(q)

    def quantile_s(self, instance_id: InstanceId, q: float) -> float:
        """The q-quantile (nearest rank, `quantile_rank`) of recent T; inf before any admission."""
        latencies = self._latencies.get(instance_id)
        return latencies.quantile(q) if latencies else math.inf
