"""Serve entry points: `serve run app.main:app` (the embedded default config) or
`serve run app.main:build config=configs/local-vllm-cpu.yaml`.

`serve run` attaches to a Ray cluster whose nodes declare the `gpu_type:<GPU>`
resources the engines pin to (cluster.yaml, or `ray start --resources`);
`goodserve serve` starts such a local cluster itself.
"""

from __future__ import annotations

from ray import serve

from app.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.serving.config import ServeConfig, load_serve_config
from deployments.router import build_app


def default_serve_config() -> ServeConfig:
    """Llama-3.1-8B on simulated H800, A800, A40 and 2xV100 (TP2), routed by GoodServe."""
    scheduler = SchedulerConfig(max_num_seqs=64)
    groups = [
        InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp, scheduler=scheduler))
        for g, tp in (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
    ]
    return ServeConfig(cluster=ClusterConfig(name="local-sim", groups=groups))


def build(args: dict[str, str]) -> serve.Application:
    """Application builder: `config=PATH` selects a serve config file."""
    if "config" not in args:
        raise ValueError("pass config=PATH (a serve config YAML)")
    return build_app(load_serve_config(args["config"]))


app = build_app(default_serve_config())
