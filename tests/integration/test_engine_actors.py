"""Sim engine actors pinned to four GPU kinds on a local Ray cluster."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.engines.messages import EngineRequest, SamplingSpec
from deployments.cluster import collect_tokens, launch_cluster, shutdown_engines

pytestmark = pytest.mark.integration

GPU_SETUP = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
TIME_SCALE = 2.0  # each iteration sleeps twice its modelled time


@pytest.fixture(scope="module")
def sim_engines(ray_session):
    cluster = ClusterConfig(
        name="it",
        groups=[
            InstanceGroup(engine=EngineConfig(
                gpu_type=g, tp=tp, time_scale=TIME_SCALE, scheduler=SchedulerConfig()))
            for g, tp in GPU_SETUP
        ],
    )
    handles = launch_cluster(cluster)
    yield handles
    shutdown_engines(handles)


def test_engines_hold_their_gpu_kind_resource(ray_session, sim_engines):
    from tests.conftest import LOCAL_GPU_RESOURCES

    available = ray_session.available_resources()
    for gpu, tp in GPU_SETUP:  # one unit per GPU: the 2xV100 engine holds two
        key = f"gpu_type:{gpu}"
        assert available.get(key, 0.0) == LOCAL_GPU_RESOURCES[key] - tp


async def _timed(handle, request):
    sent = time.time()
    events = await collect_tokens(handle, request)
    return events, events[-1].time_s - sent


def test_same_request_speed_follows_hardware_model(ray_session, sim_engines):
    """Each engine steps the request for the time its GPU kind's hardware model gives, as
    its own iteration times report it, and takes at least that long (x time_scale) on
    the wall clock. Other work on the machine can only make the wall time longer, so
    nothing here compares wall times with each other."""
    prompt, max_tokens = list(range(1, 1025)), 24  # one iteration a token, all reported

    async def run_all():
        jobs = []
        for h in sim_engines:
            req = EngineRequest(f"speed-{h.engine_id}", prompt, SamplingSpec(max_tokens=max_tokens))
            jobs.append(_timed(h, req))
        return await asyncio.gather(*jobs)

    before = ray_session.get([h.actor.status.remote() for h in sim_engines])
    results = asyncio.run(run_all())
    after = ray_session.get([h.actor.status.remote() for h in sim_engines])
    stepped_s = {}
    for h, old, new, (events, wall_s) in zip(sim_engines, before, after, results, strict=True):
        assert len(events) == max_tokens
        # one iteration a token, and they are the engine's last ones; an iteration that
        # was under way for a request another test aborted may finish just before them
        num_steps = new.num_iterations - old.num_iterations
        assert max_tokens <= num_steps <= max_tokens + 1, num_steps
        assert max_tokens <= len(new.recent_iteration_s)
        gpu = h.config.gpu_type
        stepped_s[gpu] = sum(new.recent_iteration_s[-max_tokens:])
        # the prompt's prefix may be cached from another test's request on this engine
        predicted = h.config.instance.solo_latency_s(
            len(prompt), max_tokens, h.config.scheduler.max_num_batched_tokens,
            num_cached_tokens=events[0].num_cached_tokens or 0)
        assert stepped_s[gpu] == pytest.approx(predicted, rel=1e-3), gpu
        assert wall_s >= 0.99 * TIME_SCALE * stepped_s[gpu], gpu  # it slept them
    assert min(stepped_s, key=stepped_s.get) == "H800"
    assert max(stepped_s, key=stepped_s.get) in ("A40", "V100")


def test_resume_on_another_engine_continues_the_same_tokens(sim_engines):
    h800, a40 = sim_engines[0], sim_engines[2]
    prompt = list(range(50, 300))

    async def run():
        request = EngineRequest("full", prompt, SamplingSpec(max_tokens=20))
        full = await collect_tokens(h800, request)
        ids = [e.token_id for e in full]
        rest = await collect_tokens(
            a40,
            EngineRequest("rest", prompt, SamplingSpec(max_tokens=20), resume_token_ids=ids[:8]),
        )
        return ids, rest

    ids, rest = asyncio.run(run())
    assert [e.token_id for e in rest] == ids[8:]
    assert [e.index for e in rest] == list(range(8, 20))


def test_abort_stops_the_stream(sim_engines):
    import ray

    handle = sim_engines[2]
    prompt = list(range(1, 100))

    async def run():
        task = asyncio.ensure_future(
            collect_tokens(handle, EngineRequest("to-abort", prompt, SamplingSpec(max_tokens=5000)))
        )
        await asyncio.sleep(0.5)
        aborted = await handle.actor.abort.remote("to-abort")
        events = await asyncio.wait_for(task, timeout=30)
        return aborted, events

    aborted, events = asyncio.run(run())
    assert aborted and 0 < len(events) < 5000
    status = ray.get(handle.actor.status.remote())
    assert status.num_running == 0 and status.num_waiting == 0
