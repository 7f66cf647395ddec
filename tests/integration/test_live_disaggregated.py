"""Disaggregated serving over HTTP: prefill and decode pools of simulated engines with the
KV moved over the modelled link (configs/local-sim-pd.yaml, at 1 GB/s)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import sse_chunks
from tests.integration.conftest import pd_service

pytestmark = pytest.mark.integration

KV_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B


@pytest.fixture(scope="module")
def pd_url(ray_session):
    with pd_service("live-pd") as (url, _):
        yield url


def body(words: int, max_tokens: int, **extra) -> dict:
    return {"model": "goodserve", "prompt": "route me " * words, "max_tokens": max_tokens,
            **extra}


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b)
                                      for b in bodies))


def test_every_request_prefills_in_one_pool_decodes_in_the_other_and_is_answered(pd_url):
    bodies = [body(20 * (1 + i % 5), 4 + 3 * i) for i in range(12)]
    replies = asyncio.run(post_all(pd_url, bodies))
    assert [r.status_code for r in replies] == [200] * 12
    for sent, reply in zip(bodies, replies, strict=True):
        data = reply.json()
        usage, gs = data["usage"], data["goodserve"]
        assert usage["completion_tokens"] == sent["max_tokens"]
        assert gs["prefill_instance"].startswith("live-pd-prefill-")
        assert gs["decode_instance"].startswith("live-pd-decode-")
        assert gs["instance_ids"] == [gs["decode_instance"]]
        assert gs["kv_loaded_tokens"] == usage["prompt_tokens"]  # loaded, not recomputed
        # the modelled link: bytes / 1 GB/s at least (more when it queued behind others)
        assert gs["kv_transfer_s"] >= usage["prompt_tokens"] * KV_BYTES_PER_TOKEN / 1e9 * 0.99


def test_the_stream_pauses_for_the_kv_transfer_after_the_first_token(pd_url):
    arrivals = []
    summary = None
    with httpx.stream("POST", pd_url + "/v1/completions", timeout=120,
                      json=body(1000, 12, stream=True)) as response:
        assert response.status_code == 200
        for chunk in sse_chunks(response):
            if "goodserve" in chunk:
                summary = chunk["goodserve"]
            else:
                arrivals.append(time.monotonic())
    assert summary is not None and summary["kv_loaded_tokens"] > 0
    transfer_s = summary["kv_transfer_s"]
    assert transfer_s >= summary["kv_loaded_tokens"] * KV_BYTES_PER_TOKEN / 1e9 * 0.99 > 0.1
    assert arrivals[1] - arrivals[0] >= transfer_s * 0.9  # TTFT of the decode stage


def test_a_decoding_request_moves_to_the_other_decode_engine_by_token_ids(pd_url):
    """The watchdog's and the operator's move, in disaggregated mode: between decode
    engines, by token ids, one uninterrupted stream."""
    arrivals, summary, moved_to = [], None, None
    with httpx.stream("POST", pd_url + "/v1/completions", timeout=120,
                      json=body(40, 150, stream=True, slo_s=60.0)) as response:
        for chunk in sse_chunks(response):
            if "goodserve" in chunk:
                summary = chunk["goodserve"]
                continue
            arrivals.append(chunk)
            if len(arrivals) == 4:
                move = httpx.post(pd_url + "/admin/migrate", timeout=30,
                                  json={"request_id": chunk["id"].removeprefix("cmpl-")})
                assert move.status_code == 200, move.text
                moved_to = move.json()["target"]
    assert summary is not None and summary["num_migrations"] == 1
    assert moved_to.startswith("live-pd-decode-")
    assert summary["instance_ids"] == [summary["instance_ids"][0], moved_to]
    assert summary["instance_ids"][0].startswith("live-pd-decode-")
    assert summary["decode_instance"] == moved_to
