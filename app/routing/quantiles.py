"""Quantiles the routing code reads off recent observations."""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence


def nearest_rank_quantile(values: Collection[float], q: float) -> float:
    """The q-quantile of `values` at the nearest rank below (one of the values)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def kaplan_meier_quantile(
    finished: Sequence[int], censored: Sequence[int], quantile: float
) -> float | None:
    """The `quantile` of a length distribution seen as `finished` lengths and
    `censored` lower bounds (requests still running), by the Kaplan-Meier estimate;
    both sorted ascending. None when the finished lengths do not reach it: the
    censored tail keeps the survival above 1 - quantile."""
    at_risk = len(finished) + len(censored)
    survival, cut, i = 1.0, 0, 0
    while i < len(finished):
        length = finished[i]
        while cut < len(censored) and censored[cut] < length:  # left the risk set
            cut += 1
            at_risk -= 1
        ended = bisect.bisect_right(finished, length, lo=i) - i
        survival *= 1.0 - ended / at_risk
        at_risk -= ended
        i += ended
        if survival <= 1.0 - quantile:
            return float(length)
    return None
