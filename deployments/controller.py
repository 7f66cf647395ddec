"""The controller actor: owns one application's engines, publishes the registry every
router replica follows, and resizes the pools from SARA's allocation.

A thin Ray shell. Decisions come from app/control (`Controller` decides, `Fleet`
keeps the registry); this actor creates and kills engine actors, polls them, applies
plan diffs and answers the routers:
- engines are plain named detached actors, so the controller picks exactly which one
  leaves, and they outlive a controller restart; each carries the state the
  controller gave it (`EngineActor.label`), from which a restarted controller
  rebuilds its registry;
- routers long-poll `registry(known_key)` and push their arrival and completion
  tallies, with their agent steps' arrivals and ends, with `report`;
- it polls every engine's status once per poll period and publishes the reports on a
  `StatusBoard`; every router replica long-polls `engine_statuses(version)`, so an
  engine answers one status call per period however many replicas route to it;
- it watches its Serve application: once the application is gone (`serve shutdown`,
  `serve delete`), it stops every engine it started and exits, so no GPU stays held
  by nothing. A router replica restart changes nothing here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Any

import ray
from ray import serve

from app.control.controller import Controller, ControlStep
from app.control.fleet import Fleet, Registry, engine_kind, engine_name, template_for
from app.control.observe import LoadReport
from app.control.plan import EngineState, PlanDiff
from app.engines.config import EngineConfig
from app.engines.messages import EngineStatus
from app.routing.view import FinishReport
from app.serving.config import ServeConfig
from app.serving.status_board import BoardAnswer, StatusBoard
from app.serving.telemetry import ControllerMetrics
from deployments.cluster import ENGINE_NAMESPACE, launch_engine, numbered_config
from deployments.metrics import RayMetricFactory

logger = logging.getLogger(__name__)

APP_CHECK_S = 2.0  # how often the controller looks for its application
APP_MISSES = 3  # consecutive checks without it before the engines are stopped
APP_CHECK_TIMEOUT_S = 10.0
STATUS_TIMEOUT_S = 5.0


IN_FLIGHT_FRESH_S = 3.0  # a router's in-flight report counts this long (it polls every 1 s)


def controller_name(cluster_name: str) -> str:
    """Named per cluster, like its engines (`<cluster>-...`), without matching them."""
    return f"{cluster_name}:controller"


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ControllerActor:
    """One per application; get it with `controller_for`."""

    def __init__(self, config: ServeConfig, app_name: str | None) -> None:
        self.config = config
        self.app_name = app_name
        self.name = controller_name(config.cluster.name)
        self.fleet = Fleet(config.cluster.name, uuid.uuid4().hex[:12])
        self.handles: dict[str, Any] = {}
        self.controller: Controller | None = None
        self.steps: deque[ControlStep] = deque(maxlen=200)
        self._started: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._published = -1
        self._tasks: set[asyncio.Task] = set()
        # engine id -> [GPU kind, held from, held until (None: still held)], for costs
        self.ledger: dict[str, list] = {}
        self.metrics = ControllerMetrics(RayMetricFactory())
        self.in_flight: dict[str, tuple[int, float]] = {}  # replica -> (requests, when)
        self.board = StatusBoard()
        self._board_task: asyncio.Task | None = None
        self._board_ready: asyncio.Future | None = None  # done after the first round
        # engines launched from the cluster's groups: id -> the group's engine config
        self._static_configs: dict[str, EngineConfig] = {}

    # ---- the routers' side -------------------------------------------------------------
    async def registry(self, known: tuple[str, int] | None = None,
                       wait_s: float = 0.0) -> Registry | None:
        """The registry if its key differs from `known`; otherwise wait up to `wait_s`
        for a change (None when nothing changed)."""
        await self._ensure_started()
        deadline = time.monotonic() + wait_s
        while self.fleet.registry().key == known:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            assert self._changed is not None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return None
        return self.fleet.registry()

    async def engine_statuses(self, known: int = 0, wait_s: float = 0.0,
                              replica: str | None = None,
                              stalls: dict[str, float] | None = None,
                              finished: list[FinishReport] | None = None,
                              finish_cursor: int = 0) -> BoardAnswer:
        """The engines' reports published after version `known` (None: it did not
        answer), waiting up to `wait_s` for one, with what the other replicas told: their
        smallest slack per engine and the requests they saw finish after
        `finish_cursor`. `replica` names the router asking; `stalls` and `finished` are
        what it tells."""
        await self._ensure_started()
        if replica is not None and stalls is not None:
            self.board.tell(replica, stalls, finished or ())
        if self._board_task is None:
            self._board_ready = asyncio.get_running_loop().create_future()
            self._board_task = asyncio.ensure_future(self._publish_statuses_forever())
        assert self._board_ready is not None
        await asyncio.shield(self._board_ready)  # a router's first poll sees every engine
        version, changes = await self.board.wait_changes(known, wait_s, replica)
        cursor, others_finished = (self.board.others_finished(finish_cursor, replica)
                                   if replica is not None else (finish_cursor, []))
        return BoardAnswer(version, changes, self.board.others_stalls(replica), cursor,
                           others_finished)

    async def _publish_statuses_forever(self) -> None:
        """Every serving engine's report once per poll period. Each engine is asked on
        its own, so one slow to answer (busy, dying) is waited for no longer than the
        period, and a round's reports are published together: a replica's long poll
        then wakes once per round rather than once per engine (each wake is a call to
        the controller and back on the replica's event loop, which its requests wait
        for)."""
        polls: dict[str, asyncio.Task[EngineStatus | None]] = {}
        while True:
            next_round_s = time.monotonic() + self.config.poll_interval_s
            engines = {e.engine_id for e in self.fleet
                       if e.state is not EngineState.STARTING and e.engine_id in self.handles}
            for engine_id in engines - set(polls):
                polls[engine_id] = asyncio.ensure_future(self._engine_status(engine_id))
            for engine_id in set(polls) - engines:
                polls.pop(engine_id).cancel()
                self.board.forget(engine_id)
            first = self._board_ready is not None and not self._board_ready.done()
            if polls:  # the first round waits for every engine: a router's first view
                await asyncio.wait(polls.values(),
                                   timeout=None if first else self.config.poll_interval_s)
            for engine_id, poll in [(e, p) for e, p in polls.items() if p.done()]:
                del polls[engine_id]
                if engine_id in self.handles:  # not stopped meanwhile
                    self.board.publish(engine_id, poll.result())
            if first:
                assert self._board_ready is not None
                self._board_ready.set_result(None)
            await asyncio.sleep(max(next_round_s - time.monotonic(), 0.0))

    async def _engine_status(self, engine_id: str) -> EngineStatus | None:
        """One status call's reply; None: no answer in time, or the engine is dead."""
        try:
            return await asyncio.wait_for(self.handles[engine_id].status.remote(),
                                          STATUS_TIMEOUT_S)
        except ray.exceptions.ActorDiedError as exc:  # not merely unreachable for now
            logger.warning("engine %s died: %s", engine_id, exc)
            self._engine_died(engine_id)
            return None
        except Exception as exc:
            logger.warning("engine %s did not report: %s", engine_id, exc)
            return None

    def _engine_died(self, engine_id: str) -> None:
        """A dead engine (its process or its node lost) leaves the registry within the
        status round that found it, so the routers stop sending it requests. Without a
        control loop (which sizes the pools itself) one of its kind is launched in its
        place; it starts once a node of that kind has room."""
        if engine_id not in self.fleet:
            return
        self.fleet.remove(engine_id)
        self.handles.pop(engine_id, None)
        self._release(engine_id)
        self._publish()
        base = self._static_configs.pop(engine_id, None)
        if self.controller is None and base is not None:
            self._launch_static(base, self.fleet.next_index())

    async def router_load(self, replica: str, in_flight: int) -> None:
        """A router replica's requests in flight (sent with every registry poll)."""
        self.in_flight[replica] = (in_flight, time.monotonic())

    async def requests_in_flight(self) -> int:
        """Requests in flight over the router replicas that reported lately."""
        fresh_s = time.monotonic() - IN_FLIGHT_FRESH_S
        return sum(n for n, at in self.in_flight.values() if at >= fresh_s)

    async def close(self) -> None:
        """The application is shutting down: routers stop taking requests."""
        await self._ensure_started()
        self.fleet.close()
        self._publish()

    async def report(self, load: LoadReport) -> None:
        """A router's arrival and completion tallies and agent steps' events since its
        last report."""
        if self.controller is not None:
            self.controller.window.merge(load)

    async def sessions(self) -> list[dict[str, Any]]:
        """What each recent decision saw of agent sessions, with the mean prompt tokens
        their steps' cached context did not cover (operators and tests)."""
        return [{"time_s": s.stats.end_s, "starts": s.stats.session_starts,
                 "open": s.stats.open_sessions, "committed_rps": s.stats.committed_rps,
                 "held_kv_tokens": s.stats.held_kv_tokens,
                 "uncached_len": s.stats.mean_uncached_len} for s in self.steps]

    async def status(self) -> dict[str, Any]:
        """Registry, engine states and recent decisions (operators and tests)."""
        await self._ensure_started()
        registry = self.fleet.registry()
        return {
            "incarnation": registry.incarnation,
            "version": registry.version,
            "engines": [{"engine_id": e.engine_id, "gpu_type": e.config.gpu_type,
                         "tp": e.config.tp, "role": e.config.role.value,
                         "state": e.state.value, "owned": e.owned, "evacuate": e.evacuate}
                        for e in self.fleet],
            "steps": [s.summary() for s in self.steps],
            "status_board": {"version": self.board.version, "tellers": self.board.tellers,
                             "finishes_told": self.board.finishes.next_index,
                             "followers": {r: {"version": v, "answered_s_ago": round(
                                 time.monotonic() - at, 3)}
                                 for r, (v, at) in self.board.followers.items()}},
            "ledger": {i: {"kind": k, "from_s": a, "until_s": b}
                       for i, (k, a, b) in self.ledger.items()},
        }

    async def shutdown(self) -> int:
        """Stop every engine this application's controller started; the number stopped."""
        if self._started is None:  # a fresh incarnation: find them first
            await self._discover(time.time())
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        owned = [e.engine_id for e in self.fleet if e.owned]
        await asyncio.gather(*(self._stop_engine(i) for i in owned), return_exceptions=True)
        return len(owned)

    # ---- start-up and discovery ------------------------------------------------------------
    async def _ensure_started(self) -> None:
        if self._started is None:
            self._changed = asyncio.Event()
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        now = time.time()
        found = await self._discover(now)
        if not found or self.config.controller is None:
            cluster = self.config.cluster
            await asyncio.gather(*(
                self._launch_static(config, index)
                for index, config in enumerate(cluster.engines())
                if engine_name(cluster.name, config, index) not in self.fleet))
        settings = self.config.controller_settings
        if settings is not None:
            self.controller = Controller(settings, time.time())
            self._spawn(self._control_forever())
        if self.app_name is not None:
            self._spawn(self._watch_app())
        self._publish()

    async def _discover(self, now: float) -> int:
        """Adopt the live engines named for this cluster, in the state they carry."""
        prefix = f"{self.config.cluster.name}-"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == ENGINE_NAMESPACE and a["name"].startswith(prefix)]
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=ENGINE_NAMESPACE)
                label, config = await asyncio.wait_for(
                    asyncio.gather(handle.label.remote(), handle.config.remote()),
                    STATUS_TIMEOUT_S)
            except Exception as exc:  # dying or unreachable: not ours to serve with
                logger.warning("engine %s not adopted: %s", name, exc)
                continue
            self.handles[name] = handle
            self._hold(name, config, now)
            self.fleet.add(name, config, EngineState(label.state),
                           now if label.since_s is None else label.since_s,
                           owned=label.owner == self.name)
        if names:
            logger.info("controller %s adopted %d engines", self.name, len(self.handles))
        return len(self.handles)

    # ---- engines -------------------------------------------------------------------
    def _launch_static(self, config: EngineConfig, index: int) -> asyncio.Task:
        """Engine number `index` of a configured group's `config` (what `engine_ids`
        names), kept to launch again should it die."""
        engine_id = engine_name(self.config.cluster.name, config, index)
        self._static_configs[engine_id] = config
        return self._spawn(self._launch(engine_id, numbered_config(config, index)))

    async def _launch(self, engine_id: str, config) -> None:
        """Create an engine (STARTING), and make it ACTIVE once it serves."""
        handle = launch_engine(engine_id, config, owner=self.name)
        self.handles[engine_id] = handle.actor
        self._hold(engine_id, config, time.time())
        self.fleet.add(engine_id, config, EngineState.STARTING, time.time(), owned=True)
        try:
            await handle.actor.start.remote()
        except Exception:
            logger.exception("engine %s failed to start", engine_id)
            if engine_id in self.fleet:
                self.fleet.remove(engine_id)
            self._release(engine_id)
            ray.kill(handle.actor)
            self._publish()
            return
        if engine_id not in self.fleet:  # stopped while it booted
            self._release(engine_id)
            ray.kill(handle.actor)
            return
        await self._set_state(engine_id, EngineState.ACTIVE)

    async def _set_state(self, engine_id: str, state: EngineState) -> None:
        now = time.time()
        self.fleet.set_state(engine_id, state, now)
        self._publish()
        try:
            await self.handles[engine_id].set_label.remote(state.value, now)
        except Exception as exc:
            logger.warning("engine %s did not take its label: %s", engine_id, exc)

    async def _stop_engine(self, engine_id: str) -> None:
        """Out of the registry first (routers stop at once), then the actor."""
        if engine_id in self.fleet:
            self.fleet.remove(engine_id)
            self._publish()
        handle = self.handles.pop(engine_id, None)
        if handle is None:
            return
        self._release(engine_id)
        try:
            await asyncio.wait_for(handle.shutdown.remote(), 30)
        except Exception as exc:
            logger.warning("engine %s did not shut down cleanly: %s", engine_id, exc)
        ray.kill(handle)

    async def _loads(self) -> dict[str, tuple[int, int, float]]:
        """(requests held, waiting, KV use) per serving engine; engines found dead leave
        the registry, unreachable ones count as busy (never stopped as empty)."""
        serving = [e.engine_id for e in self.fleet if e.state is not EngineState.STARTING]

        async def one(engine_id: str) -> tuple[int, int, float] | None:
            try:
                s = await asyncio.wait_for(self.handles[engine_id].status.remote(),
                                           STATUS_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                logger.warning("engine %s died; it leaves the registry", engine_id)
                return None
            except Exception:
                return (1, 0, 0.0)
            return s.num_running + s.num_waiting, s.num_waiting, s.kv_usage

        loads = {}
        for engine_id, load in zip(serving, await asyncio.gather(*map(one, serving)),
                                   strict=True):
            if load is None:
                self._engine_died(engine_id)
            else:
                loads[engine_id] = load
        self._publish()
        return loads

    # ---- control -------------------------------------------------------------------
    async def _control_forever(self) -> None:
        assert self.controller is not None
        while True:
            await asyncio.sleep(self.controller.interval_s)
            try:
                await self._control_once()
            except Exception:  # a bad step must not end control for good
                logger.exception("control step failed")

    async def _control_once(self) -> None:
        assert self.controller is not None
        loads = await self._loads()
        now = time.time()
        records = self.fleet.records(loads)
        step = self.controller.step(now, records)
        self.steps.append(step)
        settings = self.controller.settings
        self.metrics.step(**step.figures(records, settings.stock,
                                         settings.limits.budget_per_hour))
        if not step.diff.is_empty:
            logger.info("controller %s: %s", self.name, step.summary())
        await self._apply(step.diff)

    async def _apply(self, diff: PlanDiff) -> None:
        template = self.config.engine_template
        for role, kind in diff.start:
            index = self.fleet.next_index()
            config = numbered_config(template_for(template, role, kind), index)
            self._spawn(self._launch(engine_name(self.config.cluster.name, config, index),
                                     config))
        for engine_id in diff.reactivate:
            await self._set_state(engine_id, EngineState.ACTIVE)
        for engine_id in diff.drain:
            await self._set_state(engine_id, EngineState.DRAINING)
        for engine_id in diff.migrate:
            self.fleet.evacuate(engine_id)
        self._publish()
        await asyncio.gather(*(self._stop_engine(i) for i in diff.stop))

    # ---- the application ------------------------------------------------------------
    async def _watch_app(self) -> None:
        misses = 0
        while misses < APP_MISSES:
            await asyncio.sleep(APP_CHECK_S)
            try:
                present = await asyncio.wait_for(asyncio.to_thread(self._app_present),
                                                 APP_CHECK_TIMEOUT_S)
            except TimeoutError:
                present = False
            misses = 0 if present else misses + 1
        logger.info("application %s is gone: stopping its engines", self.app_name)
        await self.shutdown()
        ray.actor.exit_actor()

    def _app_present(self) -> bool:
        try:
            return self.app_name in serve.status().applications
        except Exception as exc:  # counts as a miss; three in a row end the engines
            logger.warning("serve status failed: %s", exc)
            return False

    # ---- helpers -------------------------------------------------------------------
    def _hold(self, engine_id: str, config, now: float) -> None:
        self.ledger[engine_id] = [engine_kind(config).name, now, None]

    def _release(self, engine_id: str) -> None:
        entry = self.ledger.get(engine_id)
        if entry is not None and entry[2] is None:
            entry[2] = time.time()

    def _publish(self) -> None:
        """Wake the routers' long polls when the registry changed."""
        if self._changed is not None and self.fleet.version != self._published:
            self._published = self.fleet.version
            self._changed.set()
            self._changed = asyncio.Event()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def controller_for(config: ServeConfig, app_name: str | None = None):
    """The application's controller, started if it is not running (detached, restarted
    by Ray when it dies)."""
    return ControllerActor.options(
        name=controller_name(config.cluster.name), namespace=ENGINE_NAMESPACE,
        lifetime="detached", get_if_exists=True, resources=config.router_resources,
    ).remote(config, app_name)


def drain_application(cluster_name: str, grace_s: float, poll_s: float = 0.5) -> int:
    """Have the routers stop taking requests and wait up to `grace_s` for those in
    flight to finish; the number still in flight at the end (0: all done)."""
    try:
        actor = ray.get_actor(controller_name(cluster_name), namespace=ENGINE_NAMESPACE)
        ray.get(actor.close.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayError):
        return 0
    deadline_s = time.monotonic() + grace_s
    time.sleep(min(IN_FLIGHT_FRESH_S, grace_s))  # every router has seen `closing` by then
    while True:
        left = ray.get(actor.requests_in_flight.remote(), timeout=30)
        if left == 0 or time.monotonic() >= deadline_s:
            return left
        time.sleep(poll_s)


def stop_controller(cluster_name: str, timeout_s: float = 120.0) -> int:
    """Stop a cluster's controller and the engines it started; the number stopped
    (0 when no controller runs)."""
    try:
        actor = ray.get_actor(controller_name(cluster_name), namespace=ENGINE_NAMESPACE)
    except ValueError:
        return 0
    deadline_s = time.monotonic() + timeout_s
    try:
        while True:
            try:
                stopped = ray.get(actor.shutdown.remote(),
                                  timeout=max(deadline_s - time.monotonic(), 1.0))
                break
            except ray.exceptions.ActorUnavailableError:  # restarting: stop it once back
                if time.monotonic() >= deadline_s:
                    raise
                time.sleep(0.5)
    finally:
        ray.kill(actor, no_restart=True)
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:  # its name is free once it is dead
        try:
            ray.get_actor(controller_name(cluster_name), namespace=ENGINE_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.2)
    return stopped
