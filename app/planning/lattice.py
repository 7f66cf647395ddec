"""Numeric distributions on a uniform lattice, combined with damped FFTs.

The refined latency models need convolutions (wait + service), geometric
sums (Pollaczek-Khinchine) and convolution powers (batch context sums). All three
are products in the Fourier domain. Two details make this accurate and cheap:

- *Nearest-point rounding*: the mass of [x_j - h/2, x_j + h/2) goes to x_j = j h,
  so rounding errors of summed variables average out instead of accumulating.
- *Exponential damping*: pmfs are multiplied by exp(-a j) before the FFT and divided
  after, which suppresses circular wrap-around by exp(-2 a n) = exp(-40). Mass beyond
  the lattice top is dropped, which is exact for the CDF below the top: a sum of
  positive terms is <= x only if every term is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DAMPING_PER_LATTICE = 20.0  # a * n; the wrap-around is suppressed by exp(-2 * this)
MIN_SIZE = 4096
MAX_SIZE = 1 << 16
POINTS_PER_SCALE = 16  # lattice points per finest length scale of the summands
GRID_STEPS_PER_OCTAVE = 4  # reusable lattices: tops and scales on a 2^(1/4) grid


@dataclass(frozen=True)
class Lattice:
    """Points x_j = j * step, j < size; the CDF is read at the upper cell edges."""

    step: float
    size: int

    @classmethod
    def covering(cls, top: float, finest_scale: float, max_size: int = MAX_SIZE) -> Lattice:
        """A lattice whose last upper edge is `top`, resolving `finest_scale`."""
        if not (top > 0 and finest_scale > 0):
            raise ValueError(f"lattice needs positive top and scale, got {top}, {finest_scale}")
        wanted = max(POINTS_PER_SCALE * top / finest_scale, 1.0)
        size = int(min(max_size, max(MIN_SIZE, 1 << int(np.ceil(np.log2(wanted))))))
        return cls(top / (size - 0.5), size)

    @classmethod
    def reusable(cls, top: float, finest_scale: float) -> Lattice:
        """A lattice reaching at least `top`, from a coarse geometric grid of tops and
        scales, so that nearby queries share lattices (and cached spectra)."""
        return cls.covering(_round_up(top), 1.0 / _round_up(1.0 / finest_scale))

    @property
    def upper_edges(self) -> np.ndarray:
        return (np.arange(self.size) + 0.5) * self.step

    def pmf(self, cdf: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Round a distribution given by its CDF to the nearest lattice point."""
        edges = (np.arange(self.size + 1) - 0.5) * self.step
        edges[0] = 0.0
        values = cdf(edges)
        pmf = np.diff(values)
        pmf[0] += values[0]  # an atom at zero lands on x_0
        return pmf

    def _damping(self) -> np.ndarray:
        return np.exp(-(DAMPING_PER_LATTICE / self.size) * np.arange(self.size))

    def spectrum(self, pmf: np.ndarray) -> np.ndarray:
        return np.fft.rfft(pmf * self._damping(), 2 * self.size)

    def point_mass_spectrum(self) -> np.ndarray:
        """Spectrum of an atom at zero: the identity of convolution."""
        return np.ones(self.size + 1, dtype=complex)

    def pmf_from_spectrum(self, spectrum: np.ndarray) -> np.ndarray:
        return np.fft.irfft(spectrum, 2 * self.size)[: self.size] / self._damping()

    def cdf_from_spectrum(self, spectrum: np.ndarray) -> np.ndarray:
        """CDF at the upper edges, clipped to [0, 1] and made monotone."""
        cdf = np.cumsum(self.pmf_from_spectrum(spectrum))
        return np.clip(np.maximum.accumulate(cdf), 0.0, 1.0)


def _round_up(value: float) -> float:
    """Next point of the grid 2^(j / GRID_STEPS_PER_OCTAVE), j integer."""
    return float(2.0 ** (np.ceil(np.log2(value) * GRID_STEPS_PER_OCTAVE) / GRID_STEPS_PER_OCTAVE))


def cdf_at(lattice: Lattice, cdf: np.ndarray, x: float) -> float:
    """A lattice CDF read at x <= top by linear interpolation between upper edges."""
    edges = np.concatenate(([0.0], lattice.upper_edges))
    return float(np.interp(x, edges, np.concatenate(([0.0], cdf))))


def geometric_sum(spectrum: np.ndarray, ratio: float) -> np.ndarray:
    """Sum of J >= 0 iid terms with P(J = j) = (1 - ratio) ratio^j."""
    return (1.0 - ratio) / (1.0 - ratio * spectrum)


def quantiles_from_cdf(lattice: Lattice, cdf: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Invert a lattice CDF by linear interpolation between upper edges."""
    if cdf[-1] < np.max(probs):
        raise ValueError("lattice too short for the requested quantile")
    edges = np.concatenate(([0.0], lattice.upper_edges))
    values = np.concatenate(([0.0], cdf))
    # np.interp needs increasing x; flat CDF stretches are skipped
    keep = np.concatenate(([True], np.diff(values) > 0))
    return np.interp(probs, values[keep], edges[keep])
