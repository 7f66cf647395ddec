"""The OpenAI sampling surface without Ray: stop conditions on the router's text,
requests that cannot move by token ids, choices, usage and logprobs shapes.

Engines are the scripted transport of `test_live_router` (token i of a prompt is a
fixed function of (prompt, i)); real vLLM engines are compared with vLLM's own
OpenAI server in the e2e layer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence

import pytest

from app.engines.messages import (
    EngineRequest,
    SamplingSpec,
    StructuredOutput,
    TokenEvent,
    TokenLogprobs,
)
from app.serving.api import (
    NO_EFFECT_FIELDS,
    UNSUPPORTED_FIELDS,
    ApiError,
    CompletionRequest,
    parse_body,
)
from app.serving.flight import FlightState, GenerationRequest
from app.serving.kv_transfer import SimulatedLink
from app.serving.live_router import EngineLost
from app.serving.logprobs import LogprobsFormatter
from app.serving.reply_writing import sse_data
from app.serving.tokenizer import OutputText, Tokenizer
from tests.unit.test_live_router import (
    PROMPT,
    ScriptedEngine,
    Utf8Bytes,
    body,
    drain,
    pd_engines,
    sim_service,
    started,
    token_of,
)

pytestmark = pytest.mark.unit


class IdWords(Tokenizer):
    """Token i reads " i": stop strings can name tokens."""

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {t}" for t in token_ids)


def text_of(*token_ids: int) -> str:
    return IdWords().decode(token_ids)


class WithSpecial(IdWords):
    """Token 0 is a special token, " <s>": left out unless asked for."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(" <s>" if t == 0 else f" {t}" for t in token_ids
                       if t or not skip_special_tokens)


def test_special_tokens_are_shown_only_when_asked():
    for skip, text in ((True, " 5 6"), (False, " 5 <s> 6")):
        output = OutputText(WithSpecial(), skip_special_tokens=skip)
        output.observe([5, 0, 6])
        assert output.text == text and output.delta(final=True) == text


def utf8(text: str) -> list[int]:
    return list(text.encode())


# ---- OutputText --------------------------------------------------------------------
def test_a_stop_string_spanning_batches_ends_the_output_at_its_last_token():
    output = OutputText(Utf8Bytes(), stop=["lo w"])
    assert output.observe(utf8("hel")) is None
    hit = output.observe(utf8("lo world"))
    assert hit is not None and (hit.num_tokens, hit.reason) == (4, "lo w")  # "l", "o", " ", "w"
    assert output.text == "hel" and output.token_ids == utf8("hello w")
    with pytest.raises(ValueError, match="already ended"):
        output.observe(utf8("x"))


def test_include_stop_keeps_the_stop_string_and_the_earliest_stop_wins():
    output = OutputText(Utf8Bytes(), stop=["world", "lo"], include_stop=True)
    hit = output.observe(utf8("hello world"))
    assert hit is not None and hit.reason == "lo" and output.text == "hello"


def test_a_stream_never_shows_the_start_of_a_stop_string():
    output = OutputText(Utf8Bytes(), stop=["xyz"])
    output.observe(utf8("abcx"))
    assert output.delta() == "ab"  # "cx" may begin "xyz"
    output.observe(utf8("y"))
    assert output.delta() == "c"  # "xy" held back
    hit = output.observe(utf8("z!"))
    assert hit is not None and hit.num_tokens == 1
    assert output.delta() == "" and output.text == "abc"


def test_a_stop_token_ends_the_output_without_its_text_after_min_tokens():
    output = OutputText(Utf8Bytes(), stop_token_ids=[ord("!")], min_tokens=3)
    assert output.observe(utf8("a!")) is None  # the "!" at index 1 is under min_tokens
    hit = output.observe(utf8("b!c"))
    assert hit is not None and (hit.num_tokens, hit.reason) == (2, ord("!"))
    assert output.text == "a!b" and output.token_ids == utf8("a!b!")


def test_stop_strings_count_only_from_min_tokens_on():
    output = OutputText(Utf8Bytes(), stop=["ab"], min_tokens=3)
    assert output.observe(utf8("ab")) is None
    hit = output.observe(utf8("xab"))
    assert hit is not None and hit.num_tokens == 3 and output.text == "abx"


# ---- the router: stops and moves ------------------------------------------------------
def generation(rid: str = "r1", max_tokens: int = 20, streamed: bool = False,
               **sampling) -> GenerationRequest:
    spec = SamplingSpec(max_tokens=max_tokens, **sampling)
    return GenerationRequest(rid, PROMPT, spec, 0.0, None, streamed=streamed)


async def test_a_stop_string_across_a_failover_is_found_and_the_engine_freed():
    broken, healthy = ScriptedEngine("broken", "H800", fail_at=5), ScriptedEngine("ok", "A40")
    router = await started(broken, healthy, policy="round-robin")
    router.instances["ok"].healthy = False
    flight = await router.submit(generation(max_tokens=40))
    router.instances["ok"].healthy = True
    stop = text_of(token_of(PROMPT, 4), token_of(PROMPT, 5))  # token 4 before, 5 after
    flight.output.text = OutputText(IdWords(), stop=[stop])
    events = await drain(router, flight)
    assert flight.placement.instance_ids == ["broken", "ok"]
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(6)]
    assert flight.output.finish_reason == "stop" and flight.output.stop_reason == stop
    assert flight.output.text.text == text_of(*(token_of(PROMPT, i) for i in range(4)))
    await router.poll_once()  # lets the background abort run
    assert healthy.aborted == [healthy.received[0].request_id]
    assert not router.flights and router.counters().num_finished == 1


def test_which_sampling_can_continue_elsewhere_by_token_ids():
    assert SamplingSpec(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.2).resumable
    assert SamplingSpec(temperature=0.0, seed=3).resumable  # greedy: the seed is unused
    assert not SamplingSpec(temperature=0.7, seed=3).resumable
    assert not SamplingSpec(presence_penalty=0.5).resumable
    assert not SamplingSpec(frequency_penalty=-0.5).resumable
    assert not SamplingSpec(structured=StructuredOutput("json_object")).resumable
    resumed = EngineRequest("r", (1, 2), SamplingSpec(max_tokens=10, min_tokens=6),
                            resume_token_ids=(7, 8, 9, 10))
    assert (resumed.num_tokens_to_generate, resumed.num_min_tokens_left) == (6, 2)


async def test_a_penalised_request_is_not_moved_and_reruns_from_the_start_on_failure():
    broken, healthy = ScriptedEngine("broken", "H800", fail_at=5), ScriptedEngine("ok", "A40")
    router = await started(broken, healthy, policy="round-robin")
    router.instances["ok"].healthy = False
    flight = await router.submit(generation(streamed=True, presence_penalty=0.5))
    router.instances["ok"].healthy = True
    with pytest.raises(ValueError, match="is not moved"):
        router.migrate("r1", "ok")
    events = await drain(router, flight)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(20)]
    rerun = healthy.received[0]
    assert rerun.resume_token_ids == () and rerun.sampling.max_tokens == 20
    assert flight.placement.num_failovers == 1 and flight.output.finish_reason == "length"


class OtherTokens(ScriptedEngine):
    """Samples differently from the engine it takes over from (unseeded sampling)."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        async for batch in super().generate(request):
            yield [TokenEvent(ev.request_id, ev.token_id + 1, ev.index, ev.time_s,
                              ev.finish_reason) for ev in batch]


async def test_a_rerun_that_cannot_repeat_the_streamed_tokens_fails_clearly():
    broken, other = ScriptedEngine("broken", "H800", fail_at=5), OtherTokens("ok", "A40")
    router = await started(broken, other, policy="round-robin")
    router.instances["ok"].healthy = False
    flight = await router.submit(generation(streamed=True, temperature=0.8, seed=1))
    router.instances["ok"].healthy = True
    with pytest.raises(EngineLost, match="produced different tokens from the 5 already"):
        await drain(router, flight)
    assert not router.flights and router.counters().num_dropped == 1


async def test_an_unstreamed_rerun_starts_over_unseen():
    broken, other = ScriptedEngine("broken", "H800", fail_at=5), OtherTokens("ok", "A40")
    router = await started(broken, other, policy="round-robin")
    router.instances["ok"].healthy = False
    flight = await router.submit(generation(temperature=0.8, seed=1))
    router.instances["ok"].healthy = True
    flight.output.text = OutputText(IdWords())
    await drain(router, flight)
    assert flight.output.token_ids == [token_of(PROMPT, i) + 1 for i in range(20)]
    assert flight.output.text.token_ids == flight.output.token_ids


# ---- the service: choices, usage, stops ---------------------------------------------
async def test_n_choices_are_separate_requests_with_one_prompt_in_the_usage():
    engine = ScriptedEngine("e", "A40")
    service = sim_service(engine)
    reply = await service.complete(body(n=3, seed=7, max_tokens=4), chat=False)
    assert reply.status_code == 200
    assert [c["index"] for c in reply.body["choices"]] == [0, 1, 2]
    assert reply.body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12,
                                   "total_tokens": 16,  # "a b c d" is four words
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    ids = sorted(r.request_id for r in engine.received)
    base = reply.body["id"].removeprefix("cmpl-")
    assert ids == [f"{base}.{i}" for i in range(3)]
    assert sorted(r.sampling.seed for r in engine.received) == [7, 8, 9]  # vLLM's seeds
    assert len(reply.body["goodserve"]["choices"]) == 3
    service.close()


async def test_a_stop_string_ends_a_reply_with_its_reason_and_usage_on_request():
    engine = ScriptedEngine("e", "A40")
    service = sim_service(engine)
    tokenizer = service.tokenizer
    prompt_ids = tokenizer.encode("a b c d")
    stop = tokenizer.decode([token_of(prompt_ids, 2)])
    reply = await service.complete(body(max_tokens=10, stop=stop), chat=False)
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == tokenizer.decode([token_of(prompt_ids, i) for i in range(2)])
    assert reply.body["usage"]["completion_tokens"] == 3
    stream = await service.complete(body(max_tokens=10, stop=stop, stream=True,
                                         stream_options={"include_usage": True}), chat=False)
    chunks = [json.loads(sse_data(line)) async for line in stream
              if line != "data: [DONE]\n\n"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert not service.router.flights
    service.close()


async def test_continuous_usage_counts_each_choice_so_far():
    service = sim_service(ScriptedEngine("e", "A40"))
    stream = await service.complete(body(max_tokens=6, n=2, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}), chat=False)
    chunks = [json.loads(sse_data(line)) async for line in stream
              if line != "data: [DONE]\n\n"]
    counts = {0: [], 1: []}
    for chunk in chunks[:-1]:
        counts[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
        assert chunk["usage"]["prompt_tokens"] == 4
    assert all(c == sorted(c) and c[-1] == 6 for c in counts.values()), counts
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    plain = await service.complete(body(max_tokens=3, stream=True, stream_options={
        "include_usage": True}), chat=False)
    assert not any(["usage" in json.loads(sse_data(line)) async for line in plain
                    if line != "data: [DONE]\n\n"][:-1])
    service.close()


# ---- shapes and the accepted surface ---------------------------------------------------
def test_logprobs_in_the_completion_and_chat_shapes():
    entries = [TokenLogprobs(-0.5, ((ord("a"), -0.5), (ord("b"), -1.5))),
               TokenLogprobs(-3.0, ((ord("c"), -0.1),)),
               TokenLogprobs(float("-inf"), ())]
    completion = LogprobsFormatter(Utf8Bytes(), chat=False)
    first = completion.format(utf8("ab"), entries[:2])
    assert first == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -3.0],
                     "top_logprobs": [{"a": -0.5, "b": -1.5}, {"c": -0.1, "b": -3.0}],
                     "text_offset": [0, 1]}
    assert completion.format(utf8("c"), entries[2:])["text_offset"] == [2]  # runs on
    assert completion.format(utf8("c"), entries[2:])["token_logprobs"] == [-9999.0]
    chat = LogprobsFormatter(Utf8Bytes(), chat=True).format(utf8("a"), entries[:1])
    assert chat == {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]},
        {"token": "b", "logprob": -1.5, "bytes": [98]}]}]}
    with pytest.raises(ValueError, match="needs its logprobs"):
        completion.format(utf8("a"), [None])


def test_a_token_ending_inside_a_character_shows_what_it_completes_as_vllm():
    euro = utf8("€")
    entries = [TokenLogprobs(-1.0, ((b, -1.0),)) for b in euro]
    formatted = LogprobsFormatter(Utf8Bytes(), chat=False).format(euro, entries)
    assert formatted["tokens"] == ["", "", "€"]
    assert formatted["top_logprobs"][2] == {"€": -1.0}


def test_every_field_of_vllms_openai_requests_is_honoured_or_refused():
    """vLLM's own protocol models: each field is ours, refused by name, or one that
    changes nothing; a field vLLM adds fails this until it is placed."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChat,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VllmCompletion,
    )

    from app.serving.api import ChatCompletionRequest

    for theirs, ours in ((VllmCompletion, CompletionRequest),
                         (VllmChat, ChatCompletionRequest)):
        unplaced = (set(theirs.model_fields) - set(ours.model_fields)
                    - set(UNSUPPORTED_FIELDS) - NO_EFFECT_FIELDS)
        assert not unplaced, f"{theirs.__name__}: {sorted(unplaced)}"


async def test_a_request_that_cannot_resume_skips_the_prefill_pool():
    """Its first token would come from a prefill engine and the rest from a decode
    engine that restarts the grammar or the penalties: the decode engine runs it all."""
    prefill, decode, spare = pd_engines()
    router = await started(prefill, decode, spare, policy="round-robin",
                           kv_transport=SimulatedLink(10.0))
    flight = await router.submit(generation(max_tokens=6,
                                            structured=StructuredOutput("json_object")))
    assert flight.state is not FlightState.PREFILLING and flight.instance_id in ("d", "d2")
    events = await drain(router, flight)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(6)]
    assert not prefill.received


# ---- structured outputs ----------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize(("fields", "constraint"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput("regex", "[ab]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutput("choice", '["yes", "no"]')),
])
def test_response_formats_become_one_constraint(fields, constraint):
    raw = json.dumps({"model": "m", "prompt": "p"} | fields).encode()
    assert parse_body(raw, CompletionRequest).structured == constraint


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "json_schema"}}, "json_schema: required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "not both"),
])
def test_malformed_response_formats_are_refused(fields, message):
    raw = json.dumps({"model": "m", "prompt": "p"} | fields).encode()
    with pytest.raises(ApiError, match=message):
        parse_body(raw, CompletionRequest)


async def test_simulated_engines_refuse_a_response_format():
    service = sim_service(ScriptedEngine("e", "A40"))
    reply = await service.complete(body(response_format={"type": "json_object"}), chat=False)
    assert reply.status_code == 400 and reply.body["error"]["param"] == "response_format"
    service.close()


def test_vllm_gets_the_budgets_left_after_a_resume_and_the_constraint():
    from app.engines.vllm import grammar_error, sampling_params

    spec = SamplingSpec(max_tokens=10, min_tokens=6, temperature=0.5, top_k=4, min_p=0.1,
                        stop_token_ids=(7,), logit_bias=((3, -5.0),), logprobs=2,
                        structured=StructuredOutput("json", json.dumps(SCHEMA)))
    params = sampling_params(EngineRequest("r", (1, 2), spec, resume_token_ids=(5, 6, 7, 8)),
                             None)
    assert (params.max_tokens, params.min_tokens) == (6, 2)
    assert (params.top_k, params.min_p, params.logprobs) == (4, 0.1, 2)
    assert params.stop_token_ids == [7] and params.logit_bias == {3: -5.0}
    assert params.structured_outputs.json == SCHEMA
    assert grammar_error(StructuredOutput("json", '{"type": "nope"}')) == 'Unsupported type "nope"'
    assert "Unclosed" in grammar_error(StructuredOutput("regex", "(["))
    assert grammar_error(StructuredOutput("grammar", 'root ::= "a"')) is None


# ---- tools -------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                      | fields).encode()


async def test_tools_on_simulated_engines_are_refused_by_name():
    service = sim_service(ScriptedEngine("e", "A40"))
    reply = await service.complete(chat_body(model="goodserve", tools=[WEATHER],
                                             tool_choice="required"), chat=True)
    assert reply.status_code == 400 and reply.body["error"]["param"] == "tools"
    auto = await service.complete(chat_body(model="goodserve", tools=[WEATHER]), chat=True)
    assert auto.status_code == 400 and auto.body["error"]["param"] == "tool_choice"
    completion = await service.complete(body(tools=[WEATHER]), chat=False)
    assert completion.status_code == 400 and "tools: not supported" in (
        completion.body["error"]["message"])
    service.close()
