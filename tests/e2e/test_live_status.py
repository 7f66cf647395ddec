"""The live router learns p_g from a real vLLM CPU engine's reports."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import ray

from app.engines.messages import SamplingSpec
from app.routing.registry import build_routing
from app.routing.status import StatusEstimator
from app.serving.flight import GenerationRequest
from app.serving.live_router import LiveRouter
from deployments.cluster import EngineHandle
from deployments.router import ActorEngineClient

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 8
PROMPT_LEN = 400


def learned_p_g(router: LiveRouter, estimator: StatusEstimator, engine_id: str) -> float:
    """p_g as the policy would use it for a request joining the busy instance."""
    view = router.view(router.clock()).get(engine_id)
    return estimator.estimate(replace(view, num_running=1)).prefill_s_per_token


async def _serve_one(router: LiveRouter, i: int) -> float:
    """Run one request to the end; returns its time to first token per prompt token."""
    prompt = tuple((7 * i + 13 * k) % 2000 + 2 for k in range(PROMPT_LEN))
    sent_s = time.time()
    flight = await router.submit(GenerationRequest(
        f"p-g-{i}", prompt, SamplingSpec(max_tokens=4, ignore_eos=True), arrival_s=sent_s,
    ))
    first_s = None
    async for _batch in router.stream(flight):
        first_s = first_s or time.time()
    return (first_s - sent_s) / PROMPT_LEN


def test_router_p_g_moves_from_its_prior_to_the_engines_prefill_time(vllm_engine):
    """The router is told the engine is a V100, so its prior p_g is ~1000x too fast for
    a CPU; after a few prompts p_g must match what the engine measured instead.

    The engine is shared with other tests: its first report carries their prefill
    work (grammar compiles included), which the router takes as the baseline only and
    does not learn from."""
    handle = EngineHandle(vllm_engine.engine_id,
                          vllm_engine.config.model_copy(update={"gpu_type": "V100"}),
                          vllm_engine.actor)

    async def run():
        router = LiveRouter([ActorEngineClient(handle)], build_routing("goodserve"),
                            poll_interval_s=0.05)
        estimator = router.policy.status
        await router.start()
        try:
            before = ray.get(handle.actor.status.remote()).prefill
            client_per_token = [await _serve_one(router, i) for i in range(NUM_REQUESTS)]
            await router.poll_once()
            work = ray.get(handle.actor.status.remote()).prefill.since(before)
            return learned_p_g(router, estimator, handle.engine_id), work, client_per_token
        finally:
            router.close()

    prior = handle.config.instance.unloaded_prefill_s_per_token
    learned, work, client_per_token = asyncio.run(run())
    assert work.num_iterations >= NUM_REQUESTS // 2 and work.num_tokens >= PROMPT_LEN
    measured = work.busy_s / work.num_tokens
    # the engine's own figure is bounded by what a client sees (TTFT includes transport)
    assert 0 < measured <= max(client_per_token) * 1.5
    # moved from the prior to the engine's speed (within the EMA's recency and the
    # load other processes put on a shared CPU)
    assert learned > 10 * prior
    assert measured / 3 < learned < measured * 3
