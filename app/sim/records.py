"""Per-request outcome records: what the simulator measured for each request."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

DEADLINE_TOLERANCE_S = 1e-6  # float noise between the solo-time formula and summed steps


class RequestOutcome(StrEnum):
    PENDING = "pending"  # only while the simulation runs
    MET = "met"
    VIOLATED = "violated"  # finished late, or not finished when the run stopped
    REJECTED = "rejected"


@dataclass(slots=True)
class RequestRecord:
    """Filled in while the request flows through the cluster (virtual seconds)."""

    request_id: str
    arrival_s: float
    deadline_s: float
    slo_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # ground truth
    predicted_output_tokens: int | None = None
    num_generated_tokens: int = 0  # produced by the end of the run
    first_token_s: float | None = None
    num_cached_tokens: int = 0  # of the prompt, found in its first engine's prefix cache
    finish_s: float | None = None
    instance_ids: list[str] = field(default_factory=list)  # decode/unified, in visit order
    prefill_instance_id: str | None = None  # disaggregated mode only
    num_migrations: int = 0
    num_kv_moves: int = 0  # migrations that carried the KV (the rest went by token ids)
    kv_moved_bytes: float = 0.0
    kv_move_s: float = 0.0  # time the KV moves took on the link, queueing included
    outcome: RequestOutcome = RequestOutcome.PENDING
    reject_reason: str | None = None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def decide(self) -> RequestOutcome:
        """Final outcome once the run is over."""
        if self.outcome == RequestOutcome.REJECTED:
            return self.outcome
        if self.finish_s is not None and self.finish_s <= self.deadline_s + DEADLINE_TOLERANCE_S:
            return RequestOutcome.MET
        return RequestOutcome.VIOLATED

    def rescored(self, slo_factor: float) -> RequestRecord:
        """The same execution judged against an SLO `slo_factor` times as long."""
        slo_s = self.slo_s * slo_factor
        new = replace(self, slo_s=slo_s, deadline_s=self.arrival_s + slo_s,
                      instance_ids=list(self.instance_ids))
        if new.outcome != RequestOutcome.REJECTED:
            new.outcome = new.decide()
        return new

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["outcome"] = self.outcome.value
        row["e2e_s"] = self.e2e_s
        row["ttft_s"] = self.ttft_s
        for key in ("deadline_s", "slo_s"):
            if math.isinf(row[key]):
                row[key] = None
        return row
