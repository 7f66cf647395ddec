"""The SARA controller live on agent sessions: sessions whose steps follow each other
after a short tool wait, each step's prompt extending the last one's prompt and output,
start in a step load up then down on simulated engines over Ray Serve. Every step is
served, the pools grow for the step up and shrink after, and the controller's window
sees the sessions the routers served: their starts, and the context they park in tool
waits."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import serving
from tests.integration.test_live_autoscale import (
    RegistryLog,
    assert_grew_and_shrank,
    controller_of,
    elastic_config,
    send_offsets,
    settle,
)

pytestmark = pytest.mark.integration

PROMPT = "route me " * 50
TOOL_RESULT = " tool says ok" * 5  # what a step appends after the last one's output
MAX_TOKENS = 32
STEPS_PER_SESSION = 3
TOOL_WAIT_S = 0.3
SESSION_STEP = ((1.2, 12.0), (0.2, 20.0))  # (sessions/s, seconds): step up, step down


async def run_session(client: httpx.AsyncClient, url: str, session_id: str) -> list:
    """One agent session, closed loop: (status, body) per step."""
    prompt, replies = f"{PROMPT}{session_id} asks:", []  # no session shares its context
    for step in range(STEPS_PER_SESSION):
        if step:
            await asyncio.sleep(TOOL_WAIT_S)
        reply = await client.post(url + "/v1/completions", json={
            "model": "goodserve", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "session_id": session_id})
        body = reply.json()
        replies.append((reply.status_code, body))
        if reply.status_code != 200:
            break
        prompt += body["choices"][0]["text"] + TOOL_RESULT
    return replies


async def drive_sessions(url: str, phases) -> dict[str, list]:
    """Start sessions at each phase's rate; each session's steps by session id."""
    async with httpx.AsyncClient(timeout=120) as client:
        tasks: dict[str, asyncio.Future] = {}
        start = time.monotonic()
        for due_s in send_offsets(phases):
            await asyncio.sleep(max(start + due_s - time.monotonic(), 0.0))
            session_id = f"agent-{len(tasks)}"
            tasks[session_id] = asyncio.ensure_future(run_session(client, url, session_id))
        replies = await asyncio.gather(*tasks.values())
        return dict(zip(tasks, replies, strict=True))


def windows_after(controller, done_s: float, timeout_s: float = 30.0) -> list[dict]:
    """What the controller's decisions saw of sessions, once one window has started
    after `done_s`."""
    import ray

    deadline_s = time.monotonic() + timeout_s
    while True:
        seen = ray.get(controller.sessions.remote(), timeout=30)
        if any(w["time_s"] >= done_s for w in seen[:-1]) or time.monotonic() > deadline_s:
            return seen
        time.sleep(0.5)


def test_agent_sessions_grow_and_shrink_the_pools_and_reach_the_controller(ray_session):
    with serving(elastic_config("elastic-sessions"), "elastic-sessions") as url:
        controller = controller_of("elastic-sessions")
        with RegistryLog(controller) as log:
            sessions = asyncio.run(drive_sessions(url, SESSION_STEP))
            done_s = time.time()  # every step has ended
            status = settle(controller)
        seen = windows_after(controller, done_s)
    steps = [step for replies in sessions.values() for step in replies]
    failed = [(code, body) for code, body in steps if code != 200]
    assert not failed, failed[:3]
    assert len(steps) == len(sessions) * STEPS_PER_SESSION
    assert all(body["usage"]["completion_tokens"] == MAX_TOKENS for _, body in steps)
    assert_grew_and_shrank(log, status)
    # the window saw every session start once
    assert sum(window["starts"] for window in seen) == len(sessions)
    # completions offer no tool, so no answer is a final one that ends its session: all
    # stay open in their tool waits, each holding its last step's prompt + output, over the
    # whole of a window that started after the last step ended
    last = seen[-1]
    assert last["open"] == len(sessions)
    held = sum(replies[-1][1]["usage"]["total_tokens"] for replies in sessions.values())
    assert last["held_kv_tokens"] == pytest.approx(held)
    # a later step's prompt is cached where its session ran before, but for what it
    # appended (the last output and the tool's result): the tokens computed are well
    # below the prompt
    prompts = [body["usage"]["prompt_tokens"] for _, body in steps]
    uncached = [w["uncached_len"] for w in seen if w["uncached_len"] is not None]
    assert uncached and min(uncached) < 0.5 * sum(prompts) / len(prompts)

