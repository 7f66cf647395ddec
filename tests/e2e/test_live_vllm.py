"""The Ray Serve router over HTTP in front of two real vLLM CPU engines (tiny Llama)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import migrate_streamed, streamed_completion, vllm_cluster_config

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox jumps over the lazy dog and " * 4


@pytest.fixture(scope="module")
def vllm_url(vllm_engines, tiny_model_dir):
    from app.serving.config import ServeConfig
    from deployments.router import serve_application

    config = ServeConfig(cluster=vllm_cluster_config(tiny_model_dir), default_slo_s=120.0)
    with serve_application(config, "live-vllm") as url:  # the shared engines stay
        yield url


def complete(url: str, **body) -> dict:
    payload = {"model": "goodserve", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0,
               "ignore_eos": True} | body
    reply = httpx.post(url + "/v1/completions", json=payload, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_completion_is_real_text_and_deterministic(vllm_url, tiny_model_dir):
    from transformers import AutoTokenizer

    first, second = complete(vllm_url), complete(vllm_url)
    text = first["choices"][0]["text"]
    assert text and text == second["choices"][0]["text"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert first["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    assert first["usage"]["completion_tokens"] == 24
    assert first["goodserve"]["instance_ids"][0].startswith("e2e-cpu-")


def test_operator_migration_mid_stream_keeps_the_greedy_output(vllm_url):
    """Move a streaming request to the other engine after a few chunks: the target
    re-prefills prompt + generated ids and the text equals the unmoved run's."""
    body = {"model": "goodserve", "prompt": PROMPT, "max_tokens": 160, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    moves = []
    texts, summary = streamed_completion(
        vllm_url, body, timeout=300, at_text=5,
        act=lambda chunk: moves.append(migrate_streamed(vllm_url, chunk, timeout=30)))
    (moved_to,) = moves
    assert summary["num_migrations"] == 1 and summary["instance_ids"][1] == moved_to
    unmoved = complete(vllm_url, max_tokens=160)
    assert unmoved["goodserve"]["num_migrations"] == 0
    assert "".join(texts) == unmoved["choices"][0]["text"]


def test_chat_and_context_limit_errors(vllm_url):
    chat = httpx.post(vllm_url + "/v1/chat/completions", timeout=300, json={
        "model": "goodserve", "max_tokens": 8, "temperature": 0.0,
        "messages": [{"role": "user", "content": "explain how a hash table works"}]})
    assert chat.status_code == 200
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    too_long = httpx.post(vllm_url + "/v1/completions", timeout=60, json={
        "model": "goodserve", "prompt": PROMPT, "max_tokens": 4000})
    assert too_long.status_code == 400
    assert "exceeds the model context of 2048" in too_long.json()["error"]["message"]
    missing = httpx.post(vllm_url + "/admin/migrate", json={"request_id": "gone"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
