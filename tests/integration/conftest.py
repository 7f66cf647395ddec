"""The Ray Serve router over HTTP on simulated engines of four GPU kinds, one per module."""

from __future__ import annotations

import time

import httpx
import pytest

from app.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.serving.config import RoutingConfig, ServeConfig

GPU_SETUP = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
WEAKEST = "live-A40-2"  # largest unloaded time per token of the four
STRONGEST = "live-H800-0"


@pytest.fixture(scope="module")
def live_url(ray_session):
    """A fresh service per test module: routing state (the history of finished lengths)
    carries from one request to the next, so a module shares it only among its own tests."""
    from ray import serve

    from deployments.router import build_app, free_port

    groups = [InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp,
                                                scheduler=SchedulerConfig(max_num_seqs=32)))
              for g, tp in GPU_SETUP]
    config = ServeConfig(cluster=ClusterConfig(name="live", groups=groups),
                         # point estimates only (confidence 0.5): the migration test
                         # needs a request placed by its under-predicted length
                         routing=RoutingConfig(tau_iterations=10, migration_margin=0.0,
                                               confidence_quantile=0.5))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="live-sim", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    from deployments.cluster import shutdown_shared_engines

    shutdown_shared_engines(config.cluster)
    wait_until_gone(config.cluster)


def wait_until_gone(cluster: ClusterConfig, timeout_s: float = 60.0) -> None:
    """`ray.kill` returns before the actor is dead: wait until no engine of `cluster` is
    registered, so the next module's service starts engines of its own under those names."""
    import ray

    from deployments.cluster import ENGINE_NAMESPACE, engine_ids

    deadline_s = time.monotonic() + timeout_s
    for engine_id, _ in engine_ids(cluster):
        while time.monotonic() < deadline_s:
            try:
                ray.get_actor(engine_id, namespace=ENGINE_NAMESPACE)
            except ValueError:  # gone
                break
            time.sleep(0.1)


def post(url: str, path: str, **body) -> httpx.Response:
    payload = {"model": "goodserve", "prompt": "route me " * 50, "max_tokens": 8} | body
    return httpx.post(url + path, json=payload, timeout=120)
