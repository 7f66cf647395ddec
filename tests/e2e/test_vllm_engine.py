"""A real vLLM CPU engine actor on the locally built tiny Llama."""

from __future__ import annotations

import asyncio

import pytest
import ray

from app.engines.messages import EngineRequest, SamplingSpec
from deployments.cluster import collect_tokens

pytestmark = pytest.mark.e2e

PROMPT = [5, 17, 33, 101, 256, 999, 1500, 42, 7, 64, 300, 12, 77, 1024, 8, 9] * 3


def greedy(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_generates_streamed_timestamped_tokens(vllm_engine):
    events = asyncio.run(collect_tokens(vllm_engine, EngineRequest("gen-1", PROMPT, greedy(24))))
    assert [e.index for e in events] == list(range(24))
    assert events[-1].finish_reason == "length"
    assert all(a.time_s <= b.time_s for a, b in zip(events, events[1:], strict=False))


@pytest.mark.parametrize("k", [1, 9, 23])
def test_token_id_resume_reproduces_uninterrupted_greedy_run(vllm_engine, k):
    async def run():
        full = await collect_tokens(vllm_engine, EngineRequest(f"full-{k}", PROMPT, greedy(24)))
        ids = [e.token_id for e in full]
        resumed = await collect_tokens(
            vllm_engine,
            EngineRequest(f"resume-{k}", PROMPT, greedy(24), resume_token_ids=ids[:k]),
        )
        return ids, resumed

    ids, resumed = asyncio.run(run())
    assert [e.token_id for e in resumed] == ids[k:]
    assert [e.index for e in resumed] == list(range(k, 24))


def test_status_reports_black_box_figures(vllm_engine):
    asyncio.run(collect_tokens(vllm_engine, EngineRequest("stat-1", PROMPT, greedy(16))))
    status = ray.get(vllm_engine.actor.status.remote())
    assert status.gpu_type == "cpu" and status.role == "unified"
    assert status.num_kv_blocks_free > 0
    assert len(status.recent_iteration_s) > 0 and all(t > 0 for t in status.recent_iteration_s)
    assert status.num_cached_prefix_blocks >= len(PROMPT) // 16
    assert status.kv_block_size == 128  # vLLM's own on CPUs, not the config's 16


def test_abort_ends_a_long_request(vllm_engine):
    async def run():
        task = asyncio.ensure_future(
            collect_tokens(vllm_engine, EngineRequest("long-1", PROMPT, greedy(1500)))
        )
        await asyncio.sleep(1.0)
        assert await vllm_engine.actor.abort.remote("long-1")
        return await asyncio.wait_for(task, timeout=60)

    events = asyncio.run(run())
    assert len(events) < 1500


def test_vllm_engine_metrics_reach_rays_prometheus_endpoint(vllm_engine, ray_metrics_url):
    """vLLM's own engine series (`vllm:*`, named `ray_vllm_*` by Ray) from the engine
    actors, through vLLM's Ray stat logger."""
    import time

    import httpx

    asyncio.run(collect_tokens(vllm_engine, EngineRequest("metrics-1", PROMPT, greedy(16))))
    deadline_s = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline_s:
        text = httpx.get(ray_metrics_url, timeout=30).text
        if ("ray_vllm_generation_tokens_total" in text
                and "ray_vllm_num_requests_running" in text):  # exported one by one
            break
        time.sleep(1.0)
    generated = [line for line in text.splitlines()
                 if line.startswith("ray_vllm_generation_tokens_total{")]
    assert generated and max(float(line.rsplit(" ", 1)[1]) for line in generated) >= 16
    assert "ray_vllm_num_requests_running" in text
