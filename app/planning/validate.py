"""Analytic latency quantiles vs seeded stage simulations (`goodserve plan validate`).

For each stage (prefill, kv, decode) and tail case (light = exponential L_i, heavy =
log-normal L_i with CV 1.5 and 2) it runs the stage simulation at a few operating
points and compares quantiles for p_SLO on a grid over [0.5, 0.98]:
relative error |analytic / simulated - 1|, averaged over the grid (per point), then
over points (`mean_rel_err`), and its maximum over both (`max_rel_err`). The same
numbers for `Method.PAPER` are reported as `paper_mean_rel_err`/`paper_max_rel_err`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.kv import KvStage
from app.planning.params import DeviceParams, ModelParams
from app.planning.prefill import PrefillStage
from app.planning.queues import Method
from app.planning.stage_sim import simulate_decode, simulate_mgk

TAIL_CASES: dict[str, Callable[[float], LengthDist]] = {
    "light": LengthDist.exponential,
    "heavy_cv1.5": lambda mean: LengthDist.lognormal(mean, 1.5),
    "heavy_cv2": lambda mean: LengthDist.lognormal(mean, 2.0),
}
STAGES = ("prefill", "kv", "decode")
MAX_LENGTH_FACTOR = 4.0


@dataclass(frozen=True)
class ValidationConfig:
    """Operating points; the defaults keep `plan validate` well under a minute."""

    model: str = "llama-3.1-8b"
    prefill_gpu: str = "H800"
    decode_gpu: str = "A800"
    mean_input_len: float = 1024.0
    decode_mean_input_len: float = 4096.0  # long contexts: KV reads matter for TPOT
    mean_output_len: float = 128.0
    prefill_points: tuple[tuple[int, float], ...] = (  # (k_p, rho_p)
        (4, 0.6),
        (4, 0.75),
        (4, 0.9),
        (8, 0.6),
        (8, 0.75),
        (8, 0.9),
    )
    kv_utilizations: tuple[float, ...] = (0.5, 0.7, 0.9)
    kv_rate_rps: float = 20.0
    decode_points: tuple[tuple[int, int, float | None], ...] = (  # (k_d, N_bat, load)
        (1, 16, None),
        (1, 16, 0.5),
        (2, 64, None),
        (2, 64, 0.7),  # None: batch always full
    )
    p_min: float = 0.5
    p_max: float = 0.98
    num_probs: int = 25
    num_requests: int = 1_000_000  # per prefill / KV point at rho <= 0.75, more above
    decode_iterations: int = 200_000  # per decode point
    seed: int = 0

    @property
    def probs(self) -> np.ndarray:
        return np.linspace(self.p_min, self.p_max, self.num_probs)

    def requests_at(self, rho: float) -> int:
        """Queues near saturation mix slowly: simulate up to 4x longer (noise ~ 1/(1-rho))."""
        return int(self.num_requests * min(MAX_LENGTH_FACTOR, max(1.0, (0.25 / (1 - rho)) ** 2)))


@dataclass(frozen=True)
class PointResult:
    """Errors at one operating point, averaged and maximised over the p grid."""

    params: dict[str, float | int | str]  # operating point: name -> value
    mean_rel_err: float
    max_rel_err: float
    paper_mean_rel_err: float
    paper_max_rel_err: float


def rel_errors(analytic: np.ndarray, simulated: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(analytic) / np.asarray(simulated) - 1.0)


def _point(params: dict, quantiles: Callable[[Method], np.ndarray], simulated: np.ndarray):
    refined = rel_errors(quantiles(Method.REFINED), simulated)
    paper = rel_errors(quantiles(Method.PAPER), simulated)
    return PointResult(
        params, float(refined.mean()), float(refined.max()), float(paper.mean()), float(paper.max())
    )


def validate_prefill(config: ValidationConfig, input_len: LengthDist, case_id: int):
    stage = PrefillStage(
        ModelParams.named(config.model), DeviceParams.named(config.prefill_gpu), input_len
    )
    results = []
    for index, (k, rho) in enumerate(config.prefill_points):
        rate = rho * k / stage.service.mean
        rng = np.random.default_rng([config.seed, 0, case_id, index])
        sojourn = simulate_mgk(rate, k, stage.service, config.requests_at(rho), rng)
        queue = stage.queue(rate, k)
        results.append(
            _point(
                {"num_prefill": k, "rho": rho, "rate_rps": rate},
                lambda method, q=queue: q.sojourn_quantiles(config.probs, method),
                np.quantile(sojourn, config.probs),
            )
        )
    return results


def validate_kv(config: ValidationConfig, input_len: LengthDist, case_id: int):
    stage = KvStage(ModelParams.named(config.model), input_len)
    rate = config.kv_rate_rps
    results = []
    for index, rho in enumerate(config.kv_utilizations):
        bandwidth = stage.stability_floor(rate) / rho
        service = stage.queue(rate, bandwidth).service
        rng = np.random.default_rng([config.seed, 1, case_id, index])
        sojourn = simulate_mgk(rate, 1, service, config.requests_at(rho), rng)
        results.append(
            _point(
                {"rho": rho, "bandwidth_gbps": bandwidth / 1e9},
                lambda method, b=bandwidth: stage.latency_quantiles(rate, b, config.probs, method),
                np.quantile(sojourn, config.probs),
            )
        )
    return results


def validate_decode(config: ValidationConfig, input_len: LengthDist, case_id: int):
    stage = DecodeStage(
        ModelParams.named(config.model),
        DeviceParams.named(config.decode_gpu),
        input_len,
        config.mean_output_len,
    )
    results = []
    for index, (k_d, n_bat, load) in enumerate(config.decode_points):
        rate = None
        if load is not None:
            rate = load * n_bat * stage.p0 / stage.mean_iteration_s(k_d, n_bat)
        rng = np.random.default_rng([config.seed, 2, case_id, index])
        trace = simulate_decode(stage, k_d, n_bat, rate, config.decode_iterations, rng)
        results.append(
            _point(
                {
                    "num_decode": k_d,
                    "batch_size": n_bat,
                    "load": "saturated" if load is None else load,
                },
                lambda method, k=k_d, n=n_bat, r=rate: stage.tpot_quantiles(
                    k, n, config.probs, method, rate_rps=r
                ),
                trace.tpot_quantiles(config.probs),
            )
        )
    return results


VALIDATORS = {"prefill": validate_prefill, "kv": validate_kv, "decode": validate_decode}


def summarize(points: list[PointResult]) -> dict:
    """Mean over points of the per-point mean error; max over everything."""
    return {
        "mean_rel_err": float(np.mean([p.mean_rel_err for p in points])),
        "max_rel_err": float(np.max([p.max_rel_err for p in points])),
        "paper_mean_rel_err": float(np.mean([p.paper_mean_rel_err for p in points])),
        "paper_max_rel_err": float(np.max([p.paper_max_rel_err for p in points])),
        "points": [asdict(p) for p in points],
    }


def run_validation(config: ValidationConfig = ValidationConfig()) -> dict:
    """The JSON document printed by `goodserve plan validate --json`."""
    start = time.perf_counter()
    stages = {}
    for stage in STAGES:
        stages[stage] = {}
        for case_id, (case, make_dist) in enumerate(TAIL_CASES.items()):
            mean = config.decode_mean_input_len if stage == "decode" else config.mean_input_len
            points = VALIDATORS[stage](config, make_dist(mean), case_id)
            stages[stage][case] = summarize(points)
    return {
        "p_slo_range": [config.p_min, config.p_max],
        "num_quantiles": config.num_probs,
        "default_method": Method.REFINED.value,
        "stages": stages,
        "seed": config.seed,
        "elapsed_s": time.perf_counter() - start,
    }
