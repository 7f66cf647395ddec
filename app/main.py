"""Serve entry points: `serve run app.main:app` (the embedded default config) or
`serve run app.main:build config=configs/local-vllm-cpu.yaml`.

`serve run` attaches to a Ray cluster whose nodes declare the `gpu_type:<GPU>`
resources the engines pin to (cluster.yaml, or `ray start --resources`);
`goodserve serve` starts such a local cluster itself.
"""

from __future__ import annotations

from ray import serve

from app.serving.config import default_serve_config, load_serve_config
from deployments.router import build_app


def build(args: dict[str, str]) -> serve.Application:
    """Application builder: `config=PATH` selects a serve config file."""
    if "config" not in args:
        raise ValueError("pass config=PATH (a serve config YAML)")
    return build_app(load_serve_config(args["config"]))


app = build_app(default_serve_config())
