"""The live replay client without Ray: replies from a mock transport, sends replaced by
sleeps (the HTTP round trip through the Serve router is the integration test's)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.experiments import live_replay
from app.experiments.live_replay import drive, send, stop_time_s
from app.sim.records import RequestOutcome, RequestRecord
from app.workloads.sessions import AgentSession, AgentStep, sessions_workload
from app.workloads.workload import WorkloadRequest

pytestmark = pytest.mark.unit


def completion(ttft_s: float | None) -> httpx.Response:
    """A 200 completion whose `goodserve` extension reports `ttft_s`."""
    return httpx.Response(200, json={
        "usage": {"completion_tokens": 8},
        "goodserve": {"instance_ids": ["e"], "num_migrations": 0,
                      "predicted_output_tokens": 8, "ttft_s": ttft_s},
    })


@pytest.mark.parametrize("ttft_s", [0.25, None])
async def test_a_reply_s_first_token_time_counts_from_the_request_s_arrival(ttft_s):
    transport = httpx.MockTransport(lambda _: completion(ttft_s))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        record = await send(client, WorkloadRequest("r", 3.0, 40, 8), "m", vocab_size=1000)
    assert record.outcome is RequestOutcome.MET and record.finish_s is not None
    assert record.first_token_s == (None if ttft_s is None else 3.25)


def sleeping_send(seconds: dict[str, float]):
    """A `send` that takes `seconds[request id]` (default 10 ms) and finishes."""
    async def fake(client, request: WorkloadRequest, model_name: str,
                   vocab_size: int) -> RequestRecord:
        took_s = seconds.get(request.request_id, 0.01)
        await asyncio.sleep(took_s)
        record = RequestRecord(request.request_id, request.arrival_s, request.deadline_s,
                               request.slo_s, request.num_prompt_tokens,
                               request.num_output_tokens,
                               num_generated_tokens=request.num_output_tokens,
                               finish_s=request.arrival_s + took_s)
        record.outcome = record.decide()
        return record
    return fake


async def test_a_replay_stops_its_drain_as_the_simulator_does(monkeypatch):
    """Past the last arrival plus the drain, nothing more is sent: a step still out is
    unfinished (violated), steps not yet sent are rejected, and the replay returns
    without waiting for them."""
    def step(step_id: str, wait_for: tuple[str, ...] = (), tool_wait_s: float = 0.0
             ) -> AgentStep:
        return AgentStep(step_id, wait_for, tool_wait_s, 64, 64, 8, (), 16)

    workload = sessions_workload([
        AgentSession("a", 0.0, (step("0"), step("1", ("0",)), step("2", ("1",)))),
        AgentSession("b", 0.1, (step("0"), step("1", ("0",), tool_wait_s=5.0))),
    ], 0.2, "two sessions")
    monkeypatch.setattr(live_replay, "send", sleeping_send({"a/1": 30.0}))
    settled: list[int] = []
    started = time.monotonic()
    records = await drive("http://unused", workload, "m", 1000, progress=settled.append,
                          stop_s=stop_time_s(workload, max_drain_s=0.5))
    assert time.monotonic() - started < 10.0  # a/1 alone would take 30 s
    outcome = {r.request_id: r.outcome for r in records}
    assert outcome == {"a/0": RequestOutcome.MET, "a/1": RequestOutcome.VIOLATED,
                       "a/2": RequestOutcome.REJECTED, "b/0": RequestOutcome.MET,
                       "b/1": RequestOutcome.REJECTED}
    assert [r.request_id for r in records] == [r.request_id for r in workload.requests]
    unsent = [r for r in records if r.outcome is RequestOutcome.REJECTED]
    assert {r.reject_reason for r in unsent} == {"not issued: the run stopped first"}
    assert all(r.arrival_s >= 0.6 for r in unsent)  # counted when the run stopped
    assert records[1].finish_s is None and sum(settled) == len(workload)
