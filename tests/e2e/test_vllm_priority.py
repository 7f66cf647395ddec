"""A real vLLM CPU engine in priority mode serves waiting requests by priority."""

from __future__ import annotations

import asyncio

import pytest

from app.engines.config import EngineBackend, EngineConfig, SchedulerConfig
from app.engines.messages import EngineRequest, SamplingSpec, TokenEvent
from app.engines.vllm import VllmBackend

pytestmark = pytest.mark.e2e

PROMPT = [5, 17, 33, 101, 256, 999, 1500, 42, 7, 64, 300, 12, 77, 1024, 8, 9] * 3


async def collect(backend: VllmBackend, request: EngineRequest,
                  first: asyncio.Event | None = None) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    async for batch in backend.generate(request):
        events.extend(batch)
        if first is not None:
            first.set()
    return events


def test_the_lower_priority_value_runs_first_though_it_came_later(tiny_model_dir):
    """One batch slot, held by a long request: `b` (priority 5) then `c` (priority 1)
    wait; vLLM runs `c` to its end before `b` starts."""
    config = EngineConfig(
        gpu_type="cpu", model="tiny-llama", backend=EngineBackend.VLLM,
        model_path=str(tiny_model_dir),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=2048,
                                  scheduling_policy="priority"))
    greedy = SamplingSpec(max_tokens=32, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[TokenEvent], list[TokenEvent]]:
        backend = VllmBackend("prio-0", config)
        await backend.start()
        try:
            running = asyncio.Event()
            busy = asyncio.ensure_future(collect(backend, EngineRequest(
                "busy", PROMPT, SamplingSpec(max_tokens=400, temperature=0.0,
                                             ignore_eos=True)), running))
            await asyncio.wait_for(running.wait(), 120)
            b = asyncio.ensure_future(collect(backend, EngineRequest("b", PROMPT, greedy,
                                                                     priority=5)))
            await asyncio.sleep(0.05)  # b reaches the engine first
            c = asyncio.ensure_future(collect(backend, EngineRequest("c", PROMPT, greedy,
                                                                     priority=1)))
            _, b_events, c_events = await asyncio.wait_for(asyncio.gather(busy, b, c), 300)
            return b_events, c_events
        finally:
            await backend.shutdown()

    b_events, c_events = asyncio.run(run())
    assert len(b_events) == len(c_events) == 32
    assert c_events[-1].time_s <= b_events[0].time_s
