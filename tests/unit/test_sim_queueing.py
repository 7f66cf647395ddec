"""The simulator against queueing theory: M/M/1 and M/M/c mean sojourn times.

Service is made exponential with the toy `linear_prefill_instance`: each request
has one output token and a geometric prompt length (mean 1000 tokens at 1 ms per
token, so E[S] = 1 s), and the batch-size-1 engine runs the whole prompt in one
iteration whose time is exactly proportional to its length. M/M/c needs a
central queue: `max_ongoing_requests=1` holds requests at the router until an
instance is idle, as Ray Serve does.
"""

from __future__ import annotations

import math
import statistics

import pytest

from app.routing.baselines import LeastRequestPolicy
from app.sim.simulator import Simulator
from app.sim.toy import geometric_lengths, single_server_setup
from app.workloads.workload import Content, Workload, make_workload, poisson_arrivals

pytestmark = pytest.mark.unit

MEAN_SERVICE_S = 1.0
SECONDS_PER_TOKEN = 1e-3


def exponential_workload(rate: float, duration_s: float, seed: int) -> Workload:
    times = poisson_arrivals(rate, duration_s, seed)
    lengths = geometric_lengths(MEAN_SERVICE_S / SECONDS_PER_TOKEN, len(times), seed + 1)
    return make_workload(times, [Content(n, 1) for n in lengths], duration_s, "mm")


def erlang_c(c: int, offered: float) -> float:
    """Probability an arrival waits in M/M/c (offered load a = lambda / mu)."""
    head = sum(offered**k / math.factorial(k) for k in range(c))
    tail = offered**c / math.factorial(c) * c / (c - offered)
    return tail / (head + tail)


def mean_sojourn_s(num_servers: int, workload: Workload) -> float:
    setups = [single_server_setup(SECONDS_PER_TOKEN)] * num_servers
    sim = Simulator(setups, LeastRequestPolicy(seed=0), max_ongoing_requests=1)
    result = sim.run(workload)
    assert all(r.finish_s is not None for r in result.records)
    return statistics.fmean(r.e2e_s for r in result.records)


def test_single_instance_matches_mm1() -> None:
    rate = 0.5
    expected = 1.0 / (1.0 / MEAN_SERVICE_S - rate)
    measured = mean_sojourn_s(1, exponential_workload(rate, 50_000.0, seed=1))
    assert measured == pytest.approx(expected, rel=0.05)


def test_three_instances_match_mmc_erlang_c() -> None:
    c, rate = 3, 2.1  # utilisation 0.7
    mu = 1.0 / MEAN_SERVICE_S
    expected = erlang_c(c, rate / mu) / (c * mu - rate) + 1.0 / mu
    measured = mean_sojourn_s(c, exponential_workload(rate, 15_000.0, seed=3))
    assert measured == pytest.approx(expected, rel=0.05)
