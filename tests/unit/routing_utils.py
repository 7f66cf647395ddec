"""Builders for routing tests: instance views, cluster views and requests (no Ray)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.engines.config import EngineRole
from app.hardware.specs import make_instance
from app.routing.instance_view import InstanceView
from app.routing.view import ClusterView, RouteRequest

if TYPE_CHECKING:
    from predictor.base import Predictor

SPECS = {g: make_instance(g, "llama-3.1-8b") for g in ("H800", "A800", "A40")}


def make_view(
    gpu: str,
    *,
    instance_id: str | None = None,
    running: int = 1,
    waiting: int = 0,
    free_blocks: int = 10_000,
    total_blocks: int = 20_000,
    recent_iteration_s: tuple[float, ...] = (),
) -> InstanceView:
    return InstanceView(
        instance_id=instance_id or gpu, spec=SPECS[gpu], role=EngineRole.UNIFIED,
        num_waiting=waiting, num_running=running, num_kv_blocks_free=free_blocks,
        num_kv_blocks=total_blocks, kv_block_size=16, num_iterations=0,
        recent_iteration_s=recent_iteration_s, recent_queue_wait_s=(), updated_s=0.0,
    )


def make_cluster(*views: InstanceView, hits: dict[str, int] | None = None) -> ClusterView:
    """`hits`: instance id -> cached prefix blocks for any request."""
    hits = hits or {}
    return ClusterView(0.0, tuple(views), lambda iid, hashes: min(hits.get(iid, 0), len(hashes)))


def make_request(
    slo_s: float, prompt: int = 1000, out: int = 200, rid: str = "r", **kw
) -> RouteRequest:
    return RouteRequest(rid, 0.0, slo_s, prompt, predicted_output_tokens=out,
                        true_output_tokens=out, **kw)


def fixed_length_predictor(tokens: int = 100) -> Predictor:
    """A trained predictor (history over three identical answers) that always says
    `tokens`: what routing sees from a saved predictor directory."""
    from predictor.base import PredictionInput
    from predictor.history import HistoryPredictor

    return HistoryPredictor().fit([PredictionInput("p")] * 3, [tokens] * 3)
