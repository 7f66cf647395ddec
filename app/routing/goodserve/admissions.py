"""Recent-admission statistics: what arrivals cost each instance and whether it had
to turn any away. They are the yardstick for what a migration may take from its
target (`migration_cost_quantile`) and for when the strongest instances reserve
themselves for tight deadlines (`reservation_quantile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from app.routing.goodserve.config import GoodServeConfig
from app.routing.instance_view import InstanceId
from app.routing.quantiles import SortedWindow
from app.routing.view import RouteRequest


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
    """

    def __init__(self, config: GoodServeConfig = GoodServeConfig()) -> None:
        self.window = config.admissions_window
        self.min_slo_samples = config.min_slo_samples
        self._latencies: dict[InstanceId, SortedWindow] = {}
        self._num_arrivals = 0
        self._last_turned_away: dict[InstanceId, int] = {}  # arrival number
        self._last_stranded: dict[InstanceId, int] = {}  # arrival number
        self._last_any_stranded: int | None = None
        self._slo_spans = SortedWindow(config.slo_window)

    def record_outcomes(self, request: RouteRequest, turned_away: Sequence[InstanceId],
                        stranded: Sequence[InstanceId]) -> None:
        """A new request arrived; the instances that turned it away while it would have
        met its deadline there with the headroom, and those that stranded it."""
        self._num_arrivals += 1
        if request.has_deadline:
            self._slo_spans.append(request.slo_s)
        for instance_id in turned_away:
            self._last_turned_away[instance_id] = self._num_arrivals
        for instance_id in stranded:
            self._last_stranded[instance_id] = self._num_arrivals
            self._last_any_stranded = self._num_arrivals

    def record(self, instance_id: InstanceId, latency_s: float) -> None:
        """A new request was placed on `instance_id` with estimated latency T."""
        latencies = self._latencies.get(instance_id)
        if latencies is None:
            latencies = self._latencies[instance_id] = SortedWindow(self.window)
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
        """The q-quantile (nearest rank, `quantile_rank`) of recent arrivals' SLO spans; inf while
        fewer than `min_slo_samples` were seen."""
        if len(self._slo_spans) < self.min_slo_samples:
            return math.inf
        return self._slo_spans.quantile(q)

    def quantile_s(self, instance_id: InstanceId, q: float) -> float:
        """The q-quantile (nearest rank, `quantile_rank`) of recent T; inf before any admission."""
        latencies = self._latencies.get(instance_id)
        return latencies.quantile(q) if latencies else math.inf
