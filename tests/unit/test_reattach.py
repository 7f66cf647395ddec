"""Request ids, resumable streams and re-attaching a request on another router replica
(app/serving/replies.py, app/engines/journal.py, `LiveRouter.reattach`): two services
over the same journal-backed engines stand for two router replicas."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from app.engines.journal import OutputJournal
from app.engines.messages import EngineRequest, SamplingSpec
from app.serving.api import ApiError
from app.serving.instances import EngineClient
from app.serving.replies import ReplyLog, client_request_id, last_event_id
from app.serving.reply_writing import sse_data
from app.serving.service import CompletionService, JsonReply
from tests.unit.test_live_router import PROMPT, ScriptedEngine, sim_service

pytestmark = pytest.mark.unit


class JournalEngine(EngineClient):
    """A scripted engine behind an output journal, as an engine actor runs one."""

    def __init__(self, engine: ScriptedEngine, grace_s: float = 60.0) -> None:
        super().__init__(engine.engine_id, engine.config)
        self.engine = engine
        self.journal = OutputJournal(engine, detached_grace_s=grace_s)  # type: ignore[arg-type]

    def generate(self, request):
        return self.journal.generate(request)

    def read(self, request_id, from_index):
        return self.journal.read(request_id, from_index)

    async def find(self, request_id):
        return self.journal.find(request_id)

    async def abort(self, request_id):
        return await self.journal.abort(request_id)

    async def status(self):
        return await self.engine.status()


SSE = {"accept": "text/event-stream"}  # a client that reads SSE ids

def body(**fields) -> bytes:
    return json.dumps({"model": "goodserve", "prompt": "a b c d", "max_tokens": 30,
                       "temperature": 0} | fields).encode()


async def events(reply) -> list[str]:
    return [event async for event in reply]


async def first_events(reply, num_events: int) -> list[str]:
    """The stream's events up to the first with an id after `num_events` events."""
    seen = []
    async for event in reply:
        seen.append(event)
        if event.startswith("id: ") and len(seen) >= num_events:
            break
    return seen


def text_of(stream_events: list[str]) -> tuple[str, list[int]]:
    """The streamed text and every event id."""
    text, ids = "", []
    for event in stream_events:
        if event.startswith("id: "):
            ids.append(int(event.split("\n")[0].removeprefix("id: ")))
        data = sse_data(event)
        if data != "[DONE]":
            text += "".join(c["text"] for c in json.loads(data)["choices"])
    return text, ids


# ---- ids ------------------------------------------------------------------------------
def test_the_request_id_is_the_clients_header_else_its_idempotency_key():
    assert client_request_id({"x-request-id": "a-1", "idempotency-key": "b"}) == "a-1"
    assert client_request_id({"idempotency-key": "key_2"}) == "key_2"
    assert client_request_id({}) is None
    for bad in ("", "a" * 129, "a b", "a.b", "a@1", "é"):
        with pytest.raises(ApiError, match="letters, digits"):
            client_request_id({"x-request-id": bad})
    assert last_event_id({"last-event-id": "12"}) == 12
    assert last_event_id({}) is None
    with pytest.raises(ApiError, match="count of tokens"):
        last_event_id({"last-event-id": "-3"})


async def test_a_reply_log_resumes_after_the_last_event_a_client_holds():
    log = ReplyLog("r", streamed=True)
    for offset, text in [(None, "open"), (2, "a"), (5, "b"), (None, "last"), (None, "done")]:
        log.append(offset, text)
    log.end()
    assert [e async for e in log.read(None)] == ["open", "a", "b", "last", "done"]
    assert [e async for e in log.read(2)] == ["b", "last", "done"]
    assert [e async for e in log.read(5)] == ["last", "done"]


# ---- the engine's journal -------------------------------------------------------------
async def test_the_journal_generates_on_without_a_reader_and_replays_to_a_second():
    engine = ScriptedEngine("e", "A40", step_s=0.001)
    journal = OutputJournal(engine)  # type: ignore[arg-type]
    first = journal.generate(EngineRequest("r", PROMPT, SamplingSpec(max_tokens=20)))
    assert len(await anext(first)) >= 1
    await first.aclose()  # the caller went away without an abort
    await asyncio.sleep(0.1)
    (record,) = journal.find("r")
    assert record.finished and len(record.events) == 20 and engine.aborted == []
    later = [ev async for batch in journal.read("r", 7) for ev in batch]
    assert [ev.index for ev in later] == list(range(7, 20))


async def test_the_journal_aborts_a_submission_nobody_reads_after_the_grace():
    engine = ScriptedEngine("e", "A40", step_s=0.005)
    journal = OutputJournal(engine, detached_grace_s=0.02)  # type: ignore[arg-type]
    first = journal.generate(EngineRequest("r@1", PROMPT, SamplingSpec(max_tokens=500)))
    await anext(first)
    await first.aclose()
    await asyncio.sleep(0.2)
    assert engine.aborted == ["r@1"]
    (record,) = journal.find("r")
    assert record.ended and record.aborted and record.attempt == 1


async def test_a_poll_sends_the_first_tokens_at_once_then_a_windows_worth():
    journal = OutputJournal(ScriptedEngine("e", "A40", step_s=0.01))  # type: ignore[arg-type]
    batches = [b async for b in journal.generate(
        EngineRequest("r", PROMPT, SamplingSpec(max_tokens=10)), linger_s=0.035)]
    assert len(batches[0]) == 1 and [ev.index for b in batches for ev in b] == list(range(10))
    assert 2 < len(batches) < 10  # merged, but not all into one
    unmerged = [b async for b in OutputJournal(ScriptedEngine("e", "A40")).generate(  # type: ignore[arg-type]
        EngineRequest("r", PROMPT, SamplingSpec(max_tokens=4)))]
    assert [len(b) for b in unmerged] == [1, 1, 1, 1]


async def test_a_poll_gives_every_token_before_the_engines_error_then_the_error():
    journal = OutputJournal(ScriptedEngine("e", "A40", step_s=0.001, fail_at=3))  # type: ignore[arg-type]
    journal.start(EngineRequest("r", PROMPT, SamplingSpec(max_tokens=10)))
    await asyncio.sleep(0.05)
    tokens, complete = await journal.poll("r", 1)
    assert [ev.index for ev in tokens] == [1, 2] and not complete
    with pytest.raises(RuntimeError, match="engine process died"):
        await journal.poll("r", 3)
    with pytest.raises(KeyError):
        await journal.poll("other", 0)


async def test_a_submission_polled_within_the_grace_runs_on():
    engine = ScriptedEngine("e", "A40", step_s=0.005)
    journal = OutputJournal(engine, detached_grace_s=0.05)  # type: ignore[arg-type]
    journal.start(EngineRequest("r", PROMPT, SamplingSpec(max_tokens=60)))
    index = 0
    while True:  # a slow reader, each poll well within the grace of the last
        await asyncio.sleep(0.03)
        tokens, complete = await journal.poll("r", index)
        index = tokens[-1].index + 1 if tokens else index
        if complete:
            break
    assert index == 60 and engine.aborted == []


async def test_the_journal_forgets_ended_submissions_after_retain_s():
    journal = OutputJournal(ScriptedEngine("e", "A40", step_s=0.0), retain_s=0.0)  # type: ignore[arg-type]
    assert len([b async for b in journal.generate(
        EngineRequest("r", PROMPT, SamplingSpec(max_tokens=3)))]) == 3
    await asyncio.sleep(0)
    assert journal.find("r") == []


# ---- one replica: ids, whole replies and resumed streams ------------------------------
async def test_every_reply_names_its_request_and_a_bad_id_is_a_clear_400():
    service = sim_service(ScriptedEngine("e", "A40"))
    reply = await service.complete(body(max_tokens=3), chat=False)
    assert isinstance(reply, JsonReply) and reply.headers["X-Request-Id"]
    assert reply.body["id"] == f"cmpl-{reply.headers['X-Request-Id']}"
    named = await service.complete(body(max_tokens=3), chat=False,
                                   headers={"x-request-id": "mine"})
    assert named.headers["X-Request-Id"] == "mine" and named.body["id"] == "cmpl-mine"
    stream = await service.complete(body(max_tokens=3, stream=True), chat=False,
                                    headers={"idempotency-key": "key"})
    assert stream.headers["X-Request-Id"] == "key"
    await events(stream)
    bad = await service.complete(body(), chat=False, headers={"x-request-id": "a b"})
    assert bad.status_code == 400 and bad.body["error"]["param"] == "x-request-id"


async def test_a_whole_request_sent_twice_with_its_id_runs_once():
    engine = ScriptedEngine("e", "A40")
    service = sim_service(engine)
    headers = {"x-request-id": "twice"}
    first, second = await asyncio.gather(
        service.complete(body(), chat=False, headers=headers),
        service.complete(body(), chat=False, headers=headers))
    again = await service.complete(body(), chat=False, headers=headers)
    assert first.body == second.body == again.body and first.status_code == 200
    assert [r.request_id for r in engine.received] == ["twice"]
    conflict = await service.complete(body(stream=True), chat=False, headers=headers)
    assert conflict.status_code == 409


async def test_stream_events_count_tokens_and_a_reconnect_gets_the_rest_once():
    """Events carry ids when the client names its request (only it can resume): a
    request without an id gets plain `data:` events, which every SSE client parses."""
    service = sim_service(ScriptedEngine("e", "A40"))
    whole, ids = text_of(await events(await service.complete(
        body(stream=True), chat=False, headers={"x-request-id": "w", **SSE})))
    assert ids == sorted(set(ids)) and ids[-1] == 30  # one id per token chunk, rising
    plain, no_ids = text_of(await events(await service.complete(body(stream=True), chat=False)))
    assert plain == whole and no_ids == []
    # vLLM's benchmark names each request but reads only `data:` lines
    named, named_ids = text_of(await events(await service.complete(
        body(stream=True), chat=False, headers={"x-request-id": "v"})))
    assert named == whole and named_ids == []
    cut = await service.complete(body(stream=True), chat=False,
                               headers={"x-request-id": "s", **SSE})
    seen = await first_events(cut, 3)
    await cut.events.aclose()  # the connection dropped
    head, head_ids = text_of(seen)
    rest = await service.complete(body(stream=True), chat=False, headers={
        "x-request-id": "s", "last-event-id": str(head_ids[-1]), **SSE})
    tail, tail_ids = text_of(await events(rest))
    assert head + tail == whole and tail_ids[0] > head_ids[-1]


# ---- two replicas over the same engines -----------------------------------------------
def replicas(engine: JournalEngine) -> tuple[CompletionService, CompletionService]:
    return sim_service(engine), sim_service(engine)  # type: ignore[arg-type]


def die(service: CompletionService) -> None:
    """A replica's process dies: its tasks stop, and it aborts nothing on the way."""
    service.router.background.abort = lambda flight: None  # type: ignore[method-assign]
    for log in service.replies.logs.values():
        if log.producer is not None:
            log.producer.cancel()
    service.close()


async def stream_cut_by_its_replica(request_id: str
                                    ) -> tuple[JournalEngine, CompletionService, list[str]]:
    """A stream named `request_id` whose replica dies four events in: the engine, the
    other replica (over the same engine) and the events the client holds."""
    engine = JournalEngine(ScriptedEngine("e", "A40", step_s=0.003))
    a, b = replicas(engine)
    stream = await a.complete(body(stream=True), chat=False,
                              headers={"x-request-id": request_id, **SSE})
    seen = await first_events(stream, 4)
    die(a)
    return engine, b, seen


async def test_another_replica_reattaches_a_stream_whose_replica_died():
    reference = sim_service(ScriptedEngine("e", "A40", step_s=0.0))
    whole, _ = text_of(await events(await reference.complete(body(stream=True), chat=False)))
    engine, b, seen = await stream_cut_by_its_replica("k")
    head, head_ids = text_of(seen)
    rest = await b.complete(body(stream=True), chat=False, headers={
        "x-request-id": "k", "last-event-id": str(head_ids[-1]), **SSE})
    tail, tail_ids = text_of(await events(rest))
    assert head + tail == whole and tail_ids[0] > head_ids[-1]
    assert [r.request_id for r in engine.engine.received] == ["k"]  # run once
    assert b.router.counters().num_reattached == 1


async def test_a_whole_request_retried_on_another_replica_after_it_finished_runs_once():
    engine = JournalEngine(ScriptedEngine("e", "A40"))
    a, b = replicas(engine)
    first = await a.complete(body(), chat=False, headers={"x-request-id": "done"})
    retry = await b.complete(body(), chat=False, headers={"x-request-id": "done"})
    assert retry.status_code == 200
    assert retry.body["choices"][0]["text"] == first.body["choices"][0]["text"]
    assert [r.request_id for r in engine.engine.received] == ["done"]
    other = await b.complete(body(prompt="another prompt"), chat=False,
                             headers={"x-request-id": "done"})
    assert other.status_code == 409  # kept by b now: a different request under the id


async def test_a_request_aborted_mid_way_continues_from_its_tokens_on_a_retry():
    """Its client left and the replica aborted it: the engine keeps the tokens made, and
    a retry elsewhere continues from them by token ids, not from the start."""
    engine = JournalEngine(ScriptedEngine("e", "A40", step_s=0.003))
    reference = sim_service(ScriptedEngine("e", "A40", step_s=0.0))
    whole = (await reference.complete(body(), chat=False)).body["choices"][0]["text"]
    a, b = replicas(engine)
    await first_events(await a.complete(body(stream=True), chat=False,
                                        headers={"x-request-id": "c", **SSE}), 1)
    await asyncio.sleep(0.02)
    for log in a.replies.logs.values():
        log.producer.cancel()  # no reader came back: the generation is aborted
    await asyncio.sleep(0.02)
    assert engine.engine.aborted == ["c"]
    retry = await b.complete(body(), chat=False, headers={"x-request-id": "c"})
    assert retry.body["choices"][0]["text"] == whole
    first, resumed = engine.engine.received
    assert resumed.request_id == "c@1" and len(resumed.resume_token_ids) > 0


async def test_an_engine_that_does_not_say_whether_it_runs_a_request_gets_it_no_second_run():
    """A retry whose look-up an engine leaves unanswered (a busy actor) is a 503 to
    retry, never a fresh run beside the one that engine may hold; a dead engine holds
    nothing."""
    engine, b, seen = await stream_cut_by_its_replica("slow")
    _, head_ids = text_of(seen)

    async def silent(request_id):
        await asyncio.sleep(3600)

    engine.find = silent  # type: ignore[method-assign]
    b.router.find = functools.partial(b.router.find, timeout_s=0.05)  # type: ignore[method-assign]
    retry = await b.complete(body(stream=True), chat=False, headers={
        "x-request-id": "slow", "last-event-id": str(head_ids[-1]), **SSE})
    assert isinstance(retry, JsonReply) and retry.status_code == 503
    assert "did not say" in retry.body["error"]["message"]
    assert [r.request_id for r in engine.engine.received] == ["slow"]  # never started again

    async def dead(request_id):
        raise RuntimeError("the actor died")

    engine.find = dead  # type: ignore[method-assign]
    assert await b.router.find("slow") is None


async def test_a_named_request_read_from_http_is_looked_up_while_its_body_is_read():
    """Given a body still to read (HTTP), the engines are asked about the client's id
    first, so their answer comes while the body is read; a retry on another replica is
    re-attached as from the bytes, and a fresh id is placed as usual."""
    engine = JournalEngine(ScriptedEngine("e", "A40"))
    a, b = replicas(engine)
    first = await a.complete(body(), chat=False, headers={"x-request-id": "early"})
    find, asked = engine.find, []

    async def recording_find(request_id):
        asked.append(request_id)
        return await find(request_id)

    engine.find = recording_find  # type: ignore[method-assign]

    async def read() -> bytes:
        await asyncio.sleep(0.01)
        assert asked == ["early"]  # asked before the body came
        return body()

    async def read_fresh() -> bytes:
        return body()

    retry = await b.complete(read, chat=False, headers={"x-request-id": "early"})
    assert retry.body["choices"][0]["text"] == first.body["choices"][0]["text"]
    assert [r.request_id for r in engine.engine.received] == ["early"]  # run once
    fresh = await b.complete(read_fresh, chat=False, headers={"x-request-id": "fresh"})
    assert fresh.status_code == 200 and asked == ["early", "fresh"]


async def test_a_named_request_is_predicted_while_the_engines_answer_its_look_up():
    engine = JournalEngine(ScriptedEngine("e", "A40"))
    service = sim_service(engine)  # type: ignore[arg-type]
    order = []

    async def slow_find(request_id):
        await asyncio.sleep(0.02)
        order.append("answered")
        return []

    async def predict(route):
        order.append("predicted")
        return 3.0

    engine.find = slow_find  # type: ignore[method-assign]
    service.router.predict = predict
    reply = await service.complete(body(), chat=False, headers={"x-request-id": "p"})
    assert reply.status_code == 200 and order == ["predicted", "answered"]
    assert reply.body["goodserve"]["predicted_output_tokens"] == 3
