"""Seeded discrete-event simulations of the three SARA stages, for validation.

- `simulate_mgk`: FCFS M/G/k (prefill); k = 1 uses the vectorised Lindley recursion
  (KV link), k > 1 a heap of server-free times (one C-level heap op per request).
- `simulate_decode`: continuous batching, iteration by iteration, with O(1) work
  per iteration: the batch's context sum is kept as
  `sum(L_i) + n * (it + 1) - sum(start_it)` instead of per-request arrays.

Every function takes its own `numpy.random.Generator`; nothing reads a global RNG.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.search import check_rate

WARMUP_FRACTION = 0.05


def simulate_mgk(
    rate_rps: float,
    num_servers: int,
    service: LengthDist,
    num_requests: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Sojourn times (wait + service) of FCFS M/G/k, warm-up removed."""
    check_rate(rate_rps)
    if rate_rps * service.mean >= num_servers:
        raise ValueError(f"unstable queue: rho = {rate_rps * service.mean / num_servers:.3f}")
    gaps = rng.exponential(1.0 / rate_rps, num_requests)
    services = service.sample(rng, num_requests)
    if num_servers == 1:
        waits = _lindley_waits(gaps, services)
    else:
        waits = _multi_server_waits(np.cumsum(gaps), services, num_servers)
    return (waits + services)[int(WARMUP_FRACTION * num_requests) :]


def _lindley_waits(gaps: np.ndarray, services: np.ndarray) -> np.ndarray:
    """W_n = U_n - min_{j<=n} U_j with U the random walk of S_{n-1} - A_n."""
    steps = np.concatenate(([0.0], services[:-1] - gaps[1:]))
    walk = np.cumsum(steps)
    return walk - np.minimum.accumulate(np.minimum(walk, 0.0))


def _multi_server_waits(arrivals: np.ndarray, services: np.ndarray, k: int) -> np.ndarray:
    free_at = [0.0] * k
    waits = np.empty(len(arrivals))
    for i, (arrival, service) in enumerate(zip(arrivals.tolist(), services.tolist(), strict=True)):
        start = max(free_at[0], arrival)
        waits[i] = start - arrival
        heapq.heapreplace(free_at, start + service)
    return waits


@dataclass(frozen=True)
class DecodeTrace:
    """Per-iteration durations and batch sizes of a decode run."""

    iteration_s: np.ndarray
    batch_sizes: np.ndarray

    def tpot_quantiles(self, probs: np.ndarray) -> np.ndarray:
        """Per-token TPOT quantiles: each iteration counts once per request in it."""
        return weighted_quantiles(self.iteration_s, self.batch_sizes, probs)


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Quantiles of values repeated `weights` times (midpoint plotting positions)."""
    keep = weights > 0
    order = np.argsort(values[keep])
    sorted_values, sorted_weights = values[keep][order], weights[keep][order].astype(float)
    positions = (np.cumsum(sorted_weights) - 0.5 * sorted_weights) / sorted_weights.sum()
    return np.interp(probs, positions, sorted_values)


def simulate_decode(
    stage: DecodeStage,
    num_devices: int,
    batch_size: int,
    rate_rps: float | None,
    num_iterations: int,
    rng: np.random.Generator,
) -> DecodeTrace:
    """Continuous batching; `rate_rps=None` keeps the batch full (saturated pool)."""
    num_requests = int(num_iterations * batch_size * stage.p0 * 1.5) + batch_size + 100
    inputs = stage.input_len.sample(rng, num_requests).tolist()
    lengths = rng.geometric(stage.p0, num_requests).tolist()  # decode iterations, >= 1
    if rate_rps is None:
        arrivals = [0.0] * num_requests
    else:
        check_rate(rate_rps)
        arrivals = np.cumsum(rng.exponential(1.0 / rate_rps, num_requests)).tolist()
    durations, sizes = _run_batches(
        stage, num_devices, batch_size, num_iterations, (arrivals, inputs, lengths)
    )
    skip = int(WARMUP_FRACTION * len(durations))
    return DecodeTrace(np.asarray(durations[skip:]), np.asarray(sizes[skip:]))


def _run_batches(
    stage: DecodeStage,
    num_devices: int,
    batch_size: int,
    num_iterations: int,
    requests: tuple[list[float], list[float], list[int]],
) -> tuple[list[float], list[int]]:
    arrivals, inputs, lengths = requests
    mem_fixed, mem_per_token, comp_per_request, comp_per_token = _iteration_coefficients(
        stage, num_devices
    )
    finish_at: defaultdict[int, list[int]] = defaultdict(list)
    starts = [0] * len(arrivals)
    now, nxt, active, sum_inputs, sum_starts = 0.0, 0, 0, 0.0, 0
    durations: list[float] = []
    sizes: list[int] = []
    for it in range(num_iterations):
        if active == 0 and nxt < len(arrivals):
            now = max(now, arrivals[nxt])  # idle until the next arrival
        while active < batch_size and nxt < len(arrivals) and arrivals[nxt] <= now:
            starts[nxt] = it
            finish_at[it + lengths[nxt] - 1].append(nxt)
            active, sum_inputs, sum_starts = active + 1, sum_inputs + inputs[nxt], sum_starts + it
            nxt += 1
        if active == 0:
            break
        context = sum_inputs + active * (it + 1) - sum_starts
        duration = max(
            mem_fixed + mem_per_token * context,
            comp_per_request * active + comp_per_token * context,
        )
        durations.append(duration)
        sizes.append(active)
        now += duration
        for r in finish_at.pop(it, ()):
            active, sum_inputs = active - 1, sum_inputs - inputs[r]
            sum_starts -= starts[r]
    return durations, sizes


def _iteration_coefficients(stage: DecodeStage, num_devices: int) -> tuple[float, ...]:
    """T_d = max(a + b L, c n + e L) as plain floats for the per-iteration loop."""
    m, d = stage.model, stage.device
    bandwidth = num_devices * d.hbm_bytes_per_s
    mults = num_devices * d.mults_per_s
    return (
        m.weight_bytes / bandwidth,
        m.kv_bytes_per_token / bandwidth,
        m.linear_mults_per_token / mults,
        2.0 * m.num_layers * m.model_dim / mults,
    )
