"""Session affinity: a consistent hash ring on the session id.

This is the vLLM production stack's `session` routing logic
(`src/vllm_router/routers/routing_logic.py`, `SessionRouter`). Dynamo and AIBrix offer
the same stickiness. Every turn of a conversation lands on the instance that already
holds its context, and no instance has to remember sessions. Because the ring is
consistent, an instance that joins or leaves moves only the sessions whose ring arc it
gains or loses.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

from app.routing.base import RouteDecision, RoutingPolicy
from app.routing.baselines import no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, RouteRequest

# uhashring's default continuum (the `HashRing()` the production stack builds): 160 md5
# points per node
VNODES_PER_INSTANCE = 160
# production stack's --request-stats-window default: the QPS window for requests without a
# session id
QPS_WINDOW_S = 60.0


def ring_point(key: str) -> int:
    """uhashring's default hash: the md5 digest of the key as a 128-bit integer."""
    return int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16)


class HashRing:
    """Consistent hash ring, point for point the one uhashring builds by default.

    Node `n` owns the points md5(f"{n}-{k}") for k < vnodes. A key goes to the owner of
    the first point clockwise of md5(key): bisect right, wrapping around to the start.
    """

    def __init__(self, vnodes_per_node: int = VNODES_PER_INSTANCE) -> None:
        self.vnodes_per_node = vnodes_per_node
        self._owner: dict[int, InstanceId] = {}  # ring point -> node
        self._points: list[int] = []  # sorted keys of _owner
        self._point_owners: list[InstanceId] = []  # _owner[p] for p in _points
        self.nodes: set[InstanceId] = set()

    def _node_points(self, node: InstanceId) -> Iterator[int]:
        return (ring_point(f"{node}-{k}") for k in range(self.vnodes_per_node))

    def sync(self, nodes: Iterable[InstanceId]) -> None:
        """Make the ring hold exactly `nodes`. Points of nodes that stay do not move
        (the production stack's `_update_hash_ring`)."""
        wanted = set(nodes)
        if wanted == self.nodes:
            return
        for node in self.nodes - wanted:
            for point in self._node_points(node):
                del self._owner[point]
        for node in wanted - self.nodes:
            self._owner.update(dict.fromkeys(self._node_points(node), node))
        self.nodes = wanted
        self._points = sorted(self._owner)
        self._point_owners = [self._owner[p] for p in self._points]

    def walk(self, key: str) -> Iterator[InstanceId]:
        """Distinct nodes clockwise from the key's position. The first is the key's
        owner; the rest are where the key would go if the ones before it left.

        Steps through the sorted points by index from the bisection, so a lookup costs
        the points it passes, not a copy of the ring (81,920 points at 512 nodes)."""
        num_points = len(self._points)
        start = bisect_right(self._points, ring_point(key))
        seen: set[InstanceId] = set()
        for step in range(num_points):
            node = self._point_owners[(start + step) % num_points]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return


class SessionAffinityPolicy(RoutingPolicy):
    """Route by a consistent hash of `session_id`. A request without one goes to the
    instance with the lowest QPS, as the production stack does.

    The lowest-QPS fallback follows `_qps_routing`: an instance this router has never
    sent a request to comes first, in view order. Otherwise the instance with the
    fewest requests routed in the last `qps_window_s` wins, and the first wins ties.
    An instance that cannot hold the request counts as absent from the ring, so the
    session goes to the next instance clockwise.
    """

    deadline_aware: ClassVar[bool] = False

    def __init__(self, vnodes_per_instance: int = VNODES_PER_INSTANCE,
                 qps_window_s: float = QPS_WINDOW_S) -> None:
        self.ring = HashRing(vnodes_per_instance)
        self.qps_window_s = qps_window_s
        self._routed_s: dict[InstanceId, deque[float]] = {}  # instance -> routing times

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        if request.session_id is None:
            chosen = self.lowest_qps(candidates, now)
        else:
            self.ring.sync(v.instance_id for v in view.instances)
            holding = {v.instance_id for v in candidates}
            chosen = next(i for i in self.ring.walk(request.session_id) if i in holding)
        self._routed_s.setdefault(chosen, deque()).append(now)
        return chosen

    def lowest_qps(self, candidates: Sequence[InstanceView], now: float) -> InstanceId:
        for v in candidates:
            if v.instance_id not in self._routed_s:
                return v.instance_id
        return min(candidates, key=lambda v: self._num_recent(v.instance_id, now)).instance_id

    def _num_recent(self, instance_id: InstanceId, now: float) -> int:
        times = self._routed_s[instance_id]
        while times and times[0] < now - self.qps_window_s:
            times.popleft()
        return len(times)
