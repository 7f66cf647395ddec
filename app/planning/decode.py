"""Decode stage: continuous batching of up to N_bat requests on k_d devices.

One iteration reads the weights and every request's KV cache:
`T_d = max((Omega_LLM + g gamma L_io) / (k_d B_HBM), N_mul,d / (k_d F_d))`, where
L_io is the sum of the batch's context lengths. A request observed in the batch has
context X = L_i + A, A its age in iterations; with exponential L_o the iteration
count is geometric with p0 = 1 - exp(-1/l_o), so A ~ Geometric(p0) on {1, 2, ...}.
Given n requests, L_io(n) is a sum of n iid X with mean n m_X and variance n v_X.

- `Method.PAPER`: L_io(n) moment-matched by a gamma distribution; Poisson occupancy.
- `Method.REFINED`: L_io(n) computed exactly (under independence) by an FFT power;
  over-dispersed occupancy (`batching`).

Constraints on N_bat for a given k_d (paper Fig. 4): C1 TPOT p_SLO-quantile <= tau_dec
with a full batch; C2 P(weights + KV <= k_d Omega_HBM) >= p_mem with a full batch;
C3 stability lambda < N_bat p0 / E[T_d(N_bat)]; C4 direct admission: an arrival finds
a free batch slot with probability p_join (paper: mu_bat + z(p_join) sqrt(mu_bat) <= N_bat).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import special, stats

from app.planning.batching import OccupancyModel, occupancy_model
from app.planning.distributions import LengthDist
from app.planning.lattice import Lattice
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.queues import Method
from app.planning.search import check_rate, first_true, last_true_near

TPOT_GRID_POINTS = 4000
MIN_TOKEN_WEIGHT = 1e-9
_INFEASIBLE = 1 << 30  # a lower batch bound no pool can meet
CONTEXT_LATTICE_MAX = 8192
CONTEXT_SCALE_FACTOR = 4.0  # 4 lattice points per context spread: rounding adds < 0.6% var
MIN_STEPS_PER_SPREAD = 4  # coarser lattices fall back to the moment-matched sum
CONTEXT_TOP_PROB, CONTEXT_TOP_MARGIN = 1.0 - 1e-7, 1.5  # TPOT grids reach margin * quantile


@dataclass(frozen=True)
class BatchBounds:
    """The feasible N_bat interval for one k_d: [max(C3, C4), min(C1, C2)]."""

    c1_max: int  # TPOT SLO
    c2_max: int | None  # HBM capacity; None when C2 provably holds at c1_max (Cantelli)
    c3_min: int  # stability
    c4_min: int  # direct admission

    @property
    def upper(self) -> int:
        return self.c1_max if self.c2_max is None else min(self.c1_max, self.c2_max)

    @property
    def lower(self) -> int:
        return max(self.c3_min, self.c4_min, 1)

    @property
    def feasible(self) -> bool:
        return self.lower <= self.upper

    @property
    def upper_constraint(self) -> str:
        return "C1" if self.c2_max is None or self.c1_max <= self.c2_max else "C2"

    @property
    def lower_constraint(self) -> str:
        return "C4" if self.c4_min >= self.c3_min else "C3"


@dataclass(frozen=True)
class DecodeSizing:
    """Minimum decode pool for one arrival rate, with the batch size to run."""

    num_devices: int  # k_d
    max_batch_size: int  # N_bat: the top of the feasible range (most admission slack)
    min_batch_size: int
    binding: str  # why k_d - 1 devices are not enough, e.g. "C1<C4"


@dataclass(frozen=True)
class DecodeStage:
    """The decode pool model for one device type."""

    model: ModelParams
    device: DeviceParams
    input_len: LengthDist
    mean_output_len: float

    def __post_init__(self) -> None:
        if not self.mean_output_len > 0:
            raise ValueError(f"mean output length must be positive, got {self.mean_output_len}")

    @functools.cached_property
    def p0(self) -> float:
        """Probability that an iteration ends a request: 1 - exp(-1 / l_o)."""
        return -math.expm1(-1.0 / self.mean_output_len)

    @functools.cached_property
    def context_mean(self) -> float:
        return self.input_len.mean + 1.0 / self.p0

    @functools.cached_property
    def context_variance(self) -> float:
        return self.input_len.variance + (1.0 - self.p0) / self.p0**2

    def iteration_s(
        self, num_devices: int, num_requests: ArrayLike, context_tokens: ArrayLike
    ) -> np.ndarray:
        """T_d for a batch: the slower of HBM traffic and compute."""
        m, d = self.model, self.device
        memory = (m.weight_bytes + m.kv_bytes_per_token * np.asarray(context_tokens)) / (
            num_devices * d.hbm_bytes_per_s
        )
        compute = m.decode_mults(num_requests, context_tokens) / (num_devices * d.mults_per_s)
        return np.maximum(memory, compute)

    def context_budget(self, num_devices: int, num_requests: int, tpot_s: ArrayLike) -> np.ndarray:
        """Largest L_io with T_d <= tpot_s (inverts both branches of the max)."""
        m, d = self.model, self.device
        tpot_s = np.asarray(tpot_s, dtype=float)
        memory = (tpot_s * num_devices * d.hbm_bytes_per_s - m.weight_bytes) / (
            m.kv_bytes_per_token
        )
        compute = (tpot_s * num_devices * d.mults_per_s) - m.linear_mults_per_token * num_requests
        return np.minimum(memory, compute / (2.0 * m.num_layers * m.model_dim))

    def mean_iteration_s(self, num_devices: int, num_requests: float) -> float:
        return float(self.iteration_s(num_devices, num_requests, num_requests * self.context_mean))

    def token_throughput(self, num_devices: int, batch_size: float) -> float:
        """Gamma(N_bat): tokens per second with a full batch."""
        return batch_size / self.mean_iteration_s(num_devices, batch_size)

    def saturation_throughput(self, num_devices: int) -> float:
        """Gamma_max = k_d B_HBM / (g gamma m_X) as N_bat grows (memory bound)."""
        return (
            num_devices
            * self.device.hbm_bytes_per_s
            / (self.model.kv_bytes_per_token * self.context_mean)
        )

    def context_cdf(self, num_requests: int, tokens: float, method: Method) -> float:
        """P(L_io(n) <= tokens)."""
        if tokens <= 0:
            return 0.0
        if method is Method.PAPER:
            shape, scale = self._gamma_fit(num_requests)
            return float(special.gammainc(shape, tokens / scale))
        lattice = self._context_lattice(tokens)
        if lattice.step > self._context_spread() / MIN_STEPS_PER_SPREAD:
            # the lattice cannot resolve one context: n is so large that the CLT holds
            return self.context_cdf(num_requests, tokens, Method.PAPER)
        spectrum = np.exp(num_requests * self._context_log_spectrum(lattice))
        return float(lattice.cdf_from_spectrum(spectrum)[-1])

    def tpot_quantile(self, num_devices: int, batch_size: int, p: float, method: Method) -> float:
        """TPOT p-quantile with a full batch (what C1 bounds)."""
        return float(self.tpot_quantiles(num_devices, batch_size, np.array([p]), method)[0])

    def tpot_quantiles(
        self,
        num_devices: int,
        batch_size: int,
        probs: np.ndarray,
        method: Method = Method.REFINED,
        rate_rps: float | None = None,
    ) -> np.ndarray:
        """Per-token TPOT quantiles; with `rate_rps`, over the batch-occupancy mixture."""
        times, cdf = self._tpot_cdf_grid(num_devices, batch_size, method, rate_rps)
        return np.interp(probs, cdf, times)

    def tpot_cdf(self, num_devices: int, batch_size: int, tpot_s: float, rate_rps: float,
                 method: Method = Method.REFINED) -> float:
        """P(a token's TPOT <= tpot_s) at `rate_rps` with at most `batch_size` running;
        0 where no batch of that size is stable at the rate."""
        if self.occupancy(num_devices, rate_rps, method) is None or (
                self.min_batch_stable(num_devices, rate_rps) > batch_size):
            return 0.0
        times, cdf = self._tpot_cdf_grid(num_devices, batch_size, method, rate_rps)
        return float(np.interp(tpot_s, times, cdf, left=0.0, right=1.0))

    def _tpot_cdf_grid(self, num_devices: int, batch_size: int, method: Method,
                       rate_rps: float | None) -> tuple[np.ndarray, np.ndarray]:
        """TPOT grid and its CDF over the batch sizes tokens are generated at."""
        weights = self.token_weights(num_devices, batch_size, rate_rps, method)
        sizes = np.flatnonzero(weights > MIN_TOKEN_WEIGHT)
        top = self._context_top(batch_size)
        tokens, cdfs = self._context_cdf_table(sizes, top, method)
        t_lo = float(self.iteration_s(num_devices, sizes[0], 0.0))
        t_hi = float(self.iteration_s(num_devices, batch_size, top))
        times = np.linspace(t_lo, t_hi, TPOT_GRID_POINTS)
        mixture = np.zeros_like(times)
        for row, n in enumerate(sizes):
            budgets = self.context_budget(num_devices, int(n), times)
            mixture += weights[n] * np.interp(budgets, tokens, cdfs[row], left=0.0)
        return times, np.maximum.accumulate(mixture)

    def occupancy(
        self, num_devices: int, rate_rps: float, method: Method = Method.REFINED
    ) -> OccupancyModel | None:
        """Batch occupancy at this rate (memory-bound iterations); None if no N_bat is stable."""
        check_rate(rate_rps)
        bandwidth = num_devices * self.device.hbm_bytes_per_s
        return occupancy_model(
            rate_rps,
            self.p0,
            self.model.weight_bytes / bandwidth,
            self.model.kv_bytes_per_token / bandwidth,
            self.context_mean,
            self.context_variance,
            poisson=method is Method.PAPER,
        )

    def token_weights(
        self, num_devices: int, batch_size: int, rate_rps: float | None, method: Method
    ) -> np.ndarray:
        """Share of tokens generated at each occupancy 0..N_bat (a full batch if no rate)."""
        occupancy = None if rate_rps is None else self.occupancy(num_devices, rate_rps, method)
        if occupancy is None:
            weights = np.zeros(batch_size + 1)
            weights[batch_size] = 1.0
            return weights
        weights = np.arange(batch_size + 1) * occupancy.clipped_pmf(batch_size)
        return weights / weights.sum()

    def batch_bounds(
        self,
        num_devices: int,
        rate_rps: float,
        slo: SloTargets,
        method: Method,
        cap_cache: dict[int, tuple[int, int | None]] | None = None,
    ) -> BatchBounds:
        """C1-C4 for k_d devices; C1/C2 do not depend on the rate, so callers may cache them."""
        caps = None if cap_cache is None else cap_cache.get(num_devices)
        if caps is None:
            c1 = self.max_batch_tpot(num_devices, slo.tpot_s, slo.p_slo, method)
            c2 = None
            if not self.memory_surely_fits(num_devices, c1, slo.p_mem):
                c2 = self.max_batch_memory(num_devices, slo.p_mem, method)
            caps = (c1, c2)
            if cap_cache is not None:
                cap_cache[num_devices] = caps
        upper = caps[0] if caps[1] is None else min(caps)
        return BatchBounds(
            c1_max=caps[0],
            c2_max=caps[1],
            c3_min=self.min_batch_stable(num_devices, rate_rps),
            c4_min=self.min_batch_admission(num_devices, rate_rps, slo.p_join, method, upper),
        )

    def memory_surely_fits(self, num_devices: int, batch_size: int, p_mem: float) -> bool:
        """Cantelli's bound shows C2 holds for any L_io distribution with these moments."""
        budget = self._kv_budget_tokens(num_devices)
        mean = batch_size * self.context_mean
        variance = batch_size * self.context_variance
        if budget <= mean:
            return False
        return 1.0 - variance / (variance + (budget - mean) ** 2) >= p_mem

    def max_batch_tpot(self, num_devices: int, tpot_s: float, p: float, method: Method) -> int:
        """C1: largest N_bat whose full-batch TPOT p-quantile is <= tpot_s."""

        def ok(n: int, how: Method) -> bool:
            budget = float(self.context_budget(num_devices, n, tpot_s))
            return budget > 0 and self.context_cdf(n, budget, how) >= p

        return self._max_batch(ok, method)

    def max_batch_memory(self, num_devices: int, p_mem: float, method: Method) -> int:
        """C2: largest N_bat whose KV fits in k_d Omega_HBM with probability p_mem."""
        budget = self._kv_budget_tokens(num_devices)

        def ok(n: int, how: Method) -> bool:
            return budget > 0 and self.context_cdf(n, budget, how) >= p_mem

        return self._max_batch(ok, method)

    def min_batch_stable(self, num_devices: int, rate_rps: float) -> int:
        """C3: smallest N_bat with lambda < N_bat p0 / E[T_d(N_bat)], i.e. N_bat > mu_bat."""
        occupancy = self.occupancy(num_devices, rate_rps, Method.PAPER)
        return _INFEASIBLE if occupancy is None else math.floor(occupancy.mean) + 1

    def min_batch_admission(
        self,
        num_devices: int,
        rate_rps: float,
        p_join: float,
        method: Method = Method.REFINED,
        limit: int | None = None,
    ) -> int:
        """C4: smallest N_bat letting a request join without waiting with prob. p_join.

        Answers above `limit` (e.g. the C1/C2 cap) are reported as limit + 1.
        """
        occupancy = self.occupancy(num_devices, rate_rps, method)
        if occupancy is None:
            return _INFEASIBLE
        if method is Method.PAPER:
            return occupancy.normal_min_batch(p_join)
        return occupancy.min_batch_for_admission(p_join, limit)

    def min_devices(
        self,
        rate_rps: float,
        slo: SloTargets,
        method: Method = Method.REFINED,
        cap_cache: dict[int, tuple[int, int | None]] | None = None,
    ) -> DecodeSizing:
        """Smallest k_d with a non-empty feasible N_bat range."""
        caps = {} if cap_cache is None else cap_cache
        weights_floor, stability_floor = self.device_floors(rate_rps)
        floor = max(weights_floor, stability_floor)

        def bounds(k: int) -> BatchBounds:
            return self.batch_bounds(k, rate_rps, slo, method, caps)

        if bounds(floor).feasible:
            k = floor
            binding = "C2" if weights_floor >= stability_floor else "C3"
        else:
            k = first_true(lambda k: bounds(k).feasible, floor)
            below = bounds(k - 1)
            binding = f"{below.upper_constraint}<{below.lower_constraint}"
        best = bounds(k)
        return DecodeSizing(k, best.upper, best.lower, binding)

    def device_floors(self, rate_rps: float) -> tuple[int, int]:
        """Smallest k_d holding the weights, and smallest with lambda < p0 Gamma_max (Eq. 41)."""
        check_rate(rate_rps)
        weights = self.model.weight_bytes / self.device.hbm_capacity_bytes
        per_device = self.p0 * self.saturation_throughput(1)
        return math.floor(weights) + 1, math.floor(rate_rps / per_device) + 1

    def stability_floor(self, rate_rps: float) -> int:
        """The stability-only decode pool (the SLO tax baseline)."""
        return max(self.device_floors(rate_rps))

    def _kv_budget_tokens(self, num_devices: int) -> float:
        free = num_devices * self.device.hbm_capacity_bytes - self.model.weight_bytes
        return free / self.model.kv_bytes_per_token

    def _max_batch(self, ok: Callable[[int, Method], bool], method: Method) -> int:
        """Largest n with ok(n); the cheap gamma fit seeds the refined search."""
        paper = last_true_near(lambda n: ok(n, Method.PAPER), 1)
        if method is Method.PAPER:
            return paper
        return last_true_near(lambda n: ok(n, method), paper)

    def _gamma_fit(self, num_requests: int) -> tuple[float, float]:
        scale = self.context_variance / self.context_mean
        return num_requests * self.context_mean / scale, scale

    def _context_top(self, batch_size: int) -> float:
        """A context sum the full batch exceeds with negligible probability."""
        shape, scale = self._gamma_fit(batch_size)
        return float(stats.gamma.ppf(CONTEXT_TOP_PROB, shape, scale=scale)) * CONTEXT_TOP_MARGIN

    def _context_spread(self) -> float:
        return min(math.sqrt(self.context_variance), float(self.input_len.quantile(0.5)) + 1)

    def _context_lattice(self, top: float) -> Lattice:
        """Resolve one context's shape; n-fold sums only need h << sqrt(v_X)."""
        scale = CONTEXT_SCALE_FACTOR * self._context_spread()
        return Lattice.covering(top, scale, max_size=CONTEXT_LATTICE_MAX)

    def _context_log_spectrum(self, lattice: Lattice) -> np.ndarray:
        """log of the spectrum of X: powers become one exp (any branch works for integer n)."""
        return _context_log_spectrum(self.input_len, self.p0, lattice)

    def _context_cdf_table(
        self, sizes: np.ndarray, top: float, method: Method
    ) -> tuple[np.ndarray, np.ndarray]:
        """CDFs of L_io(n) for each n in `sizes`, on a shared token grid."""
        lattice = self._context_lattice(top)
        coarse = lattice.step > self._context_spread() / MIN_STEPS_PER_SPREAD
        if method is Method.PAPER or coarse:  # coarse: batches so large that the CLT holds
            tokens = np.linspace(0.0, top, TPOT_GRID_POINTS)
            shape, scale = self._gamma_fit(1)
            table = special.gammainc(np.outer(sizes, np.ones_like(tokens)) * shape, tokens / scale)
            return tokens, table
        log_spectrum = self._context_log_spectrum(lattice)
        table = np.array([lattice.cdf_from_spectrum(np.exp(n * log_spectrum)) for n in sizes])
        return lattice.upper_edges, table


@functools.lru_cache(maxsize=256)
def _context_log_spectrum(input_len: LengthDist, p0: float, lattice: Lattice) -> np.ndarray:
    """Memoised: C1 and C2 evaluate one lattice per k_d for many batch sizes."""
    log_q = math.log1p(-p0)
    age = lattice.pmf(lambda x: -np.expm1(np.floor(np.maximum(x, 0.0)) * log_q))
    spectrum = lattice.spectrum(lattice.pmf(input_len.cdf)) * lattice.spectrum(age)
    log_spectrum = np.log(spectrum)
    log_spectrum.flags.writeable = False
    return log_spectrum
