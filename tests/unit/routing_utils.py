"""Builders for routing tests: instance views, cluster views and requests (no Ray)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from app.engines.config import EngineRole
from app.hardware.specs import make_instance
from app.routing.instance_view import InstanceView
from app.routing.view import ClusterView, RouteRequest

if TYPE_CHECKING:
    from app.routing.goodserve.admissions import RecentAdmissions
    from app.routing.goodserve.scoring import Scored
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


@dataclass(frozen=True)
class Row:
    """One instance's scores for one request, as a test writes them."""

    instance_id: str
    latency_s: float = 1.0
    slack_s: float = 5.0
    capability_s_per_token: float = 0.01
    has_memory_room: bool = True
    stall_s: float = 0.0
    shortest_stall_s: float = math.inf
    reserved: bool = False
    queue_s: float = 0.0


def scored_rows(request: RouteRequest, rows: Sequence[Row]) -> Scored:
    """A `Scored` holding exactly `rows` (no estimator, no view behind it)."""
    from app.routing.arrays import ViewArrays
    from app.routing.goodserve.scoring import InstanceScorer, Scored

    def column(name: str, dtype: type = np.float64) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows], dtype=dtype)

    views = [replace(make_view("A800"), instance_id=r.instance_id) for r in rows]
    stall, shortest, room = (column("stall_s"), column("shortest_stall_s"),
                             column("has_memory_room", np.bool_))
    scorer = InstanceScorer(
        request, ViewArrays.of(views), 0.0, 0.0, column("queue_s"), column("latency_s"),
        np.zeros(len(rows)), room, stall, shortest, np.zeros(len(rows), dtype=np.int64),
        room & (stall <= shortest), column("reserved", np.bool_))
    return Scored(scorer, 1.0, column("latency_s"), column("slack_s"))


def record_arrival(admissions: RecentAdmissions, request: RouteRequest, rows: Sequence[Row],
                   headroom: float) -> None:
    """What an arrival scored as `rows` tells `admissions`."""
    scored = scored_rows(request, rows)
    admissions.record_outcomes(request, scored.scorer.arrays.ids, *scored.outcomes(headroom))


@dataclass(frozen=True)
class ScoredRow:
    """One instance's row of a `Scored`, with the placement's predicates."""

    latency_s: float
    slack_s: float
    queue_s: float
    harmless: bool
    reserved: bool

    def meets_deadline(self) -> bool:
        return self.slack_s >= 0.0

    def capable(self) -> bool:
        """Would meet the deadline once its queue drained."""
        return self.slack_s + self.queue_s >= 0


def rows_by_id(scored: Scored) -> dict[str, ScoredRow]:
    scorer = scored.scorer
    return {iid: ScoredRow(float(scored.latency_s[i]), float(scored.slack_s[i]),
                           float(scorer.queue_s[i]), bool(scorer.harmless[i]),
                           bool(scorer.reserved[i]))
            for i, iid in enumerate(scorer.arrays.ids)}
