"""Run-level metrics from per-request records.

goodput = requests finished within their deadline / duration of the arrival
window (the workload's `duration_s`); SLO violation ratio = 1 - met / total, so
rejected and unfinished requests count as violations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from app.sim.records import RequestOutcome, RequestRecord


@dataclass(frozen=True)
class RunSummary:
    requests: int
    met: int
    violated: int
    rejected: int
    unfinished: int  # subset of violated: not done when the run stopped
    goodput_rps: float
    slo_violation_ratio: float
    p50_e2e_s: float  # over finished requests
    p99_e2e_s: float
    mean_e2e_s: float
    p50_ttft_s: float
    migrations: int
    kv_moves: int  # migrations that carried their KV
    duration_s: float

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else math.nan


def summarize(records: Sequence[RequestRecord], duration_s: float) -> RunSummary:
    counts = dict.fromkeys(RequestOutcome, 0)
    for r in records:
        counts[r.outcome] += 1
    if counts[RequestOutcome.PENDING]:
        raise ValueError("records are not finalized (outcome pending)")
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    total = len(records)
    met = counts[RequestOutcome.MET]
    return RunSummary(
        requests=total,
        met=met,
        violated=counts[RequestOutcome.VIOLATED],
        rejected=counts[RequestOutcome.REJECTED],
        unfinished=sum(
            1 for r in records if r.finish_s is None and r.outcome != RequestOutcome.REJECTED
        ),
        goodput_rps=met / duration_s if duration_s > 0 else math.nan,
        slo_violation_ratio=1.0 - met / total if total else math.nan,
        p50_e2e_s=_quantile(e2e, 0.5),
        p99_e2e_s=_quantile(e2e, 0.99),
        mean_e2e_s=float(np.mean(e2e)) if e2e else math.nan,
        p50_ttft_s=_quantile(ttft, 0.5),
        migrations=sum(r.num_migrations for r in records),
        kv_moves=sum(r.num_kv_moves for r in records),
        duration_s=duration_s,
    )
