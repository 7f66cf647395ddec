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

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from app.routing.instance_view import InstanceId


class SlackBudgets:
    """instance -> admitted requests' slack (longest stall each tolerates), with each
    instance's smallest kept as requests come (a new one can only lower it) and
    recomputed only when the smallest leaves or the watchdog rewrites the instance's
    budgets. A dict per instance, not a heap: the watchdog rewrites an instance's
    budgets every check, and a heap with lazy removal would keep every superseded
    entry."""

    def __init__(self) -> None:
        self._by_instance: dict[InstanceId, dict[str, float]] = {}  # iid -> rid -> slack
        self._req_to_instance: dict[str, InstanceId] = {}
        self._own_min: dict[InstanceId, float] = {}  # smallest slack, while unchanged
        # `shortest_stalls`' last answer, and the instances whose budgets changed since
        self._stalls: tuple[tuple[InstanceId, ...], dict[InstanceId, int], np.ndarray] = (
            (), {}, np.zeros(0))
        self._changed: set[InstanceId] = set()
        # per instance, the smallest slack other router replicas' requests have there
        self._others: dict[InstanceId, float] = {}

    def __len__(self) -> int:
        return len(self._req_to_instance)

    def admit(self, instance_id: InstanceId, request_id: str, slack_s: float) -> None:
        """Record (or move, or update) a request; infinite slack constrains nothing."""
        self.remove(request_id)
        if math.isinf(slack_s):
            return
        self._req_to_instance[request_id] = instance_id
        self._by_instance.setdefault(instance_id, {})[request_id] = slack_s
        smallest = self._own_min.get(instance_id)
        if smallest is not None and slack_s < smallest:
            self._own_min[instance_id] = slack_s
        self._changed.add(instance_id)

    def admit_many(self, instance_id: InstanceId, request_ids: Sequence[str],
                   slacks_s: Sequence[float]) -> None:
        """`admit` for requests on one instance (the watchdog's refresh of its budgets),
        in one pass: most are already there and only their slack changes."""
        slacks = self._by_instance.setdefault(instance_id, {})
        req_to_instance, isinf = self._req_to_instance, math.isinf
        for request_id, slack_s in zip(request_ids, slacks_s, strict=True):
            was = req_to_instance.get(request_id)
            if isinf(slack_s):
                if was == instance_id:
                    del req_to_instance[request_id], slacks[request_id]
                elif was is not None:
                    self.remove(request_id)
                continue
            if was != instance_id:  # new here, or moved from another instance
                if was is not None:
                    self.remove(request_id)
                req_to_instance[request_id] = instance_id
            slacks[request_id] = float(slack_s)
        self._touched(instance_id)

    def remove(self, request_id: str) -> None:
        instance_id = self._req_to_instance.pop(request_id, None)
        if instance_id is not None:
            slack_s = self._by_instance[instance_id].pop(request_id)
            if slack_s == self._own_min.get(instance_id):  # the smallest may have gone
                del self._own_min[instance_id]
            self._changed.add(instance_id)

    def _touched(self, instance_id: InstanceId) -> None:
        self._changed.add(instance_id)
        self._own_min.pop(instance_id, None)

    def shortest_stall_s(self, instance_id: InstanceId) -> float:
        """Smallest slack among requests still on the instance, this router's and, as
        they last reported them, other replicas' (inf if none)."""
        return min(self._own_shortest_s(instance_id), self._others.get(instance_id, math.inf))

    def _own_shortest_s(self, instance_id: InstanceId) -> float:
        smallest = self._own_min.get(instance_id)
        if smallest is None:
            slacks = self._by_instance.get(instance_id)
            smallest = self._own_min[instance_id] = min(slacks.values()) if slacks else math.inf
        return smallest

    def own_shortest_stalls(self) -> dict[InstanceId, float]:
        """Per instance, the smallest slack among this router's own requests: what it
        tells the other router replicas."""
        stalls = {iid: self._own_shortest_s(iid) for iid, slacks in self._by_instance.items()
                  if slacks}
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
        if ids is not instance_ids and ids != instance_ids:
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
