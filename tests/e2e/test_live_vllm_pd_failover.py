"""A disaggregated request whose decode engine dies mid-stream finishes with the same
greedy tokens: with no other decode engine, the prefill engine carries it on by token
ids. A module of its own: the test kills an engine of its service."""

from __future__ import annotations

import pytest

from tests.conftest import serving, streamed_completion, vllm_pd_config
from tests.e2e.test_live_vllm_pd import PROMPTS, body, unified_text

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pd(ray_session, tiny_model_dir, tmp_path_factory):
    config = vllm_pd_config(tiny_model_dir, "e2e-pdf", tmp_path_factory.mktemp("kv-store"))
    with serving(config, "live-vllm-pdf") as url:
        yield url, config


def test_killing_the_decode_engine_mid_stream_still_completes_the_request(pd, vllm_engines):
    import ray

    from deployments.cluster import ENGINE_NAMESPACE

    url, config = pd
    texts, summary = streamed_completion(
        url, body(PROMPTS[0], 200, stream=True), timeout=300, at_text=3,
        act=lambda chunk: ray.kill(ray.get_actor("e2e-pdf-decode-cpu-1",
                                                 namespace=ENGINE_NAMESPACE)))
    assert summary is not None
    assert summary["instance_ids"] == ["e2e-pdf-decode-cpu-1", "e2e-pdf-prefill-cpu-0"]
    assert "".join(texts) == unified_text(vllm_engines[0], config, PROMPTS[0], 200)
