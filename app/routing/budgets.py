"""What admitted requests can afford: just-enough's "do no harm" check.

When a request is placed on an instance it can tolerate two kinds of harm before it
misses its deadline: the instance slowing down to a certain time per output token
(more requests in the batch), and one-off stalls up to its time slack (another
request's prefill runs in the iterations it waits for). An instance is only a
candidate while the new request's per-token time and prefill stay within the
tightest of these budgets among the requests already there. Pure bookkeeping,
shared by router and watchdog.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from app.routing.view import InstanceId


def token_budget_s(slack_to_deadline_s: float, decode_tokens: float) -> float:
    """Slowest per-token time that still finishes `decode_tokens` within the slack."""
    if decode_tokens <= 0:
        return math.inf
    return slack_to_deadline_s / decode_tokens


@dataclass(frozen=True)
class Budget:
    """What one admitted request tolerates on its instance."""

    per_token_s: float  # slowest time per output token
    stall_s: float = math.inf  # longest one-off pause (its time slack)


class TokenBudgets:
    """instance -> min-heaps of per-token and stall budgets, with lazy removal."""

    def __init__(self) -> None:
        self._per_token: dict[InstanceId, list[tuple[float, str]]] = {}
        self._stall: dict[InstanceId, list[tuple[float, str]]] = {}
        self._req_to_slot: dict[str, tuple[InstanceId, Budget]] = {}

    def __len__(self) -> int:
        return len(self._req_to_slot)

    def admit(self, instance_id: InstanceId, request_id: str, budget: Budget) -> None:
        """Record (or move, or update) a request; infinite budgets constrain nothing."""
        self.remove(request_id)
        if math.isinf(budget.per_token_s) and math.isinf(budget.stall_s):
            return
        self._req_to_slot[request_id] = (instance_id, budget)
        heapq.heappush(self._per_token.setdefault(instance_id, []),
                       (budget.per_token_s, request_id))
        heapq.heappush(self._stall.setdefault(instance_id, []), (budget.stall_s, request_id))

    def remove(self, request_id: str) -> None:
        self._req_to_slot.pop(request_id, None)

    def tightest_s(self, instance_id: InstanceId) -> float:
        """Smallest per-token budget among requests still on the instance (inf if none)."""
        return self._live_min(self._per_token, instance_id, lambda b: b.per_token_s)

    def shortest_stall_s(self, instance_id: InstanceId) -> float:
        """Smallest stall budget among requests still on the instance (inf if none)."""
        return self._live_min(self._stall, instance_id, lambda b: b.stall_s)

    def _live_min(self, heaps, instance_id: InstanceId, field) -> float:
        heap = heaps.get(instance_id)
        while heap:
            value, rid = heap[0]
            slot = self._req_to_slot.get(rid)
            if slot is not None and slot[0] == instance_id and field(slot[1]) == value:
                return value
            heapq.heappop(heap)
        return math.inf
