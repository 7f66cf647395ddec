"""Disaggregated serving on real vLLM CPU engines (configs/local-vllm-cpu-pd.yaml on the
tiny model): a prefill engine computes the prompt, vLLM's ExampleConnector stores its
KV, the decode engine loads it and continues. Greedy output must equal the unified
engines' token for token, and the stored KV must not outlive its load."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.engines.messages import EngineRequest, SamplingSpec
from app.serving.service import make_tokenizer
from app.serving.tokenizer import REPLACEMENT_CHAR
from deployments.cluster import collect_tokens
from tests.conftest import serving, streamed_completion, vllm_pd_config

pytestmark = pytest.mark.e2e

# longer than vLLM's CPU KV block (128 tokens), so whole blocks are stored and loaded
PROMPTS = ("The quick brown fox jumps over the lazy dog. " * 30,
           "Routing requests to heterogeneous GPUs just in time. " * 28)


@pytest.fixture(scope="module")
def pd(ray_session, tiny_model_dir, tmp_path_factory):
    storage = tmp_path_factory.mktemp("kv-store")
    config = vllm_pd_config(tiny_model_dir, "e2e-pd", storage)
    with serving(config, "live-vllm-pd") as url:
        yield url, storage, config


def unified_text(engine, config, prompt: str, max_tokens: int) -> str:
    """What one of the unified engines answers for `prompt`, greedy, as vLLM shows it
    (an incomplete UTF-8 character at the end is left out)."""
    tokenizer = make_tokenizer(config)
    request = EngineRequest(f"unified-{abs(hash(prompt))}", tokenizer.encode(prompt),
                            SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True))
    events = asyncio.run(collect_tokens(engine, request))
    return tokenizer.decode([e.token_id for e in events]).rstrip(REPLACEMENT_CHAR)


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **extra}


def test_completions_and_streams_equal_the_unified_engines_with_the_kv_loaded(pd, vllm_engines):
    url, storage, config = pd
    reply = httpx.post(url + "/v1/completions", json=body(PROMPTS[0], 16), timeout=300)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["choices"][0]["text"] == unified_text(vllm_engines[0], config, PROMPTS[0], 16)
    gs = data["goodserve"]
    assert gs["prefill_instance"] == "e2e-pd-prefill-cpu-0"
    assert gs["decode_instance"] == "e2e-pd-decode-cpu-1"
    # the decode engine found the prompt's whole blocks (ExampleConnector) instead of
    # computing them: a fresh prompt, so no local prefix cache could have held them
    assert gs["kv_loaded_tokens"] >= 128 and gs["kv_transfer_s"] > 0

    texts, summary = streamed_completion(url, body(PROMPTS[1], 20, stream=True),
                                         timeout=300)
    assert "".join(texts) == unified_text(vllm_engines[1], config, PROMPTS[1], 20)
    assert summary is not None and summary["kv_loaded_tokens"] >= 128
    assert not list(storage.iterdir())  # each prompt's stored KV deleted once loaded


def prompt_of_exactly(tokenizer, num_tokens: int) -> str:
    """A text the served tokenizer turns into exactly `num_tokens` tokens."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa " * 80).split()
    for n in range(len(words), 0, -1):
        for k in range(12):  # each " x" adds one token
            text = " ".join(words[:n]) + " x" * k
            if len(tokenizer.encode(text)) == num_tokens:
                return text
    raise AssertionError(f"no prompt of {num_tokens} tokens")


def test_a_prompt_of_whole_kv_blocks_is_recomputed_not_loaded_and_the_engine_lives(
        pd, vllm_engines):
    """vLLM's ExampleConnector stores n - 1 tokens' whole blocks and loads n's: for a
    256-token prompt (two CPU blocks) the file the decode engine reads is missing and
    it would die. The prefill engine drops that KV, the decode engine computes it."""
    url, storage, config = pd
    prompt = prompt_of_exactly(make_tokenizer(config), 256)
    reply = httpx.post(url + "/v1/completions", json=body(prompt, 8), timeout=300)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["usage"]["prompt_tokens"] == 256
    assert data["choices"][0]["text"] == unified_text(vllm_engines[0], config, prompt, 8)
    assert data["goodserve"]["decode_instance"] == "e2e-pd-decode-cpu-1"
    after = httpx.post(url + "/v1/completions", json=body(prompt + " omega", 8), timeout=300)
    assert after.status_code == 200 and after.json()["goodserve"]["num_migrations"] == 0
    assert after.json()["goodserve"]["instance_ids"] == ["e2e-pd-decode-cpu-1"]
    assert not list(storage.iterdir())
