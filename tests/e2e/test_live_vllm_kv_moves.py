"""Moves between unified vLLM CPU engines with the example connector: each engine
stores the prompts it computes, and a request moved mid-stream reaches its target with
the stored prompt KV named (`kv_prefix_tokens`), which the target loads instead of
computing. Its greedy text must equal an unmoved run's on the plain engines. Planned by
token ids, the move still loads the stored prompt (vLLM's connector finds it unasked),
and its record says so."""

from __future__ import annotations

import pytest

from app.engines.config import KvConnectorConfig, KvConnectorKind
from app.routing.move_path import MoveRule
from app.serving.config import ServeConfig
from tests.conftest import (
    migrate_streamed,
    serving,
    streamed_completion,
    vllm_cluster_config,
)
from tests.e2e.test_live_vllm_pd import body, unified_text

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog. " * 110  # over 1,000 tokens


@pytest.fixture(scope="module", params=[MoveRule.KV, MoveRule.TOKEN_IDS])
def kv_moves(request, ray_session, tiny_model_dir, tmp_path_factory):
    """The engines with the connector, under the move rule `request.param`."""
    storage = tmp_path_factory.mktemp("kv-moves")
    plain = vllm_cluster_config(tiny_model_dir)
    connector = KvConnectorConfig(kind=KvConnectorKind.EXAMPLE,
                                  shared_storage_path=str(storage))
    groups = [g.model_copy(update={"engine": g.engine.model_copy(
        update={"kv_connector": connector})}) for g in plain.groups]
    cluster = plain.model_copy(update={"name": "e2e-kv", "groups": groups,
                                       "move_path": request.param})
    config = ServeConfig(cluster=cluster, served_model_name="tiny-llama", default_slo_s=300.0)
    with serving(config, "live-vllm-kv-moves") as url:
        yield url, config


def test_a_moved_greedy_request_loads_its_prompt_kv_and_keeps_its_text(kv_moves,
                                                                      vllm_engines):
    url, config = kv_moves
    moves = []
    texts, summary = streamed_completion(
        url, body(PROMPT, 96, stream=True), timeout=600, at_text=4,
        act=lambda chunk: moves.append(migrate_streamed(url, chunk, timeout=60)))
    (moved_to,) = moves
    assert summary is not None and summary["num_migrations"] == 1
    (move,) = summary["moves"]
    # by token ids too: the target's connector finds the stored prompt, which the moved
    # context repeats, and loads it unasked; the record names the path taken
    assert move["target"] == moved_to and move["path"] == "kv"
    assert move["planned_path"] == config.cluster.move_path.value
    # the prompt's whole 128-token blocks but the last came from the store, not computed
    assert move["loaded_tokens"] >= 1024 and move["kv_bytes"] > 0
    assert "".join(texts) == unified_text(vllm_engines[0], config, PROMPT, 96)
