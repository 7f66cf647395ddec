"""The live controller's registry: which engines exist, their states, and the versioned
membership the routers follow.

Ray-free, `now` is an argument. The controller actor owns one `Fleet`: it records the
engines it starts and adopts, applies plan diffs to their states, and publishes a
`Registry` whose key changes on every membership change, so each router replica swaps
its instance set without restarting. A restarted controller rebuilds its fleet from
the engines it finds by name (each engine keeps the state the controller last gave
it) and publishes under a new incarnation, so routers never mistake an old version
number for a new one.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

from app.control.plan import EngineRecord, EngineState
from app.engines.config import EngineConfig, EngineRole
from app.planning.split import EngineKind

_INDEX = re.compile(r"-(\d+)$")


def engine_kind(config: EngineConfig) -> EngineKind:
    return EngineKind(config.gpu_type, config.tp, config.scheduler.max_num_seqs)


def engine_name(cluster_name: str, config: EngineConfig, index: int) -> str:
    """`<cluster>-<gpu>-<n>`, with `<tp>x` before a multi-GPU kind and the role before
    the GPU in disaggregated mode (`<cluster>-decode-2xV100-3`)."""
    tag = config.gpu_type if config.tp == 1 else f"{config.tp}x{config.gpu_type}"
    if config.role != EngineRole.UNIFIED:
        tag = f"{config.role.value}-{tag}"
    return f"{cluster_name}-{tag}-{index}"


@dataclass(frozen=True)
class Member:
    """One engine routers may know: it serves (ACTIVE) or takes nothing new (DRAINING).
    `evacuate` asks routers to move its requests elsewhere by token ids."""

    engine_id: str
    config: EngineConfig
    state: EngineState
    evacuate: bool = False


@dataclass(frozen=True)
class Registry:
    """The membership routers route over; compare `key`s to see a change."""

    incarnation: str
    version: int
    members: tuple[Member, ...]
    closing: bool = False  # the application is shutting down: take no new request

    @property
    def key(self) -> tuple[str, int]:
        return self.incarnation, self.version

    def serving_ids(self) -> list[str]:
        return [m.engine_id for m in self.members if m.state is EngineState.ACTIVE]


@dataclass(frozen=True)
class FleetEngine:
    """The controller's record of one engine."""

    engine_id: str
    config: EngineConfig
    state: EngineState
    since_s: float
    owned: bool  # started by this application's controller (stopped with it)
    evacuate: bool = False

    def record(self, running: int = 0, waiting: int = 0, kv_usage: float = 0.0) -> EngineRecord:
        return EngineRecord(self.engine_id, self.config.role.value, engine_kind(self.config),
                            self.state, self.since_s, running, waiting, kv_usage)


class Fleet:
    """Engines by id; every change that routers must see bumps the version."""

    def __init__(self, cluster_name: str, incarnation: str) -> None:
        self.cluster_name = cluster_name
        self.incarnation = incarnation
        self.version = 0
        self.closing = False
        self.engines: dict[str, FleetEngine] = {}
        self._indices = itertools.count()
        self._used: set[int] = set()

    def __iter__(self) -> Iterator[FleetEngine]:
        return iter(list(self.engines.values()))

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self.engines

    def next_index(self) -> int:
        """An engine number no known engine of this cluster uses (see `engine_name`)."""
        index = next(i for i in self._indices if i not in self._used)
        self._used.add(index)
        return index

    def add(self, engine_id: str, config: EngineConfig, state: EngineState, now: float,
            owned: bool) -> None:
        if engine_id in self.engines:
            raise ValueError(f"engine {engine_id} is already registered")
        match = _INDEX.search(engine_id)
        if match:
            self._used.add(int(match.group(1)))
        self.engines[engine_id] = FleetEngine(engine_id, config, state, now, owned)
        self._bump_if(state is not EngineState.STARTING)

    def set_state(self, engine_id: str, state: EngineState, now: float) -> None:
        engine = self.engines[engine_id]
        if engine.state is state:
            return
        self.engines[engine_id] = replace(engine, state=state, since_s=now, evacuate=False)
        self._bump_if(True)

    def evacuate(self, engine_id: str) -> None:
        """Ask routers to move a draining engine's requests away."""
        engine = self.engines[engine_id]
        if engine.state is not EngineState.DRAINING:
            raise ValueError(f"only a draining engine is evacuated; {engine_id} is {engine.state}")
        if not engine.evacuate:
            self.engines[engine_id] = replace(engine, evacuate=True)
            self._bump_if(True)

    def close(self) -> None:
        """Tell routers the application is shutting down."""
        if not self.closing:
            self.closing = True
            self._bump_if(True)

    def remove(self, engine_id: str) -> FleetEngine:
        engine = self.engines.pop(engine_id)
        self._bump_if(engine.state is not EngineState.STARTING)
        return engine

    def records(self, loads: dict[str, tuple[int, int, float]]) -> list[EngineRecord]:
        """Every engine as the planner sees it, with (running, waiting, KV use) where
        the engine reported them."""
        return [e.record(*loads.get(e.engine_id, (0, 0, 0.0))) for e in self.engines.values()]

    def registry(self) -> Registry:
        members = tuple(Member(e.engine_id, e.config, e.state, e.evacuate)
                        for e in self.engines.values() if e.state is not EngineState.STARTING)
        return Registry(self.incarnation, self.version, members, self.closing)

    def _bump_if(self, visible: bool) -> None:
        if visible:
            self.version += 1


def template_for(template: EngineConfig, role: str, kind: EngineKind) -> EngineConfig:
    """An engine config of `kind` in `role`, otherwise like `template` (same model,
    backend and knobs)."""
    scheduler = template.scheduler
    if kind.max_num_seqs is not None:
        scheduler = scheduler.model_copy(update={"max_num_seqs": kind.max_num_seqs})
    return template.model_copy(update={"gpu_type": kind.gpu, "tp": kind.tp,
                                       "role": EngineRole(role), "scheduler": scheduler})

