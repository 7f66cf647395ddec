"""Elastic pools in the simulator: a scaler decides every interval, engines boot and drain.

The simulator's counterpart of the controller actor. Every `interval_s` of virtual
time the scaler (the SARA controller, or an autoscaler it is compared with) sees the
engine registry and returns a plan diff; this shell applies it: new engines join
their pool `startup_s` later, drained engines stop taking requests, are stopped once
empty, and past the drain deadline their requests move by token ids to the
instance the routing policy picks. GPU time is counted from an engine's start to its
stop, start-up included, since a booting GPU is paid for.

Agent sessions survive a scale-down. A step running on a draining engine finishes
there (or moves at the drain deadline, as any request). A session waiting on a tool
keeps its context (the last prompt's cached blocks) on the engine whose prefix cache
its next step would hit: the prefill engine that prefilled its last step, or the unified
engine that ran it (decoders in disaggregated mode receive the whole context with each
step, so none holds a session). When that engine drains, or a step ends on an engine
already draining, the context moves to the open engine of the pool with the most free
KV, by the path `plan_move` prefers: its KV over the link into the target's prefix
cache (the engine is not stopped until the move has left it), or by token ids, i.e. the
session's next step recomputes it wherever it is routed. Each such context counts as
moved or recomputed; no step is dropped. The scaler's window gets every step's arrival
and end with its session, as the routers would report them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from app.control.controller import ControlStep
from app.control.observe import LoadWindow
from app.control.plan import EngineRecord, EngineState
from app.engines.config import EngineRole
from app.hardware.specs import make_instance
from app.planning.inventory import Stock
from app.planning.split import EngineKind
from app.routing.base import Reject
from app.routing.instance_view import InstanceId
from app.routing.move_path import MovePath, plan_move
from app.routing.view import ClusterView
from app.sim.cluster import SimCluster
from app.sim.events import ContextMoveDoneEvent, ControlEvent, EngineReadyEvent, Event
from app.sim.flight import SimFlight
from app.sim.instance import InstanceSetup, SimInstance
from app.sim.records import DEADLINE_TOLERANCE_S


class Scaler(Protocol):
    """Anything that turns observations and the registry into plan diffs (the SARA
    `Controller`, or an autoscaler it is compared with)."""

    @property
    def interval_s(self) -> float: ...

    @property
    def window(self) -> LoadWindow: ...  # the routers' reports go here

    def step(self, now: float, engines: Sequence[EngineRecord]) -> ControlStep: ...


@dataclass(frozen=True)
class PoolSample:
    """Pool sizes after one control step (for plots)."""

    time_s: float
    serving: Mapping[str, int]  # role -> engines taking requests
    starting: Mapping[str, int]  # role -> engines booting
    draining: int


@dataclass
class ElasticStats:
    """What the run cost and how often engines moved."""

    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    num_started: int = 0
    num_stopped: int = 0
    num_drain_migrations: int = 0  # requests moved off draining engines
    num_contexts_moved: int = 0  # session contexts moved by KV off draining engines
    num_contexts_recomputed: int = 0  # session contexts left for the next step to recompute
    context_moved_bytes: float = 0.0
    stopped_s: dict[str, float] = field(default_factory=dict)  # engine id -> when stopped
    samples: list[PoolSample] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0


@dataclass
class SessionContext:
    """A session between steps: the engine holding its context and the context's blocks."""

    engine_id: str
    block_hashes: tuple[int, ...]
    hash_block_size: int


def context_target(view: ClusterView, num_tokens: int) -> InstanceId | None:
    """Where a session's context goes off a draining engine: the open engine with the
    most free KV blocks that holds it (then the fewest waiting); None: nowhere."""
    fits = [v for v in view.instances if num_tokens + 1 <= v.num_kv_blocks * v.kv_block_size]
    if not fits:
        return None
    return max(fits, key=lambda v: (v.num_kv_blocks_free, -v.num_waiting)).instance_id


def engine_setup(model: str, role: str, kind: EngineKind) -> InstanceSetup:
    """A simulated engine of `kind` serving `model` in `role`."""
    return InstanceSetup(make_instance(kind.gpu, model, kind.tp), kind.scheduler(),
                         EngineRole(role))


class ElasticPools:
    """Applies a scaler's plan diffs to a `SimCluster`'s pools."""

    def __init__(self, scaler: Scaler, model: str, stock: Sequence[Stock],
                 startup_s: float) -> None:
        if startup_s < 0:
            raise ValueError(f"start-up time must be >= 0, got {startup_s}")
        self.scaler = scaler
        self.model = model
        self.prices = {s.kind: s.price_per_hour for s in stock}
        self.startup_s = startup_s
        self.records: dict[str, EngineRecord] = {}
        self.instances: dict[str, SimInstance] = {}
        self.started_s: dict[str, float] = {}
        self.stats = ElasticStats()
        self.steps: list[ControlStep] = []  # every decision, with what it was based on
        self._ids = itertools.count()
        self.cluster: SimCluster | None = None
        self._ends_session: frozenset[int] = frozenset()  # request indices no step waits for
        self._in_flight: dict[str, int] = {}  # session id -> its steps issued, not finished
        self._contexts: dict[str, SessionContext] = {}  # session id -> context in a tool wait
        self._outbound: dict[str, int] = {}  # engine id -> context moves leaving it

    def attach(self, cluster: SimCluster, now: float) -> list[Event]:
        """Register the cluster's initial engines (serving at `now`); first control step."""
        self.cluster = cluster
        graph = cluster.releases.graph
        if graph is not None:
            self._ends_session = frozenset(i for i, c in enumerate(graph.children()) if not c)
        for pool in cluster.pools.values():
            for inst in pool.instances:
                kind = EngineKind(inst.spec.gpu.name, inst.spec.tp, inst.core.config.max_num_seqs)
                self.prices.setdefault(kind, inst.spec.gpu.price_per_hour * inst.spec.tp)
                self._register(inst, kind, EngineState.ACTIVE, now)
        return [ControlEvent(now + self.scaler.interval_s)]

    # ---- registry -------------------------------------------------------------
    def _register(self, inst: SimInstance, kind: EngineKind, state: EngineState,
                  now: float) -> None:
        self.instances[inst.instance_id] = inst
        self.records[inst.instance_id] = EngineRecord(inst.instance_id, inst.role.value, kind,
                                                      state, now)
        self.started_s[inst.instance_id] = now

    def _set_state(self, engine_id: str, state: EngineState, now: float) -> None:
        self.records[engine_id] = replace(self.records[engine_id], state=state, since_s=now)

    def registry(self) -> list[EngineRecord]:
        """Records with current running counts (what the routers would report)."""
        return [self._reported(r, self.instances[r.engine_id]) for r in self.records.values()]

    def _reported(self, record: EngineRecord, inst: SimInstance) -> EngineRecord:
        """`running` counts the context moves still leaving it (stopped only after)."""
        core = inst.core
        held = inst.num_held + self._outbound.get(inst.instance_id, 0)
        return replace(record, running=held, waiting=len(core.waiting),
                       kv_usage=1.0 - core.num_free_blocks / core.num_kv_blocks)

    # ---- what the routers report, per step -----------------------------------------
    def arrived(self, flight: SimFlight, now: float) -> None:
        """A request (an agent step) was issued: into the scaler's window."""
        work = flight.work
        window = self.scaler.window
        uncached = None if work.num_appended_tokens is None else max(work.num_appended_tokens, 1)
        window.arrival(work.num_prompt_tokens, uncached)
        session_id = work.session_id
        if session_id is None:
            return
        window.sessions.step_issued(session_id, now)
        self._contexts.pop(session_id, None)  # the step takes its context wherever it goes
        self._in_flight[session_id] = self._in_flight.get(session_id, 0) + 1

    def finished(self, flight: SimFlight, inst: SimInstance, now: float) -> list[Event]:
        """A request finished on `inst`: into the window; a session entering a tool wait
        leaves its context where the next step would hit it, moved at once if that
        engine is draining."""
        record, work = flight.record, flight.work
        window = self.scaler.window
        window.finished(record.num_generated_tokens,
                        now <= record.deadline_s + DEADLINE_TOLERANCE_S)
        session_id = work.session_id
        if session_id is None:
            return []
        ends = flight.index in self._ends_session
        context = work.num_prompt_tokens + record.num_generated_tokens
        window.sessions.step_done(session_id, now, context, ends)
        self._in_flight[session_id] -= 1
        if self._in_flight[session_id]:
            return []  # a parallel call of the same step still runs
        del self._in_flight[session_id]
        if ends:
            return []
        home = record.prefill_instance_id or inst.instance_id
        self._contexts[session_id] = SessionContext(home, work.block_hashes,
                                                   work.hash_block_size)
        home_inst = self.instances.get(home)
        if home_inst is None or self._cluster().pools[home_inst.role].is_open(home_inst):
            return []
        return self._move_context(session_id, now)

    # ---- session contexts off draining engines -------------------------------------
    def _evacuate_contexts(self, engine_id: str, now: float) -> list[Event]:
        events: list[Event] = []
        for session_id in [s for s, c in self._contexts.items() if c.engine_id == engine_id]:
            events.extend(self._move_context(session_id, now))
        return events

    def _move_context(self, session_id: str, now: float) -> list[Event]:
        """Move a waiting session's context off its draining engine, by the path
        `plan_move` prefers (token ids: the next step recomputes it)."""
        cluster = self._cluster()
        context = self._contexts[session_id]
        source = self.instances.get(context.engine_id)
        if source is None:
            return []
        num_blocks = source.core.prefix_cache.peek(context.block_hashes)
        if num_blocks == 0:
            return []  # evicted already: nothing left to keep
        hashes = context.block_hashes[:num_blocks]
        num_tokens = num_blocks * context.hash_block_size
        pool = cluster.pools[source.role]
        target_id = context_target(pool.snapshot(now), num_tokens)
        if target_id is None:
            self.stats.num_contexts_recomputed += 1
            return []
        target = pool.by_id[target_id]
        cached = min(target.core.prefix_cache.peek(hashes) * context.hash_block_size,
                     num_tokens)
        if cached == num_tokens:
            return []  # the target holds it already (the app's shared prefix, say)
        plan = plan_move(target.spec, num_tokens, cached, cluster.link, now,
                         num_loadable_tokens=num_tokens,
                         num_running_on_target=len(target.core.running),
                         rule=cluster.move_rule)
        if plan.path is MovePath.TOKEN_IDS:
            self.stats.num_contexts_recomputed += 1
            return []
        done_s = cluster.link.enqueue(now, plan.num_kv_bytes)
        self.stats.num_contexts_moved += 1
        self.stats.context_moved_bytes += plan.num_kv_bytes
        self._outbound[source.instance_id] = self._outbound.get(source.instance_id, 0) + 1
        return [ContextMoveDoneEvent(done_s, session_id, source, target, hashes,
                                     context.hash_block_size)]

    def context_moved(self, move: ContextMoveDoneEvent, now: float) -> list[Event]:
        """A moved context landed: the target caches it, the source may stop."""
        move.target.core.cache_context(move.block_hashes, move.hash_block_size)
        self._cluster().pools[move.target.role].mark_dirty(move.target)
        self._outbound[move.source.instance_id] -= 1
        context = self._contexts.get(move.session_id)
        if context is not None and context.engine_id == move.source.instance_id:
            context.engine_id = move.target.instance_id
        return []

    # ---- control steps -------------------------------------------------------------
    def control(self, now: float) -> list[Event]:
        cluster = self._cluster()
        step = self.scaler.step(now, self.registry())
        self.steps.append(step)
        diff = step.diff
        events: list[Event] = []
        for role, kind in diff.start:
            events.append(self._start(role, kind, now))
        for engine_id in diff.reactivate:
            self._set_state(engine_id, EngineState.ACTIVE, now)
            inst = self.instances[engine_id]
            cluster.pools[inst.role].reopen(inst)
        for engine_id in diff.drain:
            self._set_state(engine_id, EngineState.DRAINING, now)
            inst = self.instances[engine_id]
            cluster.pools[inst.role].close(inst)
            events.extend(self._evacuate_contexts(engine_id, now))
        for engine_id in diff.stop:
            self._stop(engine_id, now)
        for engine_id in diff.migrate:
            events.extend(self._evacuate(engine_id, now))
        if diff.reactivate:
            events.extend(cluster.drain_router_queue(now))
        self._sample(now)
        if not cluster.finished:
            events.append(ControlEvent(now + self.scaler.interval_s))
        return events

    def _start(self, role: str, kind: EngineKind, now: float) -> EngineReadyEvent:
        setup = engine_setup(self.model, role, kind)
        inst = SimInstance(f"{setup.spec.name}-{role}-x{next(self._ids)}", setup, -1)
        self._register(inst, kind, EngineState.STARTING, now)
        self.stats.num_started += 1
        return EngineReadyEvent(now + self.startup_s, inst)

    def ready(self, inst: SimInstance, now: float) -> list[Event]:
        """A started engine finished booting (unless it was stopped meanwhile)."""
        record = self.records.get(inst.instance_id)
        if record is None or record.state is not EngineState.STARTING:
            return []
        cluster = self._cluster()
        self._set_state(inst.instance_id, EngineState.ACTIVE, now)
        cluster.pools[inst.role].add(inst)
        return cluster.drain_router_queue(now)

    def _stop(self, engine_id: str, now: float) -> None:
        record = self.records.pop(engine_id)
        inst = self.instances.pop(engine_id)
        if record.state is not EngineState.STARTING:  # a booting engine never joined a pool
            if inst.num_held:
                raise RuntimeError(f"{engine_id} stopped with requests on it")
            self._cluster().pools[inst.role].close(inst)
        self._charge(engine_id, record.kind, now)
        self.stats.num_stopped += 1
        self.stats.stopped_s[engine_id] = now

    def _charge(self, engine_id: str, kind: EngineKind, now: float) -> None:
        seconds = now - self.started_s.pop(engine_id)
        self.stats.gpu_seconds += seconds * kind.tp
        self.stats.cost_usd += seconds / 3600.0 * self.prices.get(kind, 0.0)

    def _evacuate(self, engine_id: str, now: float) -> list[Event]:
        """Move a draining engine's requests by token ids to where the policy routes them."""
        cluster = self._cluster()
        inst = self.instances[engine_id]
        pool = cluster.pools[inst.role]
        events: list[Event] = []
        for request_id in list(inst.core.requests):
            view = pool.snapshot(now)
            flight = cluster.flights[request_id]
            choice = cluster.policy.choose(flight.route, view, now) if view.instances else None
            if choice is None or isinstance(choice, Reject):
                continue  # nowhere to go: it finishes where it is
            events.extend(cluster.migrate(inst, request_id, choice, now))
            self.stats.num_drain_migrations += 1
        return events

    def _sample(self, now: float) -> None:
        serving: dict[str, int] = {}
        starting: dict[str, int] = {}
        for record in self.records.values():
            if record.state is EngineState.ACTIVE:
                serving[record.role] = serving.get(record.role, 0) + 1
            elif record.state is EngineState.STARTING:
                starting[record.role] = starting.get(record.role, 0) + 1
        draining = sum(r.state is EngineState.DRAINING for r in self.records.values())
        self.stats.samples.append(PoolSample(now, serving, starting, draining))

    def close_books(self, now: float) -> ElasticStats:
        """End of run: charge every engine still held up to `now`."""
        for engine_id, record in list(self.records.items()):
            self._charge(engine_id, record.kind, now)
        self.records.clear()
        return self.stats

    def _cluster(self) -> SimCluster:
        if self.cluster is None:
            raise RuntimeError("elastic pools are not attached to a cluster")
        return self.cluster
