"""Serve configs: every shipped YAML loads; bad ones fail with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.routing.goodserve import GoodServeConfig
from app.serving.config import ServeConfig, load_serve_config

pytestmark = pytest.mark.unit

# `goodserve autoscale` experiments and a Kubernetes manifest, not serve configs
NOT_SERVE_CONFIGS = {"autoscale-sim.yaml", "autoscale-live.yaml", "autoscale-agents-sim.yaml",
                     "kuberay-rayservice.yaml"}
CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
                 if p.name not in NOT_SERVE_CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_is_a_serve_config(path):
    config = load_serve_config(path)
    assert config.cluster.engines() and config.routing.policy == "goodserve"


def test_vllm_model_path_expands_home():
    config = load_serve_config(Path(__file__).resolve().parents[2] / "configs" /
                               "local-vllm-cpu.yaml")
    assert config.engine_template.model_path == str(Path.home() / ".cache/goodserve/tiny-llama")
    assert config.engine_template.max_model_len == 2048 and config.engine_capabilities.text


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouting: {policy: oracle}\n",
     "simulator only"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouting: {policy: fastest}\n",
     "unknown policy 'fastest'"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}, {engine: {gpu_type: A800, "
     "model: qwen2.5-14b}}]}\n", "same model"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\ndefault_slo_s: -1\n", "default_slo_s"),
    ("cluster: {groups: [{engine: {gpu_type: A40, role: decode}}]}\n", "set mode: disaggregated"),
    ("cluster: {mode: disaggregated, groups: [{engine: {gpu_type: A40, role: decode}}]}\n",
     "needs prefill and decode engines"),
    ("cluster: {mode: disaggregated, groups: [{engine: {gpu_type: H800, role: prefill, "
     "backend: vllm, model_path: /m}}, {engine: {gpu_type: A40, role: decode, backend: vllm, "
     "model_path: /m, kv_connector: {kind: example}}}]}\n", "need a kv_connector"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nnum_router_replicas: 2\n"
     "router_autoscaling: {max_replicas: 4}\n", "or router_autoscaling, not both"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\n"
     "router_autoscaling: {min_replicas: 3, max_replicas: 2}\n", "min_replicas 3 > max_replicas 2"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouter_autoscaling: {min_replicas: 0}\n",
     "min_replicas"),
    ("cluster: {request_priority: deadline, groups: [{engine: {gpu_type: A40}}]}\n",
     "no engine has scheduling_policy priority"),
    ("cluster: {groups: [{engine: {gpu_type: A40}}]}\nrouter_resources: {router: 0}\n",
     "resource amounts must be > 0"),
])
def test_bad_serve_configs_say_what_is_wrong(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message):
        load_serve_config(path)


def test_default_config_is_the_four_gpu_simulated_cluster():
    from app.serving.config import default_serve_config

    config = default_serve_config()
    assert isinstance(config, ServeConfig) and not config.engine_capabilities.text
    assert [e.instance.name for e in config.cluster.engines()] == ["H800", "A800", "A40",
                                                                   "2xV100"]


def test_cluster_yaml_node_types_can_host_the_gpu_serve_config():
    """cluster.yaml declares `gpu_type:<GPU>` per GPU on catalog GPU kinds, with enough
    units (and Ray GPUs) for every engine of configs/aws-gpu.yaml."""
    import yaml

    from app.hardware.specs import GPU_CATALOG

    root = Path(__file__).resolve().parents[2]
    nodes = yaml.safe_load((root / "cluster.yaml").read_text())["available_node_types"]
    capacity: dict[str, float] = {}
    for node in nodes.values():
        for name, amount in node["resources"].items():
            if name.startswith("gpu_type:"):
                assert name.removeprefix("gpu_type:") in GPU_CATALOG
                assert node["resources"]["GPU"] == amount  # one unit per physical GPU
                capacity[name] = capacity.get(name, 0) + amount * node["max_workers"]
    for config in ("aws-gpu.yaml", "aws-gpu-pd.yaml"):
        need: dict[str, int] = {}
        for engine in load_serve_config(root / "configs" / config).cluster.engines():
            assert engine.num_gpus == engine.tp
            need[engine.resource_name] = need.get(engine.resource_name, 0) + engine.tp
        assert all(need[name] <= capacity.get(name, 0) for name in need), (need, capacity)
        # the routers and the controller ask for what only the head (CPU) node declares
        asked = load_serve_config(root / "configs" / config).router_resources
        held_by = {kind for kind, node in nodes.items() if set(asked) <= set(node["resources"])}
        assert asked and held_by == {"head"}, (asked, held_by)


def test_nixl_engines_get_one_handshake_port_each():
    from deployments.cluster import engine_ids

    root = Path(__file__).resolve().parents[2]
    config = load_serve_config(root / "configs" / "aws-gpu-pd.yaml")
    ports = [e.kv_connector.side_channel_port for _, e in engine_ids(config.cluster)]
    assert ports == list(range(5600, 5608))
    assert {e.kv_connector.vllm_kv_transfer_config()["kv_connector"]
            for e in config.cluster.engines()} == {"NixlConnector"}


def test_the_live_replay_carries_every_knob_into_the_serve_config():
    """`replay --backend live` builds a serve config from the replay's options and the
    service builds the options back from it: non-default knobs survive the trip."""
    from app.experiments.live_replay import serve_config_for
    from app.routing.goodserve import goodserve_knobs
    from app.routing.registry import RoutingOptions
    from app.serving.config import default_serve_config
    from app.serving.service import routing_options
    from tests.unit.test_routing_knobs import non_default_knobs

    options = RoutingOptions(7, GoodServeConfig(**non_default_knobs()))
    config = serve_config_for(default_serve_config(), "goodserve",
                              **goodserve_knobs(options.goodserve), seed=options.seed)
    assert routing_options(config, None) == options


def test_serve_config_leaves_the_stall_factor_to_the_predictor_unless_set():
    """Unset, the live router charges what suits its length estimator: the trained
    predictor's factor with predictor_dir, the full charge with the running history."""
    from app.routing.goodserve import DEFAULT_STALL_FACTOR, TRAINED_PREDICTOR_STALL_FACTOR
    from app.routing.registry import build_routing
    from app.serving.config import RoutingConfig, default_serve_config
    from app.serving.service import routing_options
    from tests.unit.routing_utils import fixed_length_predictor

    config = default_serve_config()
    assert config.routing.stall_factor is None
    trained = fixed_length_predictor()
    for predictor, expected in ((None, DEFAULT_STALL_FACTOR),
                                (trained, TRAINED_PREDICTOR_STALL_FACTOR)):
        stack = build_routing("goodserve", routing_options(config, predictor))
        assert stack.policy.config.stall_factor == expected
    pinned = config.model_copy(update={"routing": RoutingConfig(stall_factor=0.8)})
    pinned_stack = build_routing("goodserve", routing_options(pinned, trained))
    assert pinned_stack.policy.config.stall_factor == 0.8


def test_router_autoscaling_becomes_serves_autoscaling_config(tmp_path):
    """The section reaches Ray Serve as its autoscaling_config, starting at the minimum."""
    path = tmp_path / "scaled.yaml"
    path.write_text("cluster: {groups: [{engine: {gpu_type: A40}}]}\n"
                    "router_autoscaling: {min_replicas: 2, max_replicas: 6, "
                    "target_ongoing_requests: 50, downscale_delay_s: 120}\n")
    scaling = load_serve_config(path).router_autoscaling
    assert scaling is not None
    assert scaling.serve_options() == {
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 6,
        "target_ongoing_requests": 50.0, "upscale_delay_s": 30.0, "downscale_delay_s": 120.0}
