"""The Ray Serve router over HTTP on simulated engines of four GPU kinds, one per module."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from app.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.serving.config import RoutingConfig, ServeConfig, load_serve_config

GPU_SETUP = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
WEAKEST = "live-A40-2"  # largest unloaded time per token of the four
STRONGEST = "live-H800-0"


@pytest.fixture(scope="module")
def live_url(ray_session):
    """A fresh service per test module: routing state (the history of finished lengths)
    carries from one request to the next, so a module shares it only among its own tests."""
    groups = [InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp,
                                                scheduler=SchedulerConfig(max_num_seqs=32)))
              for g, tp in GPU_SETUP]
    config = ServeConfig(cluster=ClusterConfig(name="live", groups=groups),
                         # point estimates only (confidence 0.5): the migration test
                         # needs a request placed by its under-predicted length
                         routing=RoutingConfig(tau_iterations=10, migration_margin=0.0,
                                               confidence_quantile=0.5))
    with running_service(config, "live-sim") as url:
        yield url


@contextmanager
def running_service(config: ServeConfig, app_name: str) -> Iterator[str]:
    """The router application of `config` on a free port (its URL), then every engine
    it started stopped and gone."""
    from ray import serve

    from deployments.cluster import shutdown_shared_engines
    from deployments.router import build_app, free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name=app_name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        shutdown_shared_engines(config.cluster)
        wait_until_gone(config.cluster)


PD_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-sim-pd.yaml"


@contextmanager
def pd_service(name: str, kv_link_gbps: float = 1.0) -> Iterator[tuple[str, ServeConfig]]:
    """configs/local-sim-pd.yaml (prefill H800 + A800, decode A40 + 2x V100) served
    under cluster name `name`, on a slow link so transfers are visible; point estimates
    only (confidence 0.5)."""
    base = load_serve_config(PD_CONFIG)
    cluster = base.cluster.model_copy(update={"name": name, "kv_link_gbps": kv_link_gbps})
    config = base.model_copy(update={"cluster": cluster,
                                     "routing": RoutingConfig(confidence_quantile=0.5)})
    with running_service(config, name) as url:
        yield url, config


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
