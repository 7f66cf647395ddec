"""Ray Serve autoscales the router replicas on their ongoing requests
(`router_autoscaling`): under load a replica is added and follows the controller's
status board like the first; when the load ends Serve goes back to the minimum, and
every request sent meanwhile is served."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.integration

APP = "autoscaled"


def running_replicas() -> int:
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    return deployments["RouterDeployment"].replica_states.get("RUNNING", 0)


def joined_board(get, controller, give_up_s: float) -> dict:
    """The controller's status board once two replicas follow it and tell it their
    slack (a new replica joins at its first request: Serve's proxies learn of it
    first), or as it stands after `give_up_s`."""
    deadline = time.monotonic() + give_up_s
    while True:
        board = get(controller.status.remote())["status_board"]
        joined = len(board["followers"]) == 2 and len(board["tellers"]) == 2
        if joined or time.monotonic() > deadline:
            return board
        time.sleep(0.5)


def test_serve_adds_a_router_replica_under_load_that_joins_the_board_and_removes_it_after(
        ray_session):
    import httpx
    import ray

    from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup
    from app.serving.config import RouterAutoscaling, ServeConfig
    from deployments.controller import controller_for
    from tests.conftest import serving

    groups = [InstanceGroup(engine=EngineConfig(gpu_type=g)) for g in ("H800", "A40")]
    config = ServeConfig(
        cluster=ClusterConfig(name="autoscaled", groups=groups), default_slo_s=120.0,
        router_autoscaling=RouterAutoscaling(min_replicas=1, max_replicas=2,
                                             target_ongoing_requests=2,
                                             upscale_delay_s=0, downscale_delay_s=2))
    codes: list[int] = []
    loading = threading.Event()
    loading.set()
    with serving(config, APP) as url:
        def keep_sending(worker: int) -> None:
            n = 0
            while loading.is_set():
                codes.append(httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": "goodserve", "prompt": f"scale {worker} {n} " * 30,
                    "max_tokens": 200}).status_code)
                n += 1

        assert running_replicas() == 1
        with ThreadPoolExecutor(8) as pool:
            for worker in range(8):
                pool.submit(keep_sending, worker)
            give_up_s = time.monotonic() + 120
            while running_replicas() < 2 and time.monotonic() < give_up_s:
                time.sleep(1.0)
            scaled_up = running_replicas()
            board = joined_board(ray.get, controller_for(config), give_up_s=60)
            loading.clear()
        assert scaled_up == 2
        assert len(board["followers"]) == 2 and len(board["tellers"]) == 2, board
        give_up_s = time.monotonic() + 120
        while running_replicas() > 1 and time.monotonic() < give_up_s:
            time.sleep(1.0)
        assert running_replicas() == 1
    assert codes and set(codes) == {200}, f"{len(codes)} sent, codes {set(codes)}"
