"""Faults during live traffic: an engine actor killed while a replay runs. Every
request completes or gets a clear error; none hangs and none is lost; a greedy request
resumed on another engine keeps the tokens it would have had."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import Counter

import httpx
import pytest

from app.config import ClusterConfig, EngineConfig, InstanceGroup
from app.serving.config import ServeConfig
from deployments.cluster import ENGINE_NAMESPACE
from tests.conftest import serving

pytestmark = pytest.mark.integration

REQUESTS = 60


@pytest.fixture(scope="module")
def faulty():
    engines = [EngineConfig(gpu_type=g) for g in ("H800", "A800", "A40")]
    config = ServeConfig(cluster=ClusterConfig(name="faults", groups=[
        InstanceGroup(engine=e) for e in engines]), default_slo_s=60.0)
    return config


def test_killing_an_engine_mid_replay_loses_no_request(ray_session, faulty):
    ray = ray_session
    with serving(faulty, "faults") as url:
        reference = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "goodserve", "prompt": "same every time", "max_tokens": 60,
            "temperature": 0.0}).json()["choices"][0]["text"]
        outcomes: list[tuple[int, str, dict]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            time.sleep(i * 0.1)  # 10 req/s for 6 s
            body = {"model": "goodserve", "prompt": "same every time" if i % 5 == 0
                    else f"request {i} " * 20, "max_tokens": 60, "temperature": 0.0}
            try:
                reply = httpx.post(url + "/v1/completions", json=body, timeout=90)
                result = (reply.status_code, body["prompt"], reply.json())
            except httpx.HTTPError as exc:  # a hang or a dropped connection
                result = (0, body["prompt"], {"error": repr(exc)})
            with lock:
                outcomes.append(result)

        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(one, i) for i in range(REQUESTS)]
            time.sleep(2.0)
            rows = httpx.get(url + "/v1/instances", timeout=30).json()["instances"]
            victim = max(rows, key=lambda r: (r["num_running"] or 0) + (r["num_waiting"] or 0))
            victim = victim["instance_id"]  # the engine carrying the most requests now
            ray.kill(ray.get_actor(victim, namespace=ENGINE_NAMESPACE), no_restart=True)
            concurrent.futures.wait(futures, timeout=300)
    codes = Counter(code for code, _, _ in outcomes)
    assert len(outcomes) == REQUESTS, codes  # none lost
    assert set(codes) <= {200, 502}, [o for o in outcomes if o[0] not in (200, 502)][:3]
    for code, _, body in outcomes:
        if code == 502:
            assert body["error"]["type"] == "engine_error" and body["error"]["message"]
    assert codes[200] >= REQUESTS * 0.9, codes
    moved = [body for code, _, body in outcomes if code == 200
             and victim in body["goodserve"]["instance_ids"][:-1]]
    assert moved, "no request was running on the killed engine"
    for code, prompt, body in outcomes:
        if code == 200 and prompt == "same every time":
            assert body["choices"][0]["text"] == reference  # greedy, moved or not
