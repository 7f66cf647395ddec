"""Discrete-event simulator of a serving cluster in virtual time.

The loop is Vidur's: pop the earliest event, handle it, push what the handler
returned. Each instance runs the shared `SimEngineCore`; routing, watchdog and
feedback go through the same policy objects the live router calls. Runs are
deterministic for a seed: the only randomness lives in the policies' own RNGs
and the per-request token seeds. Iterations that repeat an engine's decode batch
take no events of their own: the cluster applies them before the next event
(`SimCluster.settle`, "decode runs" in `app.sim.cluster`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.engines.config import ClusterConfig
from app.routing.base import RoutingPolicy, Watchdog
from app.routing.context_keeping import ContextKeeper
from app.routing.disaggregated import LeastTtftPolicy
from app.routing.move_path import MoveRule
from app.routing.priority import PriorityRule
from app.sim.cluster import SimCluster
from app.sim.elastic import ElasticPools, ElasticStats
from app.sim.events import ArrivalEvent, Event, heap_key
from app.sim.instance import InstanceSetup, setups_from_config
from app.sim.records import RequestRecord
from app.workloads.sessions import StepReleases
from app.workloads.workload import Workload, WorkloadRequest

PROGRESS_EVERY_EVENTS = 8192


@dataclass(frozen=True)
class SimResult:
    """Records of one run plus the figures needed to turn them into rates."""

    records: tuple[RequestRecord, ...]
    duration_s: float  # arrival window: the goodput denominator
    makespan_s: float  # virtual time of the last processed event or iteration end
    num_events: int  # events handled (the iterations of decode runs take none)
    num_token_events: int
    num_preemptions: int
    num_kv_transfers: int
    wall_s: float
    elastic: ElasticStats | None = None  # elastic pools: GPU time, cost, pool sizes

    @property
    def num_requests(self) -> int:
        return len(self.records)


class Simulator:
    """One cluster, one policy (plus optional prefill policy and watchdog).

    Policies are used as given and not reset between `run` calls; build fresh ones
    to repeat a run exactly.
    """

    def __init__(
        self,
        instances: Sequence[InstanceSetup],
        policy: RoutingPolicy,
        *,
        prefill_policy: LeastTtftPolicy | None = None,
        watchdog: Watchdog | None = None,
        kv_link_gbps: float = 25.0,
        max_ongoing_requests: int | None = None,
        max_drain_s: float | None = None,
        seed: int = 0,
        elastic: ElasticPools | None = None,
        move_rule: MoveRule = MoveRule.CHEAPER,
        request_priority: PriorityRule = PriorityRule.NONE,
        bulk_steps: bool = True,
        context_keeper: ContextKeeper | None = None,
    ) -> None:
        """
        prefill_policy: disaggregated mode only; picks the prefill instance (default:
            least estimated TTFT) while `policy` picks the decode instance on the
            estimate that includes prefill and KV transfer, both at arrival.
        max_ongoing_requests: per-instance cap (waiting + running) on the entry pool;
            above it requests wait in a FIFO router queue, as in Ray Serve.
        max_drain_s: stop this long after the last arrival; unfinished requests
            then count as violated (None: run until every request is done).
        elastic: a scaler resizes the pools every interval (the instances given are
            the initial pools); single use, like the policies.
        move_rule: how migrations reach their target (token ids, KV over the link, or
            the cheaper of the two per move).
        request_priority: the engine priority each request is sent with.
        bulk_steps: apply the iterations that repeat an engine's decode batch between
            events, without an event pair each (same records, fewer events); False
            steps every iteration through the event queue (what tests compare against).
        context_keeper: pins an agent session's context on its engine through a tool
            wait where it judges that worth it (unified engines; single use).
        """
        if max_ongoing_requests is not None and max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests}")
        if max_drain_s is not None and max_drain_s < 0:
            raise ValueError(f"max_drain_s must be >= 0, got {max_drain_s}")
        self.instances = list(instances)
        self.policy = policy
        self.prefill_policy = prefill_policy
        self.watchdog = watchdog
        self.kv_link_gbps = kv_link_gbps
        self.max_ongoing_requests = max_ongoing_requests
        self.max_drain_s = max_drain_s
        self.seed = seed
        self.elastic = elastic
        self.move_rule = move_rule
        self.request_priority = request_priority
        self.bulk_steps = bulk_steps
        self.context_keeper = context_keeper

    @classmethod
    def from_config(
        cls, cluster: ClusterConfig, policy: RoutingPolicy, **kwargs
    ) -> Simulator:
        kwargs.setdefault("move_rule", cluster.move_path)
        kwargs.setdefault("request_priority", cluster.request_priority)
        kwargs.setdefault("context_keeper", ContextKeeper() if cluster.keep_session_kv else None)
        return cls(setups_from_config(cluster), policy, kv_link_gbps=cluster.kv_link_gbps,
                   **kwargs)

    def run(
        self,
        workload: Workload | Sequence[WorkloadRequest],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> SimResult:
        """Simulate the workload to the end; `progress(n)` gets newly completed counts."""
        requests = workload.requests if isinstance(workload, Workload) else tuple(workload)
        graph = workload.graph if isinstance(workload, Workload) else None
        _check_requests(requests)
        cluster = self._make_cluster(StepReleases(requests, graph))
        started = time.perf_counter()
        makespan_s, num_events = self._loop(cluster, requests, progress)
        records = tuple(cluster.finalize(makespan_s))
        elastic = None if self.elastic is None else self.elastic.close_books(makespan_s)
        if isinstance(workload, Workload):
            duration_s = workload.duration_s
        else:
            duration_s = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
        return SimResult(
            records=records,
            duration_s=duration_s,
            makespan_s=makespan_s,
            num_events=num_events,
            num_token_events=cluster.num_token_events,
            num_preemptions=cluster.num_preemptions,
            num_kv_transfers=cluster.link.num_transfers,
            wall_s=time.perf_counter() - started,
            elastic=elastic,
        )

    def _make_cluster(self, releases: StepReleases) -> SimCluster:
        return SimCluster(
            self.instances,
            releases,
            self.policy,
            prefill_policy=self.prefill_policy,
            watchdog=self.watchdog,
            kv_link_gbps=self.kv_link_gbps,
            max_ongoing_requests=self.max_ongoing_requests,
            seed=self.seed,
            elastic=self.elastic,
            move_rule=self.move_rule,
            request_priority=self.request_priority,
            bulk_steps=self.bulk_steps,
            context_keeper=self.context_keeper,
        )

    def _loop(
        self,
        cluster: SimCluster,
        requests: Sequence[WorkloadRequest],
        progress: Callable[[int], None] | None,
    ) -> tuple[float, int]:
        """Pop, handle, push; returns (time of the last event, events handled)."""
        if not requests:
            return 0.0, 0
        stop_s = math.inf
        if self.max_drain_s is not None:  # after the last arrival known in advance
            stop_s = requests[-1].arrival_s + self.max_drain_s
        heap: list[tuple[float, int, int, Event]] = []
        seq = itertools.count()

        def push(event: Event) -> None:
            heapq.heappush(heap, (*heap_key(event, next(seq)), event))

        first = cluster.releases.first()
        assert first is not None
        push(ArrivalEvent(first.time_s, first.index))
        if self.elastic is not None:  # the pools the cluster was built with
            for event in self.elastic.attach(cluster, requests[0].arrival_s):
                push(event)
        now, num_events, reported = 0.0, 0, 0
        while True:
            if not heap or heap[0][0] > stop_s:
                # the iterations that end by the stop; a watchdog check among them may
                # still start a batch by then
                late = cluster.settle(stop_s, inclusive=True)
                if not late:
                    break
                for event in late:
                    push(event)
                continue
            ties = cluster.settle(heap[0][0], before=heap[0][-1])  # decode runs catch up
            if ties:
                for event in ties:
                    push(event)
                continue
            now, _, _, event = heapq.heappop(heap)
            for follow_up in event.handle(cluster):
                push(follow_up)
            num_events += 1
            if progress is not None and num_events % PROGRESS_EVERY_EVENTS == 0:
                progress(cluster.num_done - reported)
                reported = cluster.num_done
        if progress is not None:
            progress(len(requests) - reported)  # everything is settled once the loop ends
        return max(now, cluster.quiet_end_s), num_events


def _check_requests(requests: Sequence[WorkloadRequest]) -> None:
    """Arrivals must be sorted (the next arrival is scheduled lazily) and ids unique."""
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique")
    for prev, cur in itertools.pairwise(requests):
        if cur.arrival_s < prev.arrival_s:
            raise ValueError(
                f"requests must be sorted by arrival: {cur.request_id} at {cur.arrival_s} "
                f"after {prev.request_id} at {prev.arrival_s}"
            )
