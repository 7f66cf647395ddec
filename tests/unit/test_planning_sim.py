"""Seeded stage simulations agree with the analytic models (small, fast runs)."""

from __future__ import annotations

import numpy as np
import pytest

from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams
from app.planning.queues import MgkQueue
from app.planning.stage_sim import simulate_decode, simulate_mgk, weighted_quantiles

pytestmark = pytest.mark.unit

PROBS = np.array([0.5, 0.7, 0.9, 0.95])


@pytest.mark.parametrize(("servers", "rho"), [(1, 0.6), (3, 0.7)])
def test_mmk_simulation_matches_exact_quantiles(servers: int, rho: float) -> None:
    queue = MgkQueue(rho * servers, servers, LengthDist.exponential(1.0))
    rng = np.random.default_rng(7)
    sojourn = simulate_mgk(queue.arrival_rate, servers, queue.service, 200_000, rng)
    simulated = np.quantile(sojourn, PROBS)
    assert np.allclose(queue.sojourn_quantiles(PROBS), simulated, rtol=0.04)


def test_simulation_is_seeded() -> None:
    service = LengthDist.lognormal(1.0, 2.0)
    first = simulate_mgk(2.0, 4, service, 5_000, np.random.default_rng(3))
    second = simulate_mgk(2.0, 4, service, 5_000, np.random.default_rng(3))
    assert np.array_equal(first, second)


def test_simulation_rejects_unstable_queues() -> None:
    with pytest.raises(ValueError, match="unstable"):
        simulate_mgk(5.0, 4, LengthDist.exponential(1.0), 100, np.random.default_rng(0))


def test_weighted_quantiles() -> None:
    values = np.array([1.0, 2.0, 3.0])
    assert weighted_quantiles(values, np.array([0, 0, 1]), np.array([0.5]))[0] == 3.0


def make_stage() -> DecodeStage:
    model = ModelParams("toy-8b", 32, 4096, 14336, 0.25, 16, 16e9, ffn_matrices=3)
    device = DeviceParams("X", 3e14, 1.2e12, 80e9, 2.0)
    return DecodeStage(model, device, LengthDist.exponential(2048), 64)


def test_saturated_decode_matches_full_batch_tpot() -> None:
    stage = make_stage()
    trace = simulate_decode(stage, 1, 16, None, 20_000, np.random.default_rng(5))
    assert np.all(trace.batch_sizes == 16)
    analytic = stage.tpot_quantiles(1, 16, PROBS)
    assert np.allclose(analytic, trace.tpot_quantiles(PROBS), rtol=0.02)


def test_loaded_decode_matches_occupancy_mean() -> None:
    stage = make_stage()
    rate = 0.5 * 32 * stage.p0 / stage.mean_iteration_s(1, 32)
    trace = simulate_decode(stage, 1, 32, rate, 40_000, np.random.default_rng(6))
    occupancy = stage.occupancy(1, rate)
    assert trace.batch_sizes.mean() == pytest.approx(occupancy.mean, rel=0.1)
    analytic = stage.tpot_quantiles(1, 32, PROBS, rate_rps=rate)
    assert np.allclose(analytic, trace.tpot_quantiles(PROBS), rtol=0.05)
