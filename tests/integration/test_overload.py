"""Overload: three times the measured capacity for a bounded time, admission control
on. The router stays up with bounded memory and routing time, requests whose deadline
cannot be met are turned away early with the reason, and the admitted ones complete,
most within their deadline at the pace the engines ran (other work on the machine slows
the simulated engines below their hardware model, which no router estimate can see)."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import numpy as np
import psutil
import pytest

from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.serving.config import RoutingConfig, ServeConfig
from tests.conftest import serving
from tests.integration.conftest import instance_specs, met_at_engine_pace

pytestmark = pytest.mark.integration

SLO_S = 3.0
MAX_NUM_SEQS = 4
OVERLOAD_S = 15.0
BODY = {"model": "goodserve", "prompt": "overload " * 40, "max_tokens": 48, "slo_s": SLO_S}


@pytest.fixture(scope="module")
def overload_url(ray_session):
    engines = [EngineConfig(gpu_type=g, scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS))
               for g in ("H800", "A40")]
    config = ServeConfig(cluster=ClusterConfig(name="overload", groups=[
        InstanceGroup(engine=e) for e in engines]),
        routing=RoutingConfig(admission_control=True))
    with serving(config, "overload") as url:
        yield url


def replica_process() -> psutil.Process:
    (replica,) = [p for p in psutil.process_iter(["cmdline"])
                  if "ServeReplica:overload" in " ".join(p.info["cmdline"] or [])]
    return replica


async def closed_loop(url: str, clients: int, seconds: float) -> float:
    """Requests served per second by `clients` back-to-back clients (the rest turned
    away)."""
    done = 0
    end_s = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < end_s:
            reply = await http.post(url + "/v1/completions", json=BODY)
            done += reply.status_code == 200

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return done / seconds


async def open_loop(url: str, rate: float, seconds: float) -> list[tuple[int, float, dict]]:
    """Poisson arrivals at `rate` for `seconds`: (status, latency, body) of each."""
    rng = np.random.default_rng(0)
    results: list[tuple[int, float, dict]] = []

    async def one(http: httpx.AsyncClient) -> None:
        start = time.monotonic()
        reply = await http.post(url + "/v1/completions", json=BODY)
        results.append((reply.status_code, time.monotonic() - start, reply.json()))

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as http:
        tasks, t = [], 0.0
        start = time.monotonic()
        while t < seconds:
            t += rng.exponential(1 / rate)
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(one(http)))
        await asyncio.gather(*tasks)
    return results


def test_three_times_capacity_turns_away_what_cannot_be_met_and_serves_the_rest(
        overload_url, ray_metrics_url):
    capacity = asyncio.run(closed_loop(overload_url, clients=8, seconds=8.0))
    assert capacity > 1.0
    replica = replica_process()
    rss_before = replica.memory_info().rss
    results = asyncio.run(open_loop(overload_url, 3 * capacity, OVERLOAD_S))
    rss_after = replica.memory_info().rss
    served = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(served) + len(rejected) == len(results), {r[0] for r in results}
    assert rejected and served
    for _, _, body in rejected:
        assert body["error"]["type"] == "slo_unattainable"
        assert "no instance can meet the deadline" in body["error"]["message"]
    rejected_p99 = np.percentile([r[1] for r in rejected], 99)
    served_p50 = np.percentile([r[1] for r in served], 50)
    assert rejected_p99 < served_p50  # turned away at once, not after queueing
    for _, _, body in served:  # admitted ones ran to their last token
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == BODY["max_tokens"]
    # ... and most of the admitted met their deadlines: admission turns away only what
    # no instance could meet, so under 3x load some admitted still miss; without
    # admission control next to none meet. Deadlines are kept at each request's engine
    # pace: on an idle machine 87% of 194 met (67% on the wall clock, the H800 running at
    # 1.07x its model), beside two CPU-bound jobs 91% of 161 (63%, at 1.33x).
    specs = instance_specs(overload_url)
    met = sum(met_at_engine_pace(body["goodserve"], specs[body["goodserve"]["instance_ids"][-1]],
                                 body["usage"], num_seqs=MAX_NUM_SEQS)
              for _, _, body in served)
    met_wall = sum(body["goodserve"]["met_deadline"] for _, _, body in served)
    assert met >= 2 / 3 * len(served), (met, met_wall, len(served))
    assert rss_after - rss_before < 200 * 2**20
    state = httpx.get(overload_url + "/v1/instances", timeout=30).json()
    assert state["counters"]["num_in_flight"] == 0
    assert httpx.get(overload_url + "/health", timeout=30).status_code == 200
    # the routing time stayed bounded: p99 of the decision histogram within its last
    # finite bucket, 0.1 s (it was the 50-ms bucket alone on 2 cores and the 0.1-s one
    # with the rest of the test suite beside it)
    text = httpx.get(ray_metrics_url, timeout=30).text
    buckets: dict[float, float] = {}
    for le, count in re.findall(r'ray_goodserve_routing_decision_seconds_bucket\{[^}]*'
                                r'le="([^"]+)"[^}]*policy="goodserve"[^}]*\} (\S+)', text):
        buckets[float(le)] = buckets.get(float(le), 0.0) + float(count)
    total = buckets[float("inf")]
    within = min(le for le, n in buckets.items() if n >= 0.99 * total)
    assert total >= len(served) and within <= 0.1, buckets
