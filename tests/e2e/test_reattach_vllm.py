"""A router replica killed while it streams a greedy request from a vLLM CPU engine: the
client reconnects with the request's id and `Last-Event-ID` (as the OpenAI client does),
Serve's replacement replica re-attaches the request where its engine runs it, and the
client ends up with the text an unkilled run gives. One replica, so the one killed is
certainly the one holding the stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import httpx
import pytest

from app.experiments.faults import StreamProgress, actor_names, replica_prefix
from tests.conftest import vllm_cluster_config

pytestmark = pytest.mark.e2e

APP = "reattach-vllm"
PROMPT = "the quick brown fox jumps over the lazy dog and " * 4
MAX_TOKENS = 1000  # seconds of decoding on CPU: still running when the replica dies
REQUEST_ID = "e2e-reattach-1"
RESUME_WAIT_S = 240.0  # Serve starts a replacement replica meanwhile


@pytest.fixture(scope="module")
def one_replica(vllm_engines, tiny_model_dir):
    from app.serving.config import ServeConfig
    from deployments.router import serve_application

    config = ServeConfig(cluster=vllm_cluster_config(tiny_model_dir), default_slo_s=300.0,
                         num_router_replicas=1)
    with serve_application(config, APP) as url:  # the shared engines stay
        yield url


def body(*, stream: bool) -> dict:
    return {"model": "goodserve", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}


def kill_replica() -> str:
    import ray

    (name,) = actor_names(replica_prefix(APP))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)  # Serve replaces it
    return name


def acting_after(lines: Iterable[str], num_events: int, act: Callable[[], object]
                 ) -> Iterator[str]:
    """`lines`, calling `act` once the `num_events`-th event's data has been passed on."""
    seen = 0
    for line in lines:
        yield line
        if line.startswith("data: "):
            seen += 1
            if seen == num_events:
                act()


def read_until_cut(url: str, progress: StreamProgress, killed: list[str]) -> None:
    headers = {"X-Request-Id": REQUEST_ID, "Accept": "text/event-stream"}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body(stream=True),
                          headers=headers, timeout=300) as reply:
            assert reply.status_code == 200, reply.read()
            progress.take(acting_after(reply.iter_lines(), 5,
                                       lambda: killed.append(kill_replica())))
    except httpx.HTTPError:  # the connection broke with the replica
        pass


def resume(url: str, progress: StreamProgress) -> int:
    """Reconnect with the id and the last event read until the stream ends; the number
    of tries."""
    give_up_s = time.monotonic() + RESUME_WAIT_S
    tries = 0
    while not progress.done:
        assert time.monotonic() < give_up_s, progress
        tries += 1
        headers = {"X-Request-Id": REQUEST_ID, "Accept": "text/event-stream",
                   "Last-Event-ID": str(progress.last_event_id)}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body(stream=True),
                              headers=headers, timeout=300) as reply:
                if reply.status_code == 200:
                    progress.take(reply.iter_lines())
                    continue
                reply.read()  # no replica yet (5xx), or a proxy without routes (404)
                assert reply.status_code >= 500 or reply.status_code == 404, reply.text
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return tries


def test_a_stream_whose_router_replica_died_is_reattached_with_the_unkilled_text(one_replica):
    url = one_replica
    progress, killed = StreamProgress(), []
    read_until_cut(url, progress, killed)
    assert killed and not progress.done, progress  # cut mid-stream
    held = progress.text
    assert progress.last_event_id is not None and int(progress.last_event_id) >= 1
    tries = resume(url, progress)
    assert tries >= 1 and progress.error is None and progress.finish_reason == "length"
    assert progress.text.startswith(held)
    counters = httpx.get(url + "/v1/instances", timeout=60).json()["counters"]
    assert counters["num_reattached"] == 1, counters  # taken over, not started again
    unkilled = httpx.post(url + "/v1/completions", json=body(stream=False), timeout=300)
    assert unkilled.status_code == 200, unkilled.text
    assert progress.text == unkilled.json()["choices"][0]["text"]
