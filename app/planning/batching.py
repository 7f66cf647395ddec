"""Decode batch occupancy: how many requests share an iteration at a given rate.

Per iteration each request leaves with probability p0 and lambda T_d new ones arrive,
where T_d = a + b L_io grows with the batch. Linearised around the mean
mu = lambda a / kappa, kappa = p0 - lambda b m_X (the "linear noise" approximation):

    Var(n) = mu p0 (2 - p0) / (kappa (2 - kappa))                   # birth-death noise
           + (lambda b)^2 mu v_X (1 + ab) / ((1 - a^2)(1 - ab))      # context-sum noise
    with a = 1 - kappa, b = 1 - p0 (two AR(1) processes).

The feedback (longer iterations admit more requests) makes n over-dispersed, so the
refined model uses a negative binomial with these two moments; the paper's C4 uses a
Poisson (sigma_bat = sqrt(mu_bat)). Occupancies above N_bat are clipped to N_bat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

TAIL_SDS = 40.0  # without a limit, admission pmfs reach mean + this many sds


@dataclass(frozen=True)
class OccupancyModel:
    """Per-iteration batch occupancy before the N_bat cap."""

    mean: float
    variance: float
    iteration_fixed_s: float  # mean T_d with n requests is fixed + per_request * n
    iteration_per_request_s: float

    def pmf(self, max_n: int) -> np.ndarray:
        """P(n) for n = 0..max_n; mass beyond max_n is dropped (caller clips)."""
        sizes = np.arange(max_n + 1)
        if self.variance <= self.mean * (1.0 + 1e-9):
            return stats.poisson.pmf(sizes, self.mean)
        p = self.mean / self.variance
        r = self.mean * p / (1.0 - p)
        return stats.nbinom.pmf(sizes, r, p)

    def clipped_pmf(self, batch_size: int) -> np.ndarray:
        """Occupancy of a batch capped at N_bat: the tail's mass sits on N_bat."""
        pmf = self.pmf(batch_size)
        pmf[batch_size] += max(0.0, 1.0 - pmf.sum())
        return pmf

    def min_batch_for_admission(self, p_join: float, limit: int | None = None) -> int:
        """Smallest N with P(an arrival finds N or more) <= 1 - p_join; limit + 1 if above.

        Arrivals see time averages (PASTA), so per-iteration probabilities are weighted
        by the iteration length fixed + per_request * n, whose mean is known in closed
        form; the pmf is only needed up to `limit` (callers pass the C1/C2 cap).
        """
        if limit is None:
            limit = math.ceil(self.mean + TAIL_SDS * math.sqrt(self.variance)) + 1
        lengths = self.iteration_fixed_s + self.iteration_per_request_s * np.arange(limit + 1)
        total = self.iteration_fixed_s + self.iteration_per_request_s * self.mean
        below = np.cumsum(self.pmf(limit) * lengths) / total  # below[N - 1] = P_time(n < N)
        ok = np.flatnonzero(1.0 - below <= 1.0 - p_join)
        return max(1, int(ok[0]) + 1) if ok.size else limit + 1

    def normal_min_batch(self, p_join: float) -> int:
        """The paper's C4: mu_bat + z(p_join) sigma_bat <= N_bat, sigma_bat = sqrt(mu_bat)."""
        return max(1, math.ceil(self.mean + special.ndtri(p_join) * math.sqrt(self.mean)))


def occupancy_model(
    rate_rps: float,
    p0: float,
    fixed_s: float,
    per_token_s: float,
    context_mean: float,
    context_variance: float,
    poisson: bool,
) -> OccupancyModel | None:
    """The occupancy at `rate_rps` for T_d = fixed_s + per_token_s L_io; None if unstable."""
    kappa = p0 - rate_rps * per_token_s * context_mean
    if kappa <= 0:
        return None
    mean = rate_rps * fixed_s / kappa
    variance = mean
    if not poisson and mean > 0:
        a, b = 1.0 - kappa, 1.0 - p0
        birth_death = mean * p0 * (2.0 - p0) / (kappa * (2.0 - kappa))
        drive = (rate_rps * per_token_s) ** 2 * mean * context_variance
        contexts = drive * (1.0 + a * b) / ((1.0 - a * a) * (1.0 - a * b))
        variance = birth_death + contexts
    return OccupancyModel(mean, variance, fixed_s, per_token_s * context_mean)
