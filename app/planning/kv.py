"""KV-cache transfer stage: an M/G/1 queue on a link of bandwidth B (bytes/s).

Service time is g gamma L_i / B. Stability needs B > lambda g gamma l_i.

- `Method.PAPER`: the sojourn time is taken as exponential with the heavy-traffic
  decay rate theta = 2 (1 - rho) / (E[S] (1 + c^2)); this is exact for exponential
  L_i (M/M/1) and gives the paper's closed form (Eqs. 33/35)
  `B_min = lambda g gamma l_i + g gamma l_i (1 + c^2) ln(1 / (1 - p)) / (2 tau)`.
- `Method.REFINED`: the exact M/G/1 sojourn (Pollaczek-Khinchine wait + service),
  evaluated numerically; the minimum B solves P(T_KV <= tau) = p by root finding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.planning.distributions import LengthDist
from app.planning.params import ModelParams
from app.planning.queues import Method, MgkQueue
from app.planning.search import check_rate, illinois_root

RHO_TOL = 1e-6  # utilizations this close to 1 count as 1
RHO_RTOL = 1e-4  # relative precision of the solved utilization
SLACK_TOL = 1e-4  # ... or P(T_KV <= tau) within this share of 1 - p of the target


@dataclass(frozen=True)
class KvSizing:
    """Minimum link bandwidth for one arrival rate."""

    bandwidth_bytes_per_s: float  # B
    binding: str  # "kv_slo" (the SLO always needs more than the stability floor)
    utilization: float  # rho_KV

    @property
    def bandwidth_gbps(self) -> float:
        return self.bandwidth_bytes_per_s / 1e9


@dataclass(frozen=True)
class KvStage:
    """One KV link between the prefill and decode pools."""

    model: ModelParams
    input_len: LengthDist

    @property
    def transfer_bytes(self) -> LengthDist:
        return self.input_len.scaled(self.model.kv_bytes_per_token)

    def queue(self, rate_rps: float, bandwidth_bytes_per_s: float) -> MgkQueue:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
        return MgkQueue(rate_rps, 1, self.transfer_bytes.scaled(1.0 / bandwidth_bytes_per_s))

    def stability_floor(self, rate_rps: float) -> float:
        """B must exceed lambda g gamma l_i (bytes/s)."""
        check_rate(rate_rps)
        return rate_rps * self.transfer_bytes.mean

    def latency_cdf(
        self, rate_rps: float, bandwidth: float, t_s: float, method: Method = Method.REFINED
    ) -> float:
        queue = self.queue(rate_rps, bandwidth)
        if method is Method.PAPER:
            return float(-math.expm1(-queue.paper_decay_rate * max(t_s, 0.0)))
        return queue.sojourn_cdf(t_s, method)

    def latency_quantiles(
        self, rate_rps: float, bandwidth: float, probs: np.ndarray, method: Method = Method.REFINED
    ) -> np.ndarray:
        queue = self.queue(rate_rps, bandwidth)
        if method is Method.PAPER:
            return -np.log1p(-np.asarray(probs, dtype=float)) / queue.paper_decay_rate
        return queue.sojourn_quantiles(probs, method)

    def min_bandwidth(
        self,
        rate_rps: float,
        kv_s: float,
        p_slo: float,
        method: Method = Method.REFINED,
        rho_guess: float | None = None,
    ) -> KvSizing:
        """Smallest B with P(T_KV <= kv_s) >= p_slo.

        `rho_guess` (e.g. interpolated from earlier rates) seeds the refined root search;
        the paper's closed form is used otherwise.
        """
        floor = self.stability_floor(rate_rps)
        m, c = self.transfer_bytes.mean, self.transfer_bytes.cv
        paper = floor + m * (1.0 + c * c) * math.log(1.0 / (1.0 - p_slo)) / (2.0 * kv_s)
        if method is Method.PAPER:
            bandwidth = paper
        elif rate_rps == 0:
            bandwidth = float(self.transfer_bytes.quantile(p_slo)) / kv_s
        else:
            guess = rho_guess if rho_guess is not None else floor / paper
            bandwidth = floor / self._max_utilization(rate_rps * kv_s, p_slo, guess)
        return KvSizing(bandwidth, "kv_slo", floor / bandwidth)

    def _max_utilization(self, arrivals_in_slo: float, p_slo: float, guess: float) -> float:
        """Largest rho with P(T_KV <= tau) >= p_slo, in units of E[S] = rho / lambda.

        The answer depends on lambda and tau only through lambda * tau. Steps away from
        the guess grow fourfold until the slack changes sign, then regula falsi.
        """
        unit = LengthDist(1.0, self.transfer_bytes.cv, self.transfer_bytes.kind)

        def slack(rho: float) -> float:
            return MgkQueue(rho, 1, unit).sojourn_cdf(arrivals_in_slo / rho) - p_slo

        x0 = min(max(guess, RHO_TOL), 1.0 - RHO_TOL)
        f0 = slack(x0)
        ftol = SLACK_TOL * (1.0 - p_slo)
        if abs(f0) <= ftol:
            return x0
        upward = f0 >= 0
        step = 4.0 * RHO_RTOL * x0
        while True:
            x1 = min(x0 + step, 1.0 - RHO_TOL) if upward else x0 * max(1.0 - step / x0, 0.5)
            f1 = slack(x1)
            if (f1 >= 0) != upward:
                return illinois_root(slack, x0, f0, x1, f1, RHO_RTOL, ftol)
            if x1 >= 1.0 - RHO_TOL:
                return x1
            x0, f0, step = x1, f1, 4.0 * step
