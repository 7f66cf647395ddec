"""The one rank rule for a quantile of recent observations, shared by the history
predictors here and the router's sliding windows (app/routing/quantiles.py).

Compiled (numba, as the router's other passes), so that compiled passes use the same
rule as the Python callers.
"""

from __future__ import annotations

import math

from numba import njit

__all__ = ["quantile_rank"]


@njit(cache=True)
def quantile_rank(q: float, n: int) -> int:
    """The 0-based index of the `q`-quantile among `n` sorted values (n >= 1).

    Nearest rank on the empirical distribution (numpy's method="inverted_cdf"): the
    smallest value with at least a fraction `q` of the values at or below it. Why this
    rule: a confident length is "a total the request stays within with probability
    q", which is exactly that, where rounding the rank down (index q * (n - 1)) can
    give less (10 values, q = 0.95: the 9th, which only 90% stay within); the answer
    is always an observed value, so the median of bimodal lengths is a length of one
    mode, not one in the gap between them that linear interpolation (numpy's default)
    would give; and it is one index into a sorted window.
    """
    if n < 1:
        raise ValueError("a quantile needs at least one value")
    return min(max(math.ceil(q * n) - 1, 0), n - 1)
