"""Serve configs: every shipped YAML loads; bad ones fail with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.serving.config import ServeConfig, load_serve_config

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_is_a_serve_config(path):
    config = load_serve_config(path)
    assert config.cluster.engines() and config.routing.policy == "goodserve"


def test_vllm_model_path_expands_home():
    config = load_serve_config(Path(__file__).resolve().parents[2] / "configs" /
                               "local-vllm-cpu.yaml")
    assert config.engine_template.model_path == str(Path.home() / ".cache/goodserve/tiny-llama")
    assert config.engine_template.max_model_len == 2048 and not config.is_simulated


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouting: {policy: oracle}\n",
     "simulator only"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouting: {policy: fastest}\n",
     "unknown policy 'fastest'"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}, {engine: {gpu_type: A800, "
     "model: qwen2.5-14b}}]}\n", "same model"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\ndefault_slo_s: -1\n", "default_slo_s"),
])
def test_bad_serve_configs_say_what_is_wrong(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message):
        load_serve_config(path)


def test_default_config_is_the_four_gpu_simulated_cluster():
    from app.serving.config import default_serve_config

    config = default_serve_config()
    assert isinstance(config, ServeConfig) and config.is_simulated
    assert [e.instance.name for e in config.cluster.engines()] == ["H800", "A800", "A40",
                                                                   "2xV100"]
