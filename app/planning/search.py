"""Monotone searches shared by the stage models and the allocator."""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_POOL_SIZE = 1 << 17  # instances or devices in one pool
MAX_BATCH_SIZE = 1 << 24
MAX_ROOT_STEPS = 100


def check_rate(rate_rps: float) -> None:
    """Arrival rates must be finite and non-negative."""
    if not (rate_rps >= 0 and math.isfinite(rate_rps)):
        raise ValueError(f"arrival rate must be >= 0 and finite, got {rate_rps}")


def first_true(predicate: Callable[[int], bool], known_false: int) -> int:
    """Smallest integer > known_false where a monotone predicate holds (gallop + bisect)."""
    lo, step = known_false, 1
    hi = lo + step
    while not predicate(hi):
        lo, step = hi, step * 2
        hi = lo + step
        if hi > MAX_POOL_SIZE:
            raise ValueError(f"no pool of up to {MAX_POOL_SIZE} meets the SLOs at this rate")
    return _boundary(predicate, lo, hi)


def _boundary(predicate: Callable[[int], bool], known_false: int, known_true: int) -> int:
    """Bisection: the smallest integer in (known_false, known_true] where an
    increasing predicate holds."""
    lo, hi = known_false, known_true
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid
    return hi


def last_true(predicate: Callable[[int], bool], known_true: int, known_false: int) -> int:
    """Largest integer in [known_true, known_false) where a decreasing predicate holds."""
    return _boundary(lambda n: not predicate(n), known_true, known_false) - 1


def last_true_near(predicate: Callable[[int], bool], guess: int) -> int:
    """Largest n >= 1 where a decreasing predicate holds (0 if none), searched from a guess."""
    guess = max(1, guess)
    if predicate(guess):
        lo, step = guess, 1
        while predicate(lo + step):
            lo, step = lo + step, step * 2
            if lo > MAX_BATCH_SIZE:
                raise ValueError(f"batch size above {MAX_BATCH_SIZE}; check the parameters")
        return last_true(predicate, lo, lo + step)
    hi, step = guess, 1
    while hi - step >= 1 and not predicate(hi - step):
        hi, step = hi - step, step * 2
    lo = hi - step
    if lo < 1:
        return 0 if not predicate(1) else last_true(predicate, 1, hi)
    return last_true(predicate, lo, hi)


def illinois_root(
    f: Callable[[float], float],
    lo: float,
    f_lo: float,
    hi: float,
    f_hi: float,
    rtol: float,
    ftol: float = 0.0,
) -> float:
    """Root of f in a sign-changing bracket by regula falsi with the Illinois fix.

    Reuses the bracket's known values, so a tight bracket costs one to three calls;
    stops when the bracket is rtol-narrow or |f| <= ftol.
    """
    if f_lo * f_hi > 0:
        raise ValueError("illinois_root needs a bracket with a sign change")
    side = 0
    for _ in range(MAX_ROOT_STEPS):
        if abs(hi - lo) <= rtol * max(abs(lo), abs(hi)):
            break
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        fx = f(x)
        if abs(fx) <= ftol:
            return x
        if fx * f_hi > 0:
            hi, f_hi = x, fx
            f_lo = f_lo / 2.0 if side == -1 else f_lo
            side = -1
        else:
            lo, f_lo = x, fx
            f_hi = f_hi / 2.0 if side == 1 else f_hi
            side = 1
    return 0.5 * (lo + hi)


def max_feasible_rate(ok: Callable[[float], bool], rate_above: float, rtol: float = 1e-3) -> float:
    """Largest rate in [0, rate_above) where a decreasing predicate holds (0.0 if none).

    `rate_above` is a rate known to fail (e.g. the stability limit); it is never tried.
    """
    if not (rate_above > 0 and math.isfinite(rate_above)):
        raise ValueError(f"upper rate must be positive and finite, got {rate_above}")
    lo, hi = 0.0, rate_above
    if not ok(hi * rtol):
        return 0.0
    lo = hi * rtol
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
