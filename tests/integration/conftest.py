"""The Ray Serve router over HTTP on simulated engines of four GPU kinds, one per module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup, SchedulerConfig
from app.hardware.specs import BatchShape, InstanceSpec
from app.serving.config import RoutingConfig, ServeConfig, load_serve_config
from tests.conftest import serving

GPU_SETUP = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
WEAKEST = "live-A40-2"  # largest unloaded time per token of the four
STRONGEST = "live-H800-0"


@pytest.fixture(scope="module")
def live_url(ray_session):
    """A fresh service per test module: routing state (the history of finished lengths)
    carries from one request to the next, so a module shares it only among its own tests."""
    groups = [InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp,
                                                scheduler=SchedulerConfig(max_num_seqs=32)))
              for g, tp in GPU_SETUP]
    config = ServeConfig(cluster=ClusterConfig(name="live", groups=groups),
                         # point estimates only (confidence 0.5): the migration test
                         # needs a request placed by its under-predicted length
                         routing=RoutingConfig(tau_iterations=10, migration_margin=0.0,
                                               confidence_quantile=0.5),
                         # a reply its client left is cancelled (its engine request
                         # aborted) this long after, where 30 s would outlast a test
                         unread_grace_s=2.0)
    with serving(config, "live-sim") as url:
        yield url


PD_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-sim-pd.yaml"


@contextmanager
def pd_service(name: str, kv_link_gbps: float = 1.0) -> Iterator[tuple[str, ServeConfig]]:
    """configs/local-sim-pd.yaml (prefill H800 + A800, decode A40 + 2x V100) served
    under cluster name `name`, on a slow link so transfers are visible; point estimates
    only (confidence 0.5)."""
    base = load_serve_config(PD_CONFIG)
    cluster = base.cluster.model_copy(update={"name": name, "kv_link_gbps": kv_link_gbps})
    config = base.model_copy(update={"cluster": cluster,
                                     "routing": RoutingConfig(confidence_quantile=0.5)})
    with serving(config, name) as url:
        yield url, config


def post(url: str, path: str, **body) -> httpx.Response:
    payload = {"model": "goodserve", "prompt": "route me " * 50, "max_tokens": 8} | body
    return httpx.post(url + path, json=payload, timeout=120)


def instance_specs(url: str) -> dict[str, InstanceSpec]:
    """The hardware model of each instance the router at `url` serves."""
    rows = httpx.get(url + "/v1/instances", timeout=30).json()["instances"]
    return {r["instance_id"]: EngineConfig(gpu_type=r["gpu_type"], tp=r["tp"]).instance
            for r in rows}


def engine_pace(summary: dict, spec: InstanceSpec, num_prompt_tokens: int,
                num_output_tokens: int, *, num_seqs: int = 1) -> float:
    """How many times slower than its hardware model the request's (decode) engine ran
    while the request decoded, as the router saw its tokens come; at least 1.

    A simulated engine sleeps each iteration's modelled time and the router estimates in
    that model time; a machine busy with other work wakes the engine late, so whatever
    it holds, queue included, ends later by about this factor. `num_seqs`: the largest
    batch the request decoded in (the model's time per token is then the longest, and
    the pace the least)."""
    context = num_prompt_tokens + num_output_tokens // 2
    batch = BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=num_seqs * context)
    model_s = (num_output_tokens - 1) * spec.iteration_time_s(batch)
    decode_s = summary["e2e_s"] - summary["ttft_s"] - (summary["kv_transfer_s"] or 0.0)
    return max(1.0, decode_s / model_s)


def met_at_engine_pace(summary: dict, spec: InstanceSpec, usage: dict, *,
                       num_seqs: int = 1) -> bool:
    """Whether the request ended within its deadline stretched by its engine's pace: the
    deadline kept as the router's model-time estimates see it, however busy the machine."""
    pace = engine_pace(summary, spec, usage["prompt_tokens"], usage["completion_tokens"],
                       num_seqs=num_seqs)
    return summary["e2e_s"] <= summary["slo_s"] * pace
