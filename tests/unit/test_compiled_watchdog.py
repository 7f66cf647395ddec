"""The watchdog's compiled passes against plain-Python references on random inputs:
the conditional totals a trained predictor's re-estimate gives, and the lateness and
budgets of an instance's requests."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from app.routing.base import ActiveRequest
from app.routing.goodserve import GoodServeConfig, SloWatchdog
from app.routing.length import MIN_CALIBRATION_SAMPLES, PredictorLength
from app.routing.quantiles import SortedWindow
from app.routing.status import StatusEstimator
from app.routing.view import FinishReport
from tests.unit.routing_utils import (
    fixed_length_predictor,
    make_cluster,
    make_request,
    make_view,
)

pytestmark = pytest.mark.unit


def reference_total(ratios: list[float] | None, arrival: int, generated: int) -> float:
    """The conditional total, written out: p x median(ratios above n / p) / median."""
    if ratios is None:
        return float(max(arrival, generated + 1))
    ordered = sorted(ratios)
    above = [r for r in ordered if r > generated / arrival]
    if not above:
        return generated + 1.0
    median_above = above[max(math.ceil(0.5 * len(above)) - 1, 0)]
    median = ordered[max(math.ceil(0.5 * len(ordered)) - 1, 0)]
    return max(arrival * median_above / median, generated + 1.0)


@pytest.mark.parametrize("seed", range(8))
def test_conditional_totals_equal_the_written_out_rule(seed: int):
    rng = random.Random(seed)
    window = rng.choice([150, 400])
    length = PredictorLength(fixed_length_predictor(), calibration_window=window)
    by_scale: dict[int, list[float]] = {}
    every: list[float] = []
    for k in range(rng.choice([50, 300, 900])):
        arrival = rng.choice([5, 40, 70, 300, 3000])
        true = max(1, int(arrival * rng.lognormvariate(0, 0.6)))
        request = replace(make_request(10.0, rid=f"f{k}"), predicted_output_tokens=arrival)
        length.on_finish(FinishReport(request, "A40", true, 0.1, 1.0), 1.0)
        ratio = true / arrival
        every = (every + [ratio])[-window:]
        scale = arrival.bit_length()
        by_scale[scale] = (by_scale.get(scale, []) + [ratio])[-window:]
    requests = [replace(make_request(10.0, rid=f"r{i}"), predicted_output_tokens=rng.choice(
        [3, 40, 64, 65, 300, 3000, 9000])) for i in range(60)]
    generated = [rng.choice([0, 1, 30, 100, 400, 5000]) for _ in requests]
    expected = []
    for request, n in zip(requests, generated, strict=True):
        arrival = request.predicted_output_tokens
        near = by_scale.get(arrival.bit_length(), [])
        ratios = (near if len(near) >= MIN_CALIBRATION_SAMPLES
                  else every if len(every) >= MIN_CALIBRATION_SAMPLES else None)
        expected.append(reference_total(ratios, arrival, n))
    assert length.conditional_totals(requests, generated) == expected


@pytest.mark.parametrize("seed", range(5))
def test_a_sorted_window_on_a_buffer_keeps_the_last_values_in_order(seed: int):
    rng = random.Random(seed)
    size = rng.choice([1, 3, 50])
    window, last = SortedWindow(size), []
    for _ in range(300):
        value = rng.choice([rng.random(), 0.5, 1.0])  # ties too
        window.append(value)
        last = (last + [value])[-size:]
        assert window.sorted.tolist() == sorted(last)


def test_budgets_after_a_check_are_each_on_track_requests_slack():
    """A request on track gets the slack it has by the compiled pass: its deadline less
    now, less the queue still ahead of it when waiting, less its remaining tokens (its
    max_tokens bounding the estimate) at d_g; a late one loses its budget."""
    rng = random.Random(3)
    status = StatusEstimator(alpha=1.0)
    status.observe_iterations("A40", (0.04,), 0, 8)
    status.observe_queue_wait("A40", 0.7, 0.0)
    length = PredictorLength(fixed_length_predictor(300))
    dog = SloWatchdog(status, length, GoodServeConfig(max_migrations_per_request=0))
    cluster = make_cluster(make_view("A40", running=8, waiting=3))
    active = []
    for i in range(40):
        request = make_request(rng.choice([5.0, 12.0, 30.0, math.inf]), rid=f"r{i}",
                               max_output_tokens=rng.choice([None, 50, 250]))
        active.append(ActiveRequest(replace(request, predicted_output_tokens=300), "A40",
                                    rng.choice([0, 20, 290]),
                                    is_running=rng.random() < 0.7))
    dog.check("A40", active, cluster, 1.0)
    estimate = status.estimate(cluster.get("A40"), 1.0, joining=0)
    slacks = []
    for item in active:
        request = item.request
        if not request.has_deadline:
            continue
        total = 300.0 if request.max_output_tokens is None else min(
            300.0, request.max_output_tokens)
        remaining = max(total - item.num_generated_tokens, 1.0)
        waiting = 0.0 if item.is_running else estimate.queue_delay_s
        slack = request.deadline_s - 1.0 - waiting - remaining * estimate.decode_s_per_token
        if slack >= 0:
            slacks.append(slack)
    assert 0 < len(slacks) < sum(item.request.has_deadline for item in active)
    assert len(dog.budgets) == len(slacks)
    assert dog.budgets.shortest_stall_s("A40") == pytest.approx(min(slacks))
