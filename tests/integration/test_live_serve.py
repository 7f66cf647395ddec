"""The Ray Serve router over HTTP, driving simulated engine actors on four GPU kinds.

Real Ray, real Serve, real HTTP; engines are the sim backend in real time, so the
policy, status estimator and watchdog run exactly as in production.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import WEAKEST, post

pytestmark = pytest.mark.integration


def test_completion_is_openai_shaped_and_reports_where_it_ran(live_url):
    reply = post(live_url, "/v1/completions", max_tokens=12, slo_s=30.0)
    assert reply.status_code == 200
    data = reply.json()
    assert data["object"] == "text_completion" and data["model"] == "goodserve"
    assert data["usage"]["completion_tokens"] == 12 and data["usage"]["prompt_tokens"] == 100
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["goodserve"]["met_deadline"] is True
    listed = [m["id"] for m in httpx.get(live_url + "/v1/models").json()["data"]]
    assert listed == ["llama-3.1-8b", "goodserve"]  # the model's own name, then the alias
    assert httpx.get(live_url + "/health").json()["status"] == "ok"


def test_streaming_sends_every_token_then_done(live_url):
    with httpx.stream("POST", live_url + "/v1/completions", timeout=120, json={
        "model": "goodserve", "prompt": "stream this", "max_tokens": 6, "stream": True,
    }, headers={"X-Request-Id": "stream-every-token", "Accept": "text/event-stream"}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["cache-control"] == "no-cache"
        assert reply.headers["x-accel-buffering"] == "no"
        lines = [line for line in reply.iter_lines() if line]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in data[:-1]]
    texts = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert texts.count("<") == 6
    # each event with tokens names the tokens sent so far, where a resume starts
    ids = [int(line.removeprefix("id: ")) for line in lines if line.startswith("id: ")]
    assert ids and ids == sorted(ids) and ids[-1] == 6


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "goodserve", "prompt": "hello there", "max_tokens": 4}
                      | fields).encode()


BAD_INPUT = {  # case -> (raw body, status, error type)
    "malformed JSON": (b"{oops", 400, "invalid_request_error"),
    "not an object": (b"[1, 2, 3]", 400, "invalid_request_error"),
    "wrong type": (_body(max_tokens="many"), 400, "invalid_request_error"),
    "body over the size limit": (_body(prompt="x " * 5_000_000), 413,
                                 "invalid_request_error"),
    "prompt over the context": (_body(prompt=[5] * 140_000), 400,
                                "invalid_request_error"),
    "zero max_tokens": (_body(max_tokens=0), 400, "invalid_request_error"),
    "negative max_tokens": (_body(max_tokens=-5), 400, "invalid_request_error"),
    "huge max_tokens": (_body(max_tokens=10**9), 400, "invalid_request_error"),
    "negative slo_s": (_body(slo_s=-1), 400, "invalid_request_error"),
    "infinite slo_s": (b'{"model": "goodserve", "prompt": "hi", "slo_s": Infinity}', 400,
                       "invalid_request_error"),
    "NaN temperature": (b'{"model": "goodserve", "prompt": "hi", "temperature": NaN}', 400,
                        "invalid_request_error"),
    "unknown model": (_body(model="gpt-4"), 404, "not_found_error"),
    "non-UTF-8 bytes": (b'{"model": "goodserve", "prompt": "\xff\xfe"}', 400,
                        "invalid_request_error"),
    "token id beyond the vocabulary": (_body(prompt=[5, 10**7]), 400, "invalid_request_error"),
    "negative token id": (_body(prompt=[5, -1]), 400, "invalid_request_error"),
    "empty prompt": (_body(prompt=""), 400, "invalid_request_error"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(live_url, case):
    raw, status, error_type = BAD_INPUT[case]
    reply = httpx.post(live_url + "/v1/completions", content=raw, timeout=60,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == error_type and error["message"]
    assert post(live_url, "/v1/completions").status_code == 200
    counters = httpx.get(live_url + "/v1/instances").json()["counters"]
    assert counters["num_in_flight"] == 0  # nothing half-admitted stays behind


def test_a_client_gone_mid_stream_leaves_no_request_on_any_engine(live_url):
    """The reply runs on for the unread grace (2 s here) in case the client resumes,
    then is cancelled and its engine request aborted."""
    with httpx.stream("POST", live_url + "/v1/completions", timeout=60, json={
            "model": "goodserve", "prompt": "leave early " * 10, "max_tokens": 2000,
            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the client hangs up after the first token
    deadline_s = time.monotonic() + 30
    while time.monotonic() < deadline_s:
        state = httpx.get(live_url + "/v1/instances").json()
        engines_busy = sum(row["num_running"] or 0 for row in state["instances"])
        if state["counters"]["num_in_flight"] == 0 and engines_busy == 0:
            break
        time.sleep(0.5)
    assert state["counters"]["num_in_flight"] == 0 and engines_busy == 0, state
    assert state["counters"]["num_dropped"] >= 1
    assert post(live_url, "/v1/completions").status_code == 200


def test_watchdog_migrates_a_request_that_outgrows_its_prediction(live_url):
    """The router's history predictor sees six 4-token and five 60-token outputs (plus
    the few short ones of any test that ran before), so it predicts <= 12 tokens for
    a new request and 60 once one has passed 12. A 60-token
    request with a 1.5 s deadline therefore starts on the weakest GPU (4 tokens fit
    anywhere) and, at its first watchdog check (tau = 10 iterations), is at risk there
    (~2 s left to do) and moves by token ids to a stronger instance that can make it.
    (Migration margin 0 here: any lateness moves; the margin has its own unit test.)"""
    with ThreadPoolExecutor(11) as pool:
        history = list(pool.map(lambda n: post(live_url, "/v1/completions", max_tokens=n,
                                               ignore_eos=True), [4] * 6 + [60] * 5))
    assert all(r.status_code == 200 for r in history)
    prompt = "migrate me " * 20
    moved = post(live_url, "/v1/completions", prompt=prompt, max_tokens=60, slo_s=1.5).json()
    summary = moved["goodserve"]
    assert summary["instance_ids"][0] == WEAKEST and summary["num_migrations"] == 1
    assert summary["instance_ids"][1] != WEAKEST
    assert moved["usage"]["completion_tokens"] == 60
    # token-id resume: the same prompt without a deadline (no move) gives the same text
    unmoved = post(live_url, "/v1/completions", prompt=prompt, max_tokens=60).json()
    assert unmoved["goodserve"]["num_migrations"] == 0
    assert moved["choices"][0]["text"] == unmoved["choices"][0]["text"]
    counters = httpx.get(live_url + "/v1/instances").json()["counters"]
    assert counters["num_migrations"] >= 1 and counters["num_in_flight"] == 0

