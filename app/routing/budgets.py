"""Per-token time budgets of admitted requests: just-enough's "do no harm" check.

When a request is placed on an instance it can tolerate the instance slowing down
to a certain time per output token before it misses its deadline. Adding more
requests slows every request on the instance, so an instance is only a candidate
while its (predicted) per-token time stays within the tightest budget of the
requests already there. Pure bookkeeping, shared by router and watchdog.
"""

from __future__ import annotations

import heapq
import math

from app.routing.view import InstanceId


def token_budget_s(slack_to_deadline_s: float, decode_tokens: float) -> float:
    """Slowest per-token time that still finishes `decode_tokens` within the slack."""
    if decode_tokens <= 0:
        return math.inf
    return slack_to_deadline_s / decode_tokens


class TokenBudgets:
    """instance -> min-heap of (budget_s_per_token, request_id), with lazy removal."""

    def __init__(self) -> None:
        self._heaps: dict[InstanceId, list[tuple[float, str]]] = {}
        self._req_to_slot: dict[str, tuple[InstanceId, float]] = {}

    def __len__(self) -> int:
        return len(self._req_to_slot)

    def admit(self, instance_id: InstanceId, request_id: str, budget_s: float) -> None:
        """Record (or move) a request; an infinite budget constrains nothing."""
        self.remove(request_id)
        if math.isinf(budget_s):
            return
        self._req_to_slot[request_id] = (instance_id, budget_s)
        heapq.heappush(self._heaps.setdefault(instance_id, []), (budget_s, request_id))

    def remove(self, request_id: str) -> None:
        self._req_to_slot.pop(request_id, None)

    def tightest_s(self, instance_id: InstanceId) -> float:
        """Smallest budget among requests still on the instance (inf if none)."""
        heap = self._heaps.get(instance_id)
        while heap:
            budget, rid = heap[0]
            if self._req_to_slot.get(rid) == (instance_id, budget):
                return budget
            heapq.heappop(heap)
        return math.inf
