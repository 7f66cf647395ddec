"""What admitted requests can afford: just-enough's "do no harm" check.

A request placed on an instance tolerates one-off stalls up to its time slack: another
request's prefill (or a migration's re-prefill) runs in the iterations it waits for.
An instance is only a candidate while the new request's prefill stays within the
smallest slack among the requests already there. Pure bookkeeping, shared by router
and watchdog.

The slowdown of the batch a newcomer joins is not budgeted: decode is memory-bound,
one more request slows a step by well under 1%, and a per-token budget only ever
tripped on requests that the pessimistic estimate already had behind - it closed
instances to arrivals that would have met (docs/goodserve-routing.md, "do-no-harm
budgets").

The prefill compared here is L_in x p_g, and p_g is measured over whole iterations
(the decode step included), 12-31x a prompt token's marginal cost on a busy
instance: in practice this check is an admission throttle, and with the marginal
cost instead it stops throttling and late requests flood the strongest instance
(docs/goodserve-routing.md, "What the stall check really measures").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from app.routing.view import InstanceId


class SlackBudgets:
    """instance -> min-heap of admitted requests' slack (longest stall each tolerates),
    with lazy removal."""

    def __init__(self) -> None:
        self._heaps: dict[InstanceId, list[tuple[float, str]]] = {}
        self._req_to_slot: dict[str, tuple[InstanceId, float]] = {}
        # `shortest_stalls`' last answer, and the instances whose budgets changed since
        self._stalls: tuple[tuple[InstanceId, ...], dict[InstanceId, int], np.ndarray] = (
            (), {}, np.zeros(0))
        self._changed: set[InstanceId] = set()
        # per instance, the smallest slack other router replicas' requests have there
        self._others: dict[InstanceId, float] = {}

    def __len__(self) -> int:
        return len(self._req_to_slot)

    def admit(self, instance_id: InstanceId, request_id: str, slack_s: float) -> None:
        """Record (or move, or update) a request; infinite slack constrains nothing."""
        self.remove(request_id)
        if math.isinf(slack_s):
            return
        self._req_to_slot[request_id] = (instance_id, slack_s)
        self._changed.add(instance_id)
        heapq.heappush(self._heaps.setdefault(instance_id, []), (slack_s, request_id))

    def remove(self, request_id: str) -> None:
        slot = self._req_to_slot.pop(request_id, None)
        if slot is not None:
            self._changed.add(slot[0])

    def shortest_stall_s(self, instance_id: InstanceId) -> float:
        """Smallest slack among requests still on the instance, this router's and, as
        they last reported them, other replicas' (inf if none)."""
        return min(self._own_shortest_s(instance_id), self._others.get(instance_id, math.inf))

    def _own_shortest_s(self, instance_id: InstanceId) -> float:
        heap = self._heaps.get(instance_id)
        while heap:
            slack_s, rid = heap[0]
            if self._req_to_slot.get(rid) == (instance_id, slack_s):
                return slack_s
            heapq.heappop(heap)
        return math.inf

    def own_shortest_stalls(self) -> dict[InstanceId, float]:
        """Per instance, the smallest slack among this router's own requests: what it
        tells the other router replicas."""
        stalls = {iid: self._own_shortest_s(iid) for iid in list(self._heaps)}
        return {iid: stall for iid, stall in stalls.items() if not math.isinf(stall)}

    def take_others(self, stalls: Mapping[InstanceId, float]) -> None:
        """The other replicas' smallest slack per instance, from their latest reports
        (replacing the previous ones)."""
        for iid in self._others.keys() | stalls.keys():
            if self._others.get(iid) != stalls.get(iid):
                self._changed.add(iid)
        self._others = dict(stalls)

    def shortest_stalls(self, instance_ids: Sequence[InstanceId]) -> np.ndarray:
        """`shortest_stall_s` of each instance, recomputed only for the instances whose
        budgets changed since the last call with the same ids."""
        ids, position, stalls = self._stalls
        if ids != instance_ids:
            ids = tuple(instance_ids)
            position = {iid: i for i, iid in enumerate(ids)}
            stalls = np.array([self.shortest_stall_s(i) for i in ids], dtype=np.float64)
        else:
            for iid in self._changed:
                if iid in position:
                    stalls[position[iid]] = self.shortest_stall_s(iid)
        self._changed.clear()
        self._stalls = (ids, position, stalls)
        return stalls.copy()


def budgets_of(policy: object) -> SlackBudgets | None:
    """A policy's do-no-harm budgets, when it keeps them (GoodServe's do): what router
    replicas tell each other."""
    budgets = getattr(policy, "budgets", None)
    return budgets if isinstance(budgets, SlackBudgets) else None


def smallest_stalls(told: Iterable[Mapping[InstanceId, float]]) -> dict[InstanceId, float]:
    """Per instance, the smallest of the slacks other replicas told
    (`own_shortest_stalls`): what a replica takes with `take_others`."""
    out: dict[InstanceId, float] = {}
    for stalls in told:
        for iid, stall in stalls.items():
            out[iid] = min(stall, out.get(iid, math.inf))
    return out
