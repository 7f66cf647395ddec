"""Engine lifetime follows the application: on a Ray cluster started by `ray start`,
`serve run app.main:app` starts the default config's four engines under the
application's controller; a router replica restart keeps them; `serve shutdown`
stops every one of them and gives their `gpu_type` resources back."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RESOURCES = {"gpu_type:H800": 1, "gpu_type:A800": 1, "gpu_type:A40": 1, "gpu_type:V100": 2}

# run in a fresh interpreter attached to the test cluster: what is alive there
PROBE = """
import json, sys, ray
from ray.util.state import list_actors
ray.init(address=sys.argv[1], log_to_driver=False)
alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10000)
named = [a for a in alive if a.name]
# name -> actor id: an actor recreated under the same name has a new id
engines = {a.name: a.actor_id for a in named
           if a.ray_namespace == "goodserve" and not a.name.endswith(":controller")}
controllers = {a.name: a.actor_id for a in named if a.name.endswith(":controller")}
replicas = sorted(a.name for a in named
                  if a.ray_namespace == "serve" and "RouterDeployment" in a.name)
total, free = ray.cluster_resources(), ray.available_resources()
held = {k: total[k] - free.get(k, 0.0) for k in total if k.startswith("gpu_type:")}
print(json.dumps({"engines": engines, "controllers": controllers, "replicas": replicas,
                  "held": held}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    env["RAY_AUTH_MODE"] = "disabled"  # `ray start` turns token auth on by default
    return env


@contextmanager
def ray_cluster() -> Iterator[tuple[str, str]]:
    """`ray start --head --block` with the four GPU kinds: (GCS address, dashboard URL,
    which `serve shutdown` talks to). Stopped by ending its process (never `ray stop`,
    which would stop every Ray instance on the machine)."""
    port, dashboard_port = free_port(), free_port()
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2",
         f"--resources={json.dumps(RESOURCES)}", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         "--disable-usage-stats"],
        cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: probe(address) is not None, 90, "the Ray head did not start")
        yield address, f"http://127.0.0.1:{dashboard_port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def probe(address: str) -> dict | None:
    run = subprocess.run([sys.executable, "-c", PROBE, address], cwd=ROOT, env=environment(),
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def wait_for(condition, timeout_s: float, message: str):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        value = condition()
        if value:
            return value
        time.sleep(1.0)
    pytest.fail(message)


def serve_cli(address: str, *args: str, **popen) -> subprocess.Popen:
    """`serve ARGS --address ADDRESS` (the GCS for start and run, the dashboard for
    shutdown)."""
    return subprocess.Popen([str(BIN / "serve"), *args, "--address", address], cwd=ROOT,
                            env=environment(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, **popen)


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "goodserve", "prompt": "hello " * 20, "max_tokens": 8})


def test_serve_shutdown_stops_every_engine_and_a_replica_restart_keeps_them():
    http_port = free_port()
    with ray_cluster() as (address, dashboard):
        serve_cli(address, "start", "--http-port", str(http_port)).wait(timeout=120)
        runner = serve_cli(address, "run", "app.main:app")
        url = f"http://127.0.0.1:{http_port}"
        try:
            up = wait_for(lambda: (s := probe(address)) and len(s["engines"]) == 4 and s,
                          240, "serve run did not start the four engines")
            assert up["held"] == {k: float(v) for k, v in RESOURCES.items()}
            wait_for(lambda: _ok(url), 120, "the router never answered")
            # a router replica restart keeps the engines (the same actors: names and ids)
            (replica,) = up["replicas"]
            kill = ("import ray,sys; ray.init(address=sys.argv[1]); "
                    "ray.kill(ray.get_actor(sys.argv[2], namespace='serve'), no_restart=True)")
            subprocess.run([sys.executable, "-c", kill, address, replica], cwd=ROOT,
                           env=environment(), check=True, timeout=120)
            wait_for(lambda: (s := probe(address)) and s["replicas"]
                     and s["replicas"] != [replica], 120, "Serve did not replace the replica")
            wait_for(lambda: _ok(url), 120, "the new replica never answered")
            after = probe(address)
            assert after["engines"] == up["engines"]
            assert after["controllers"] == up["controllers"]
            # deleting the application stops every engine it started
            assert serve_cli(dashboard, "shutdown", "-y").wait(timeout=120) == 0
            gone = wait_for(lambda: (s := probe(address)) and not s["engines"]
                            and not s["controllers"] and s, 120,
                            "engines or the controller outlived the application")
            assert all(v == 0.0 for v in gone["held"].values()), gone["held"]
        finally:
            runner.terminate()
            runner.wait(timeout=60)


def _ok(url: str) -> bool:
    try:
        return complete(url).status_code == 200
    except httpx.HTTPError:
        return False
