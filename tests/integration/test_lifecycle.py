"""`goodserve serve` under a process manager: SIGTERM stops it as Ctrl-C does, the
request in flight finishes within the grace period, and nothing it started is left
running (Ray's processes, engine and router workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from tests.integration.test_app_lifetime import BIN, ROOT, environment, free_port, wait_for

pytestmark = pytest.mark.integration

MAX_TOKENS = 800


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_lets_the_request_in_flight_finish_then_stops_everything():
    port = free_port()
    server = subprocess.Popen([str(BIN / "goodserve"), "serve", "--port", str(port)],
                              cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.poll() is not None or _healthy(url), 240,
                 "goodserve serve did not start")
        assert server.poll() is None
        started = psutil.Process(server.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in started)
        body = {"model": "goodserve", "prompt": "finish me " * 20, "max_tokens": MAX_TOKENS,
                "stream": True}
        tokens, reason, signalled_s, refused = 0, None, None, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if not chunk.get("choices"):  # the closing chunk has none
                    continue
                tokens += 1
                reason = chunk["choices"][0]["finish_reason"] or reason
                if signalled_s is None:
                    os.kill(server.pid, signal.SIGTERM)  # as a container runtime does
                    signalled_s = time.monotonic()
                elif refused is None and time.monotonic() - signalled_s > 2.0:
                    refused = httpx.post(url + "/v1/completions", timeout=30, json={
                        "model": "goodserve", "prompt": "too late", "max_tokens": 4})
        assert reason == "length" and tokens >= 2  # streamed to its end, after the signal
        assert refused is not None and refused.status_code == 503, refused
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert server.wait(timeout=180) == 0
        assert time.monotonic() - signalled_s < 150
        output = server.stdout.read()
        assert "stopping: new requests get a 503; those in flight get up to 30 s" in output
        assert "still in flight" not in output
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [" ".join(p.cmdline())[:120] for p in left]
        assert not _healthy(url)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.mark.parametrize("moment", ["ray_starting", "deploying"])
def test_sigint_during_start_up_stops_the_server_and_everything_it_started(moment):
    """Ctrl-C while Ray's processes start (held until they are up, then stopped) or
    while the application deploys: the server exits cleanly, never comes up, and leaves
    nothing running."""
    port = free_port()
    server = subprocess.Popen([str(BIN / "goodserve"), "serve", "--port", str(port)],
                              cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started: list[psutil.Process] = []

    def ray_started() -> bool:
        if server.poll() is not None:
            return True
        started[:] = psutil.Process(server.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started if p.is_running())
        return "gcs_server" in names and ("raylet" in names or moment == "ray_starting")

    try:
        wait_for(ray_started, 120, "goodserve serve did not start Ray")
        if moment == "deploying":  # Serve's controller is starting the application
            wait_for(lambda: server.poll() is not None or any(
                "ServeController" in " ".join(p.cmdline())
                for p in psutil.Process(server.pid).children(recursive=True)
                if p.is_running()), 120, "Serve did not start")
            started[:] = psutil.Process(server.pid).children(recursive=True)
        assert server.poll() is None and not _healthy(f"http://127.0.0.1:{port}")
        os.kill(server.pid, signal.SIGINT)
        assert server.wait(timeout=180) == 0
        output = server.stdout.read()
        # once the application deploys it may take requests, which get their grace;
        # Serve's controller appears while Serve itself is still starting
        stopping = (("stopping during start-up",) if moment == "ray_starting"
                    else ("stopping during start-up", "stopping: new requests get a 503"))
        assert any(s in output for s in stopping) and "serving " not in output, output
        time.sleep(2)
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, [" ".join(p.cmdline())[:120] for p in left]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
