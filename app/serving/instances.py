"""The live router's picture of its engines: who they are, what they last reported,
which of the router's own flights each one holds, and the cluster views routing reads.

Polling feeds the reports to the status estimator and the policy's listeners and
exports each instance's gauges; following the controller's registry adds engines,
marks leaving ones as draining and forgets them once nothing of the router's is on
them. What to do with the flights (routing, moves, evacuation) stays with the router.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from app.control.fleet import Member
from app.control.plan import EngineState
from app.engines.config import EngineConfig, EngineRole, SchedulingPolicy
from app.engines.messages import EngineRecord, EngineRequest, EngineStatus, TokenEvent
from app.engines.prefix import PREFIX_BLOCK_SIZE, PrefixCache
from app.hardware.specs import InstanceSpec
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView
from app.serving.flight import Flight
from app.serving.telemetry import RouterMetrics

logger = logging.getLogger(__name__)


class EngineClient(ABC):
    """Transport to one engine: what the router needs and nothing else."""

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        self.engine_id = engine_id
        self.config = config

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        """Stream the request's tokens, a batch per engine iteration."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request on the engine; True if it was there."""

    @abstractmethod
    async def status(self) -> EngineStatus:
        """The engine's black-box report."""

    def read(self, request_id: str, from_index: int) -> AsyncIterator[list[TokenEvent]]:
        """A submission already running (or just ended) there, from output index
        `from_index`: what a router replica re-attaching the request reads."""
        raise NotImplementedError(f"engine {self.engine_id} keeps no output journal")

    async def find(self, request_id: str) -> list[EngineRecord]:
        """The submissions of client request `request_id` the engine holds (none when it
        keeps no journal)."""
        return []


@dataclass(eq=False)
class LiveInstance:
    client: EngineClient
    spec: InstanceSpec
    status: EngineStatus | None = None
    healthy: bool = False  # reachable at the last poll
    watched_epoch: int = 0  # num_iterations // tau at the last watchdog check
    prefixes: PrefixCache | None = None  # block hashes sent here; sized at the first report
    # what other router replicas had running / waiting here at the last poll
    others_running: int = 0
    others_waiting: int = 0
    draining: bool = False  # out of the registry's serving set: takes no new request
    left: bool = False  # gone from the registry: forgotten once nothing of ours is on it

    def remember_prefix(self, block_hashes: Sequence[int]) -> None:
        if self.prefixes is not None:
            self.prefixes.insert(block_hashes, PREFIX_BLOCK_SIZE)

    def update(self, status: EngineStatus, own_outstanding: int) -> None:
        """Take a report; the engine's requests beyond this router's own
        (`own_outstanding`) belong to other replicas, and count as waiting first
        when the engine has a queue."""
        self.status, self.healthy = status, True
        others = max(status.num_running + status.num_waiting - own_outstanding, 0)
        self.others_waiting = min(others, status.num_waiting)
        self.others_running = others - self.others_waiting
        if self.prefixes is None:
            blocks = status.num_kv_blocks_used + status.num_kv_blocks_free
            self.prefixes = PrefixCache(blocks * status.kv_block_size)

    @property
    def instance_id(self) -> InstanceId:
        return self.client.engine_id

    def reported_view(self) -> InstanceView:
        """The instance as its latest report shows it (the router adds its own load)."""
        assert self.status is not None
        return InstanceView.from_status(self.status, self.spec,
                                        self.client.config.scheduler.max_num_seqs)

    @property
    def tags(self) -> dict[str, str]:
        """The instance's metric tags."""
        config = self.client.config
        return {"instance": self.instance_id, "gpu_type": config.gpu_type,
                "role": config.role.value}


class OwnLoad:
    """This router's flights per instance, split into running and waiting, kept as
    they change (the views read the counts at every decision and every poll; the
    watchdog reads one instance's flights at each of its checks)."""

    def __init__(self) -> None:
        self._flights: dict[tuple[InstanceId, bool], dict[str, Flight]] = {}
        self._keys: dict[str, tuple[InstanceId, bool]] = {}  # where each flight is counted

    def update(self, flight: Flight) -> None:
        """Count the flight where it is now, as running or waiting (a no-op when that
        has not changed: every token batch asks)."""
        key = (flight.instance_id, flight.is_running)
        if self._keys.get(flight.request_id) == key:
            return
        self.remove(flight)
        self._keys[flight.request_id] = key
        self._flights.setdefault(key, {})[flight.request_id] = flight

    def remove(self, flight: Flight) -> None:
        key = self._keys.pop(flight.request_id, None)
        if key is not None:
            del self._flights[key][flight.request_id]

    def running(self, instance_id: InstanceId) -> int:
        return len(self._flights.get((instance_id, True), ()))

    def waiting(self, instance_id: InstanceId) -> int:
        return len(self._flights.get((instance_id, False), ()))

    def waiting_priorities(self, instance_id: InstanceId) -> tuple[int, ...]:
        """The engine priorities of this router's flights waiting there, ascending."""
        waiting = self._flights.get((instance_id, False), {})
        return tuple(sorted(f.route.priority for f in waiting.values()))

    def flights_on(self, instance_id: InstanceId) -> list[Flight]:
        return [f for running in (True, False)
                for f in self._flights.get((instance_id, running), {}).values()]


class InstanceTracker:
    """The engines one router routes over, their latest reports and its own load there."""

    def __init__(self, clients: Sequence[EngineClient], *, estimator: StatusEstimator,
                 listeners: Sequence, metrics: RouterMetrics, clock: Callable[[], float],
                 status_timeout_s: float) -> None:
        self.instances = {c.engine_id: LiveInstance(c, c.config.instance) for c in clients}
        if len(self.instances) != len(clients):
            raise ValueError("engine ids must be unique")
        self.load = OwnLoad()  # the router's flights per instance, counted
        self.estimator = estimator
        self.listeners = listeners  # told each report (`on_status`)
        self.metrics = metrics
        self.clock = clock
        self.status_timeout_s = status_timeout_s

    # ---- polling -------------------------------------------------------------------
    async def poll(self, inst: LiveInstance) -> bool:
        """Ask the engine for its report; False (and out of rotation) when it does not
        answer in time."""
        try:
            status = await asyncio.wait_for(inst.client.status(), self.status_timeout_s)
        except Exception as exc:
            self.unreachable(inst, str(exc))
            return False
        self.take(inst, status)
        return True

    def unreachable(self, inst: LiveInstance, reason: str) -> None:
        """The engine did not answer: out of rotation until it reports again."""
        if inst.healthy:
            logger.warning("engine %s unreachable: %s", inst.instance_id, reason)
        inst.healthy = False
        self.metrics.instance_state(inst.tags, {"healthy": 0.0})

    def take(self, inst: LiveInstance, status: EngineStatus) -> None:
        """An engine's report, polled here or published for every replica."""
        iid = inst.instance_id
        previous = inst.status
        inst.update(status, self.load.running(iid) + self.load.waiting(iid))
        now = self.clock()
        for listener in self.listeners:
            listener.on_status(status, now)
        self._export(inst, previous, now)

    def _export(self, inst: LiveInstance, previous: EngineStatus | None, now: float) -> None:
        """The instance's gauges: its load, KV, iteration rate and what the status
        estimator makes of it (q_g, p_g, d_g for a request joining now)."""
        status = inst.status
        assert status is not None
        rate = 0.0
        if previous is not None and status.time_s > previous.time_s:
            rate = (status.num_iterations - previous.num_iterations) / (
                status.time_s - previous.time_s)
        estimate = self.estimator.estimate(inst.reported_view(), now)
        self.metrics.instance_state(inst.tags, {
            "queue_delay_seconds": estimate.queue_delay_s,
            "prefill_seconds_per_token": estimate.prefill_s_per_token,
            "decode_seconds_per_token": estimate.decode_s_per_token,
            "running": status.num_running,
            "waiting": status.num_waiting,
            "kv_usage": status.kv_usage,
            "iterations_per_second": rate,
            "healthy": 1.0,
        })

    # ---- views -----------------------------------------------------------------------
    def view(self, now: float, role: EngineRole,
             exclude: frozenset[InstanceId] = frozenset()) -> ClusterView:
        """The healthy, serving instances of `role` with their latest reports and their
        load: the router's own requests, current at every decision, plus what other
        router replicas had there at the last poll (routing on its own requests alone,
        each replica would see an instance the others fill as idle). An engine in
        priority mode lists the priorities of the router's own waiting requests; the
        other replicas' count as ahead of a newcomer."""
        views = []
        for iid, inst in self.instances.items():
            config = inst.client.config
            if (not inst.healthy or inst.status is None or iid in exclude or inst.draining
                    or config.role != role):
                continue
            ordered = config.scheduler.scheduling_policy is SchedulingPolicy.PRIORITY
            views.append(replace(inst.reported_view(), num_running=self.num_running(iid),
                                 num_waiting=self.load.waiting(iid) + inst.others_waiting,
                                 waiting_priorities=(self.load.waiting_priorities(iid)
                                                     if ordered else None)))
        return ClusterView(now, tuple(views), self.prefix_blocks)

    def num_running(self, instance_id: InstanceId) -> int:
        """Requests running on the instance: this router's own, now, and the other
        replicas' at the last poll."""
        return self.load.running(instance_id) + self.instances[instance_id].others_running

    def prefix_blocks(self, instance_id: InstanceId, hashes: Sequence[int]) -> int:
        """Leading prompt blocks the router has sent the instance (and not yet aged out)."""
        prefixes = self.instances[instance_id].prefixes
        return 0 if prefixes is None else prefixes.peek(hashes)

    # ---- membership ------------------------------------------------------------------
    def follow(self, members: Sequence[Member],
               make_client: Callable[[Member], EngineClient]) -> list[LiveInstance]:
        """Take a new registry: returns the engines that joined (routable after their
        first report); draining ones take no new request from now on, and engines gone
        from it are forgotten once none of the router's flights is on them."""
        listed = {m.engine_id: m for m in members}
        joined = []
        for engine_id, member in listed.items():
            if engine_id not in self.instances:
                inst = LiveInstance(make_client(member), member.config.instance)
                self.instances[engine_id] = inst
                joined.append(inst)
        for engine_id, inst in self.instances.items():
            member = listed.get(engine_id)
            inst.draining = member is None or member.state is not EngineState.ACTIVE
            inst.left = member is None
        return joined

    def forget_left(self, instance_ids: Sequence[InstanceId]) -> None:
        """Drop instances that left the registry once no flight of the router is on them."""
        for iid in set(instance_ids):
            inst = self.instances.get(iid)
            if (inst is not None and inst.draining and inst.left
                    and not self.load.flights_on(iid)):
                del self.instances[iid]
