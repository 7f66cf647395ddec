"""M/G/k FCFS waiting and sojourn times: the paper's approximation and a refined one.

Both write the wait as an atom at zero plus a conditional wait V:
`P(W > t) = C(k, A) P(V > t)`, C the Erlang-C delay probability, A = lambda E[S].

- `Method.PAPER` (Kingman heavy traffic, paper Eq. 21): V ~ Exp(theta) with
  theta = 2 k (1 - rho) / (E[S] (1 + c^2)).
- `Method.REFINED` (default): V = M + R_1/k + ... + R_J/k, where M is the minimum of
  k iid equilibrium residuals R of the service time (what a waiting arrival sees
  first: the earliest of k busy servers to free up), J ~ Geometric with
  P(J = j) = (1 - rho) rho^j (the queue ahead), and R_i/k the residuals of an M/G/1
  queue with a k-times faster server. It is exact for M/M/k, exact for M/G/1
  (Pollaczek-Khinchine), exact in light traffic, and has the paper's heavy-traffic
  limit, while keeping the shape of heavy-tailed residuals instead of an exponential
  tail. It is evaluated numerically on a lattice (`lattice`); see README.md.

The sojourn time (TTFT, KV latency) is W + S with W and S independent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy import special

from app.planning.distributions import LengthDist
from app.planning.lattice import Lattice, cdf_at, geometric_sum, quantiles_from_cdf

MAX_TOP_DOUBLINGS = 40


class Method(StrEnum):
    """Which latency approximation the models use."""

    REFINED = "refined"  # default: numeric M/G/1-scaled wait (+ exact convolution)
    PAPER = "paper"  # SARA as published: exponential heavy-traffic tail, moment matching


def erlang_b(num_servers: int, offered_load: float) -> float:
    """Erlang-B blocking probability, via Poisson terms (stable for large k)."""
    if offered_load <= 0:
        return 0.0
    log_pmf = num_servers * math.log(offered_load) - offered_load
    log_pmf -= special.gammaln(num_servers + 1)
    return float(math.exp(log_pmf) / special.pdtr(num_servers, offered_load))


def erlang_c(num_servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in M/M/k (and, approximately, in M/G/k)."""
    if num_servers < 1:
        raise ValueError(f"number of servers must be >= 1, got {num_servers}")
    if offered_load < 0:
        raise ValueError(f"offered load must be >= 0, got {offered_load}")
    if offered_load >= num_servers:
        raise ValueError(f"unstable: offered load {offered_load:.4g} >= {num_servers} servers")
    blocking = erlang_b(num_servers, offered_load)
    return num_servers * blocking / (num_servers - offered_load * (1.0 - blocking))


@dataclass(frozen=True)
class MgkQueue:
    """Poisson arrivals, `num_servers` FCFS servers, iid service times (seconds)."""

    arrival_rate: float
    num_servers: int
    service: LengthDist

    def __post_init__(self) -> None:
        if not (self.arrival_rate >= 0 and math.isfinite(self.arrival_rate)):
            raise ValueError(f"arrival rate must be >= 0, got {self.arrival_rate}")
        if self.num_servers < 1:
            raise ValueError(f"number of servers must be >= 1, got {self.num_servers}")
        if self.utilization >= 1.0:
            raise ValueError(
                f"unstable queue: rho = {self.utilization:.3f} >= 1 "
                f"(rate {self.arrival_rate:.4g}/s, {self.num_servers} servers, "
                f"mean service {self.service.mean:.4g} s)"
            )

    @property
    def offered_load(self) -> float:
        return self.arrival_rate * self.service.mean

    @property
    def utilization(self) -> float:
        return self.offered_load / self.num_servers

    @property
    def wait_probability(self) -> float:
        return erlang_c(self.num_servers, self.offered_load)

    @property
    def paper_decay_rate(self) -> float:
        """Kingman heavy-traffic decay rate of P(W > t), per second."""
        k, rho, s = self.num_servers, self.utilization, self.service
        return 2.0 * k * (1.0 - rho) / (s.mean * (1.0 + s.cv**2))

    def wait_cdf(self, t: float, method: Method = Method.REFINED) -> float:
        """P(W <= t): the no-wait atom 1 - C plus C P(V <= t)."""
        if t <= 0:
            return 0.0 if t < 0 else 1.0 - self.wait_probability
        if method is Method.PAPER or self.service.is_exponential:
            return 1.0 - self.wait_probability * math.exp(-self.paper_decay_rate * t)
        lattice = Lattice.reusable(t, self._finest_scale())
        return cdf_at(lattice, lattice.cdf_from_spectrum(self._wait_spectrum(lattice, method)), t)

    def wait_cdf_many(self, t: np.ndarray, method: Method = Method.REFINED) -> np.ndarray:
        """P(W <= t) at many points from one lattice (0 below 0)."""
        t = np.asarray(t, dtype=float)
        out = np.zeros(t.shape)
        positive = t > 0
        out[t == 0] = 1.0 - self.wait_probability
        if not positive.any():
            return out
        if method is Method.PAPER or self.service.is_exponential:
            out[positive] = 1.0 - self.wait_probability * np.exp(
                -self.paper_decay_rate * t[positive])
            return out
        lattice = Lattice.reusable(float(t[positive].max()), self._finest_scale())
        cdf = lattice.cdf_from_spectrum(self._wait_spectrum(lattice, method))
        edges = np.concatenate(([0.0], lattice.upper_edges))
        atom = 1.0 - self.wait_probability
        out[positive] = np.interp(t[positive], edges, np.concatenate(([atom], cdf)))
        return out

    def sojourn_cdf(self, t: float, method: Method = Method.REFINED) -> float:
        """P(W + S <= t)."""
        if t <= 0:
            return 0.0
        if self.service.is_exponential:
            return self._mmk_sojourn_cdf(t)
        lattice = Lattice.reusable(t, self._finest_scale())
        return cdf_at(lattice, self.sojourn_cdf_on(lattice, method), t)

    def sojourn_cdf_on(self, lattice: Lattice, method: Method) -> np.ndarray:
        """P(W + S <= x) at the lattice's upper edges."""
        service = _service_spectrum(self.service, lattice)
        return lattice.cdf_from_spectrum(service * self._wait_spectrum(lattice, method))

    def sojourn_quantiles(self, probs: np.ndarray, method: Method = Method.REFINED) -> np.ndarray:
        """Quantiles of W + S; the lattice grows until it covers the largest one."""
        probs = np.asarray(probs, dtype=float)
        top = self._quantile_guess(float(np.max(probs)))
        for _ in range(MAX_TOP_DOUBLINGS):
            lattice = Lattice.covering(top, self._finest_scale())
            cdf = self.sojourn_cdf_on(lattice, method)
            if cdf[-1] >= np.max(probs):
                return quantiles_from_cdf(lattice, cdf, probs)
            top *= 2.0
        raise ValueError(f"sojourn quantile beyond {top:.4g} s; check the parameters")

    def _finest_scale(self) -> float:
        """Smallest length scale among S, R/k and min(R_1..R_k) (about E[S]/k)."""
        median = float(self.service.quantile(0.5))
        return min(median, min(self.service.mean, self.service.mean_excess) / self.num_servers)

    def _quantile_guess(self, prob: float) -> float:
        tail = math.log(max(self.wait_probability, 1e-12) / (1.0 - prob))
        return float(self.service.quantile(prob)) + max(tail, 1.0) / self.paper_decay_rate

    def _wait_spectrum(self, lattice: Lattice, method: Method) -> np.ndarray:
        if method is Method.PAPER:
            rate = self.paper_decay_rate
            conditional = lattice.spectrum(lattice.pmf(lambda x: -np.expm1(-rate * x)))
        else:
            first = _min_residual_spectrum(self.service, self.num_servers, lattice)
            rest = _residual_spectrum(self.service, self.num_servers, lattice)
            conditional = first * geometric_sum(rest, self.utilization)
        c = self.wait_probability
        return (1.0 - c) * lattice.point_mass_spectrum() + c * conditional

    def _mmk_sojourn_cdf(self, t: float) -> float:
        """Exact M/M/k sojourn CDF (paper Eq. 28); both methods coincide here."""
        nu = 1.0 / self.service.mean
        theta = self.paper_decay_rate
        c = self.wait_probability
        if abs(theta - nu) < 1e-9 * nu:
            waited = 1.0 - math.exp(-nu * t) * (1.0 + nu * t)
        else:
            waited = 1.0 - (theta * math.exp(-nu * t) - nu * math.exp(-theta * t)) / (theta - nu)
        return (1.0 - c) * (-math.expm1(-nu * t)) + c * waited


@functools.lru_cache(maxsize=512)
def _service_spectrum(service: LengthDist, lattice: Lattice) -> np.ndarray:
    """Memoised: the allocator re-evaluates one queue at many rates on shared lattices."""
    spectrum = lattice.spectrum(lattice.pmf(service.cdf))
    spectrum.flags.writeable = False
    return spectrum


@functools.lru_cache(maxsize=512)
def _residual_spectrum(service: LengthDist, num_servers: int, lattice: Lattice) -> np.ndarray:
    """Spectrum of R / k, R the equilibrium excess of the service time."""
    spectrum = lattice.spectrum(lattice.pmf(lambda x: service.excess_cdf(num_servers * x)))
    spectrum.flags.writeable = False
    return spectrum


@functools.lru_cache(maxsize=512)
def _min_residual_spectrum(service: LengthDist, num_servers: int, lattice: Lattice) -> np.ndarray:
    """Spectrum of the minimum of k iid equilibrium residuals of the service time."""
    spectrum = lattice.spectrum(
        lattice.pmf(lambda x: 1.0 - (1.0 - service.excess_cdf(x)) ** num_servers)
    )
    spectrum.flags.writeable = False
    return spectrum
