"""Length distributions of SARA: exponential (light tail) and log-normal (heavy tail).

Token counts are modelled as continuous positive variables (paper, footnote 4).
Service times are proportional to lengths (prefill `alpha_p * L_i`, KV transfer
`g gamma L_i / B`), so the same class also describes service times via `scaled`.
Everything the queue models need is here in closed form: CDF, survival function,
the equilibrium-excess (residual) CDF, moments, quantiles and seeded sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy import special

# |cv - 1| below this counts as exponential when fitting observed moments
EXPONENTIAL_CV_TOLERANCE = 0.05


class TailKind(StrEnum):
    EXPONENTIAL = "exponential"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class LengthDist:
    """A positive random variable given by its mean, CV and tail family."""

    mean: float
    cv: float = 1.0
    kind: TailKind = TailKind.EXPONENTIAL

    def __post_init__(self) -> None:
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"mean must be positive and finite, got {self.mean}")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"coefficient of variation must be positive, got {self.cv}")
        if self.kind is TailKind.EXPONENTIAL and self.cv != 1.0:
            raise ValueError(f"an exponential distribution has cv 1, got {self.cv}")

    @classmethod
    def exponential(cls, mean: float) -> LengthDist:
        return cls(mean, 1.0, TailKind.EXPONENTIAL)

    @classmethod
    def lognormal(cls, mean: float, cv: float) -> LengthDist:
        return cls(mean, cv, TailKind.LOGNORMAL)

    @classmethod
    def from_moments(cls, mean: float, cv: float) -> LengthDist:
        """Observed moments -> exponential when cv is ~1, else log-normal (paper Sec. III)."""
        if abs(cv - 1.0) < EXPONENTIAL_CV_TOLERANCE:
            return cls.exponential(mean)
        return cls.lognormal(mean, cv)

    @property
    def is_exponential(self) -> bool:
        return self.kind is TailKind.EXPONENTIAL

    @property
    def sigma(self) -> float:
        """Log-normal shape: sigma^2 = ln(1 + cv^2)."""
        return math.sqrt(math.log1p(self.cv * self.cv))

    @property
    def mu(self) -> float:
        return math.log(self.mean) - 0.5 * self.sigma**2

    @property
    def variance(self) -> float:
        return (self.cv * self.mean) ** 2

    @property
    def second_moment(self) -> float:
        return self.variance + self.mean**2

    @property
    def mean_excess(self) -> float:
        """E[R] = E[X^2] / (2 E[X]) for the equilibrium excess R of X."""
        return self.second_moment / (2.0 * self.mean)

    def scaled(self, factor: float) -> LengthDist:
        """The distribution of factor * X (service time from a length)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be positive, got {factor}")
        return LengthDist(self.mean * factor, self.cv, self.kind)

    def _z(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return (np.log(np.maximum(x, 1e-300)) - self.mu) / self.sigma

    def cdf(self, x: np.ndarray | float) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        if self.is_exponential:
            return -np.expm1(-np.maximum(x, 0.0) / self.mean)
        return np.where(x > 0, special.ndtr(self._z(x)), 0.0)

    def excess_cdf(self, x: np.ndarray | float) -> np.ndarray:
        """CDF of the equilibrium excess: int_0^x P(X > u) du / E[X]."""
        x = np.asarray(x, dtype=float)
        if self.is_exponential:
            return self.cdf(x)
        z = self._z(x)
        # int_0^x sf = x P(X > x) + E[X; X <= x], and E[X; X <= x] = m Phi(z - sigma)
        partial = x * special.ndtr(-z) + self.mean * special.ndtr(z - self.sigma)
        return np.where(x > 0, np.minimum(partial / self.mean, 1.0), 0.0)

    def quantile(self, p: np.ndarray | float) -> np.ndarray:
        p = np.asarray(p, dtype=float)
        if self.is_exponential:
            return -self.mean * np.log1p(-p)
        return np.exp(self.mu + self.sigma * special.ndtri(p))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.is_exponential:
            return rng.exponential(self.mean, size)
        return rng.lognormal(self.mu, self.sigma, size)
