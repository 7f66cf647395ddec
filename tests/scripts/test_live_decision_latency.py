"""`benchmarks.live_decision_latency` reads a replica's histograms from Ray's Prometheus
text the way Prometheus would, and turns a run into its table."""

from __future__ import annotations

import math

import pytest

from benchmarks.live_decision_latency import (
    PLACEMENT,
    bucket_quantile,
    difference,
    figures,
    histogram_buckets,
    readme,
)

pytestmark = pytest.mark.scripts


def line(component: str, le: str, count: float, policy: str = "goodserve",
         name: str = PLACEMENT) -> str:
    return f'ray_{name}_bucket{{Component="{component}",le="{le}",policy="{policy}"}} {count}'


EXPOSITION = "\n".join([
    f"# HELP ray_{PLACEMENT} From the arrival to the placement",
    f"# TYPE ray_{PLACEMENT} histogram",
    line("a", "0.001", 2.0), line("a", "0.002", 6.0), line("a", "+Inf", 8.0),
    line("b", "0.001", 0.0), line("b", "0.002", 2.0), line("b", "+Inf", 2.0),
    line("a", "0.001", 9.0, policy="p2c"),
    line("a", "0.001", 9.0, name="goodserve_routing_decision_seconds"),
    'ray_goodserve_prediction_seconds_bucket{Component="a",le="+Inf"} 3.0',
    f'ray_{PLACEMENT}_count{{Component="a",policy="goodserve"}} 8.0',
]) + "\n"


def test_buckets_are_summed_over_processes_for_one_histogram_and_policy():
    buckets = histogram_buckets(EXPOSITION, PLACEMENT, "goodserve")
    assert buckets == {0.001: 2.0, 0.002: 8.0, math.inf: 10.0}
    assert histogram_buckets(EXPOSITION, "goodserve_prediction_seconds", None) == {
        math.inf: 3.0}  # a histogram without the policy tag
    assert difference(buckets, {0.001: 2.0, 0.002: 4.0, math.inf: 4.0}) == {
        0.001: 0.0, 0.002: 4.0, math.inf: 6.0}


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does():
    buckets = {0.001: 2.0, 0.002: 8.0, math.inf: 10.0}
    assert bucket_quantile(buckets, 0.1) == pytest.approx(0.0005)  # from 0 in the first
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.0015)
    assert bucket_quantile(buckets, 0.99) == 0.002  # in +Inf: the highest finite bound
    assert math.isnan(bucket_quantile({0.001: 0.0, math.inf: 0.0}, 0.5))


def test_a_rate_is_kept_up_with_when_all_completed_near_the_offered_rate():
    result = {"request_throughput": 9.5, "completed": 300, "failed": 0, "duration": 31.6,
              "output_throughput": 76.0, "p50_ttft_ms": 12.0, "p99_ttft_ms": 40.0,
              "p50_e2el_ms": 30.0}
    buckets = {0.001: 150.0, 0.002: 300.0, math.inf: 300.0}
    row = figures(10.0, result, buckets, buckets, buckets)
    assert row["kept_up"] and row["placements"] == 300
    assert row["arrival_to_placement_p50_ms"] == 1.0
    slow = figures(20.0, result, buckets, buckets, buckets)
    assert not slow["kept_up"]
    page = readme({"setup": {"command": "python -m benchmarks.live_decision_latency",
                             "engines": 4, "router_replicas": 1, "policy": "goodserve",
                             "predictor": "moe (micro-batched)",
                             "num_prompts": 300, "input_len": 32, "output_len": 8,
                             "cpus": 2},
                   "rates": [row, slow], "highest_kept_up_rps": 10.0})
    assert "| 10 | 9.50 | 300 / 0 |" in page and "Highest rate kept up with" in page
    assert "10 req/s" in page
