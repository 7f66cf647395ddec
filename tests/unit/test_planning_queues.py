"""Queue formulas of the SARA planner: Erlang-C, M/M/k exactness, M/G/1, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.planning.distributions import LengthDist
from app.planning.lattice import Lattice
from app.planning.queues import Method, MgkQueue, erlang_c

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("servers", "load", "expected"),
    [
        (1, 0.5, 0.5),  # M/M/1: P(wait) = rho
        (2, 1.0, 1.0 / 3.0),  # (A^k/k! k/(k-A)) / (sum + same) = 1 / 3
        (3, 2.0, 4.0 / 9.0),
        (10, 8.0, 0.40918),  # standard table value
        (1, 0.0, 0.0),
    ],
)
def test_erlang_c_known_values(servers: int, load: float, expected: float) -> None:
    assert erlang_c(servers, load) == pytest.approx(expected, abs=5e-5)


def test_erlang_c_large_pool_is_finite() -> None:
    value = erlang_c(2000, 1950.0)
    assert 0.0 < value < 1.0


@pytest.mark.parametrize(("servers", "load"), [(2, 2.0), (3, 3.5), (0, 0.1), (2, -1.0)])
def test_erlang_c_rejects_bad_inputs(servers: int, load: float) -> None:
    with pytest.raises(ValueError):
        erlang_c(servers, load)


def test_unstable_queue_and_negative_rate_are_clear_errors() -> None:
    service = LengthDist.exponential(1.0)
    with pytest.raises(ValueError, match="rho = 1.000 >= 1"):
        MgkQueue(4.0, 4, service)
    with pytest.raises(ValueError, match="arrival rate must be >= 0"):
        MgkQueue(-1.0, 4, service)


def mmk_wait_cdf(rate: float, servers: int, mean_service: float, t: float) -> float:
    """Textbook M/M/k: P(W > t) = C(k, A) exp(-(k mu - lambda) t)."""
    c = erlang_c(servers, rate * mean_service)
    return 1.0 - c * math.exp(-(servers / mean_service - rate) * t)


@pytest.mark.parametrize("method", list(Method))
@pytest.mark.parametrize(("servers", "rho"), [(1, 0.5), (4, 0.8), (16, 0.95)])
def test_mmk_wait_is_exact_for_both_methods(method: Method, servers: int, rho: float) -> None:
    mean = 0.2
    queue = MgkQueue(rho * servers / mean, servers, LengthDist.exponential(mean))
    for t in (0.0, 0.05, 0.3, 1.0):
        expected = mmk_wait_cdf(queue.arrival_rate, servers, mean, t)
        assert queue.wait_cdf(t, method) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("method", list(Method))
def test_lattice_sojourn_matches_mmk_closed_form(method: Method) -> None:
    """The numeric convolution path agrees with the exact M/M/k sojourn CDF."""
    queue = MgkQueue(3.2, 4, LengthDist.exponential(1.0))
    lattice = Lattice.covering(20.0, 0.05)
    cdf = queue.sojourn_cdf_on(lattice, method)
    for t in (0.5, 2.0, 6.0):
        j = int(round(t / lattice.step - 0.5))
        edge = (j + 0.5) * lattice.step
        assert cdf[j] == pytest.approx(queue.sojourn_cdf(edge), abs=2e-4)


def test_mmk_sojourn_quantiles_invert_the_cdf() -> None:
    queue = MgkQueue(3.2, 4, LengthDist.exponential(1.0))
    probs = np.array([0.5, 0.9, 0.98])
    for q, p in zip(queue.sojourn_quantiles(probs), probs, strict=True):
        assert queue.sojourn_cdf(float(q)) == pytest.approx(p, abs=1e-4)


def test_refined_mg1_wait_has_pollaczek_khinchine_mean() -> None:
    """For k = 1 the refined method is the exact M/G/1 wait: E[W] = lambda E[S^2] / 2(1-rho)."""
    service = LengthDist.lognormal(1.0, 2.0)
    queue = MgkQueue(0.7, 1, service)
    expected = 0.7 * service.second_moment / (2 * 0.3)
    lattice = Lattice.covering(400.0, 0.01)
    wait = lattice.pmf_from_spectrum(queue._wait_spectrum(lattice, Method.REFINED))
    assert float(np.sum(wait * np.arange(lattice.size) * lattice.step)) == pytest.approx(
        expected, rel=0.02
    )


def test_paper_tail_rate_is_kingman() -> None:
    queue = MgkQueue(1.5, 4, LengthDist.lognormal(2.0, 1.5))  # rho = 0.75
    assert queue.paper_decay_rate == pytest.approx(2 * 4 * 0.25 / (2.0 * (1 + 1.5**2)))


def test_heavier_tail_means_longer_tail_latency() -> None:
    light = MgkQueue(3.0, 4, LengthDist.exponential(1.0)).sojourn_quantiles(np.array([0.98]))
    heavy = MgkQueue(3.0, 4, LengthDist.lognormal(1.0, 2.0)).sojourn_quantiles(np.array([0.98]))
    assert heavy[0] > light[0]


def test_wait_cdf_starts_at_the_no_wait_atom() -> None:
    queue = MgkQueue(3.0, 4, LengthDist.lognormal(1.0, 2.0))
    no_wait = 1.0 - queue.wait_probability
    assert queue.wait_cdf(0.0) == pytest.approx(no_wait)
    assert queue.wait_cdf(1e-4) == pytest.approx(no_wait, abs=1e-3)
    assert queue.wait_cdf(-1.0) == 0.0
