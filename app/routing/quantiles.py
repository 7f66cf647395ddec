"""Quantiles the routing code reads off recent observations."""

from __future__ import annotations

import bisect
import functools
from collections import deque
from collections.abc import Sequence

import numpy as np
from numba import njit

from predictor.ranks import quantile_rank


class SortedWindow:
    """The last `size` values, in arrival order and sorted: a quantile of a sliding
    window read at every routing decision without sorting the window each time. The
    sorted values are one numpy buffer, so compiled passes read the window as it is
    (`sorted`), with no copy. `buffer` (`size` floats, e.g. a row of a table of windows
    one compiled pass reads whole) is where they are kept; else the window's own."""

    def __init__(self, size: int, buffer: np.ndarray | None = None) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        if buffer is not None and buffer.shape != (size,):
            raise ValueError(f"a window of {size} needs a buffer of {size}, got {buffer.shape}")
        self.size = size
        self._arrivals: deque[float] = deque(maxlen=size)
        self._buffer = np.empty(size) if buffer is None else buffer
        self._count = 0
        warm_up()

    @property
    def sorted(self) -> np.ndarray:
        """The values, ascending (a view: valid until the next append)."""
        return self._buffer[:self._count]

    def append(self, value: float) -> None:
        arrivals = self._arrivals
        full = len(arrivals) == self.size
        self._count = _slide(self._buffer, self._count, arrivals[0] if full else 0.0, full,
                             value)
        arrivals.append(value)

    def quantile(self, q: float) -> float:
        """The q-quantile of the window (not empty), ranked by `quantile_rank`."""
        return float(self._buffer[quantile_rank(q, self._count)])

    def quantile_above(self, threshold: float, q: float) -> float | None:
        """The q-quantile of the values above `threshold`; None when none is."""
        start = int(np.searchsorted(self.sorted, threshold, side="right"))
        num_above = self._count - start
        return float(self._buffer[start + quantile_rank(q, num_above)]) if num_above else None

    def __len__(self) -> int:
        return self._count


@njit(cache=True)
def _slide(buffer: np.ndarray, count: int, oldest: float, full: bool, value: float) -> int:
    """The sorted `buffer[:count]` without `oldest` (its first equal, when `full`) and
    with `value` inserted after its equals, in place; the new count. Only the values
    between the two places move, not the window's tail twice."""
    at = np.searchsorted(buffer[:count], value, side="right")
    if not full:
        for i in range(count, at, -1):
            buffer[i] = buffer[i - 1]
        buffer[at] = value
        return count + 1
    out = np.searchsorted(buffer[:count], oldest)
    if at > out:  # the values between move down into the hole
        for i in range(out, at - 1):
            buffer[i] = buffer[i + 1]
        buffer[at - 1] = value
    else:  # they move up over it
        for i in range(out, at, -1):
            buffer[i] = buffer[i - 1]
        buffer[at] = value
    return count


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the window's pass before it is needed,
    once per process."""
    _slide(np.zeros(2), 1, 0.0, True, 0.0)
    quantile_rank(0.5, 1)


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
