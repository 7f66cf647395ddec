"""Live replay: the same workloads as the simulator, sent over HTTP to the Serve router.

Each (policy, SLO scale) cell deploys the router with that policy on fresh engines
(so no cell inherits another's caches), sends every request at its arrival time and
scores what the client measured: a request meets its deadline when its response
arrived within its SLO of being sent. Prompts are sent as token ids that reproduce
the request's length and its shared prefixes (a block hash always becomes the same
ids), which is exact for simulated engines; vLLM engines serve them too.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from app.serving.config import RoutingConfig, ServeConfig
from app.sim.records import RequestOutcome, RequestRecord
from app.workloads.sessions import Release, StepReleases
from app.workloads.workload import Workload, WorkloadRequest

APP_NAME = "goodserve-replay"


def _ids(seed: bytes, count: int, vocab_size: int) -> list[int]:
    """`count` stable token ids in [2, vocab_size) derived from `seed`."""
    out: list[int] = []
    counter = 0
    while len(out) < count:
        digest = hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        out.extend(2 + int.from_bytes(digest[i:i + 4], "little") % (vocab_size - 2)
                   for i in range(0, 64, 4))
        counter += 1
    return out[:count]


def prompt_token_ids(request: WorkloadRequest, vocab_size: int) -> list[int]:
    """The request's prompt length in ids; hash block k always maps to the same ids."""
    ids: list[int] = []
    for h in request.block_hashes:
        ids.extend(_ids(h.to_bytes(8, "little", signed=h < 0), request.hash_block_size,
                        vocab_size))
    ids = ids[: request.num_prompt_tokens]
    tail = request.num_prompt_tokens - len(ids)
    return ids + _ids(request.request_id.encode(), tail, vocab_size)


def _new_record(request: WorkloadRequest) -> RequestRecord:
    """The request's record before anything came back."""
    return RequestRecord(
        request_id=request.request_id, arrival_s=request.arrival_s,
        deadline_s=request.deadline_s, slo_s=request.slo_s,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
    )


def _record(request: WorkloadRequest, sent_s: float, done_s: float,
            reply: httpx.Response | None, error: str | None) -> RequestRecord:
    record = _new_record(request)
    if reply is not None and reply.status_code == 200:
        data = reply.json()
        ext = data["goodserve"]
        record.finish_s = request.arrival_s + (done_s - sent_s)
        if ext.get("ttft_s") is not None:  # the router's, from its own arrival
            record.first_token_s = request.arrival_s + ext["ttft_s"]
        record.num_generated_tokens = data["usage"]["completion_tokens"]
        record.instance_ids = list(ext["instance_ids"])
        record.num_migrations = ext["num_migrations"]
        record.predicted_output_tokens = ext["predicted_output_tokens"]
    elif reply is not None and reply.status_code == 503:
        record.outcome = RequestOutcome.REJECTED
        record.reject_reason = reply.json()["error"]["message"]
    else:
        record.reject_reason = error or (reply.text[:200] if reply is not None else "no reply")
    record.outcome = record.decide()
    return record


def stop_time_s(workload: Workload, max_drain_s: float | None) -> float:
    """When a replay of `workload` stops, as the simulator stops: `max_drain_s` after
    its last arrival known in advance (inf: when every issued request has ended)."""
    if max_drain_s is None:
        return math.inf
    return workload.requests[-1].arrival_s + max_drain_s


async def drive(
    base_url: str,
    workload: Workload,
    model_name: str,
    vocab_size: int,
    timeout_s: float = 600.0,
    progress: Callable[[int], None] | None = None,
    stop_s: float = math.inf,
) -> list[RequestRecord]:
    """Send every request when it is issued: at its arrival time, or, for agent
    sessions, when the steps it waits for have come back plus its tool wait (a step
    whose parent failed is never sent). At `stop_s` (workload seconds) the replay ends
    as the simulator's does: requests still out count as unfinished, steps not yet sent
    as rejected. One record per request, in workload order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    releases = StepReleases(workload.requests, workload.graph)
    records: dict[int, RequestRecord] = {}

    def settle(index: int, record: RequestRecord) -> None:
        records[index] = record
        if progress is not None:
            progress(1)

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()
        tasks: set[asyncio.Task] = set()

        def issue(release: Release) -> None:
            if release.time_s > stop_s:  # left unreleased: settled when the run stops
                return
            task = asyncio.create_task(one(release))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def one(release: Release) -> None:
            await asyncio.sleep(max(0.0, start + release.time_s - time.monotonic()))
            following = releases.after_arrival(release.index)
            if following is not None:
                issue(following)
            request = releases.issued(release.index, time.monotonic() - start)
            try:
                record = await send(client, request, model_name, vocab_size)
            except asyncio.CancelledError:  # the run stopped with it out
                settle(release.index, _unfinished(request))
                raise
            settle(release.index, record)
            done_s = time.monotonic() - start
            ready, cancelled = releases.after_end(
                release.index, done_s, record.outcome != RequestOutcome.REJECTED
                and record.finish_s is not None)
            for index in cancelled:
                settle(index, _not_issued(workload.requests[index], done_s,
                                          f"session ended: {request.request_id} was not served"))
            for r in ready:
                issue(r)

        first = releases.first()
        if first is not None:
            issue(first)
        await _until(tasks, start + stop_s)
        now = time.monotonic() - start
        for index in releases.unreleased():
            settle(index, _not_issued(workload.requests[index], now,
                                      "not issued: the run stopped first"))
    return [records[i] for i in sorted(records)]


async def _until(tasks: set[asyncio.Task], stop_at: float) -> None:
    """Wait for `tasks`, and the tasks they start, until the monotonic time `stop_at`;
    then cancel what is left. A task's own error is raised."""
    while tasks:
        left_s = stop_at - time.monotonic()
        if left_s <= 0:
            break
        done, _ = await asyncio.wait(set(tasks), timeout=None if math.isinf(left_s) else left_s)
        for task in done:
            task.result()
    left = list(tasks)
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


async def send(client: httpx.AsyncClient, request: WorkloadRequest, model_name: str,
               vocab_size: int) -> RequestRecord:
    """One request as a completion; its record as the client measured it."""
    body: dict[str, Any] = {
        "model": model_name,
        "prompt": prompt_token_ids(request, vocab_size),
        "max_tokens": request.num_output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if math.isfinite(request.slo_s):
        body["slo_s"] = request.slo_s
    if request.task is not None:
        body["task"] = request.task
    if request.session_id is not None:
        body["session_id"] = request.session_id
        body["session_step"] = request.step_index
    sent = time.monotonic()
    reply, error = None, None
    try:
        reply = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return _record(request, sent, time.monotonic(), reply, error)


def _not_issued(request: WorkloadRequest, now: float, reason: str) -> RequestRecord:
    """A session step never sent (a step it waits for was not served, or the run
    stopped first): rejected at `now`."""
    record = _new_record(replace(request, arrival_s=now))
    record.outcome = RequestOutcome.REJECTED
    record.reject_reason = reason
    return record


def _unfinished(request: WorkloadRequest) -> RequestRecord:
    """A request still out when the run stopped: violated, as the simulator counts it."""
    record = _new_record(request)
    record.outcome = record.decide()
    return record


def live_cell(
    config: ServeConfig,
    workload: Workload,
    base_url: str,
    progress: Callable[[int], None] | None = None,
    stop_s: float = math.inf,
) -> tuple[list[RequestRecord], float]:
    """Deploy the router with `config` on fresh engines, replay until `stop_s`
    (`drive`), tear the engines down.

    Returns the records and the wall seconds of the replay.
    """
    from ray import serve

    from deployments.controller import stop_controller
    from deployments.router import build_app, wait_until_gone

    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    try:
        t0 = time.monotonic()
        vocab = config.engine_template.instance.model.vocab_size
        records = asyncio.run(drive(base_url, workload, config.served_model_names[0], vocab,
                                    progress=progress, stop_s=stop_s))
        return records, time.monotonic() - t0
    finally:
        serve.delete(APP_NAME)
        stop_controller(config.cluster.name)
        wait_until_gone(config)  # the next cell must not find this one's dying engines


def serve_config_for(base: ServeConfig, policy: str, **routing: Any) -> ServeConfig:
    """`base` routed by `policy` (plus routing overrides such as tau or alpha)."""
    return replace_model(base, routing=RoutingConfig(policy=policy, **routing))


def replace_model(model: Any, **fields: Any) -> Any:
    """A frozen pydantic model with some fields replaced (and validated again)."""
    return type(model).model_validate(model.model_dump() | fields)

