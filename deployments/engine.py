"""Engine actor: the Ray shell around one engine backend (app/engines/).

The backends (simulated or vLLM) hold all engine logic and are Ray-free; the actor
only exposes them to the router, runs each submission through the output journal
(app/engines/journal.py: it outlives the caller, and another router replica can read
it) and coalesces the token stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from app.engines.config import EngineConfig
from app.engines.factory import make_backend
from app.engines.journal import OutputJournal
from app.engines.messages import EngineRecord, EngineRequest, EngineStatus, TokenEvent
from app.serving.streams import coalesce


@dataclass(frozen=True)
class Membership:
    """Who started the engine (a controller's name; None when started outside one) and
    the pool state that controller last gave it."""

    owner: str | None
    state: str = "active"
    since_s: float | None = None


@ray.remote
class EngineActor:
    """Ray shell around one backend. Call `generate` with num_returns="streaming"."""

    def __init__(self, engine_id: str, config: EngineConfig, owner: str | None = None) -> None:
        self.backend = make_backend(engine_id, config)
        self.journal = OutputJournal(self.backend)  # generations outlive their callers
        # the controller's label, kept here so a restarted controller finds it again
        self.membership = Membership(owner)

    async def start(self) -> str:
        await self.backend.start()
        return self.backend.engine_id

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        interval_s = self.backend.config.stream_interval_s
        async for batch in coalesce(self.journal.generate(request), interval_s):
            yield batch

    async def read(self, request_id: str, from_index: int) -> AsyncIterator[list[TokenEvent]]:
        """A submission already started (by any caller), from output index `from_index`."""
        interval_s = self.backend.config.stream_interval_s
        async for batch in coalesce(self.journal.read(request_id, from_index), interval_s):
            yield batch

    def find(self, request_id: str) -> list[EngineRecord]:
        """The submissions of client request `request_id` this engine holds."""
        return self.journal.find(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.journal.abort(request_id)

    def status(self, with_prefix_digest: bool = False) -> EngineStatus:
        """Black-box figures; the prefix digest (every cached block hash) only on request,
        since shipping it with each poll cost the router more than routing did."""
        return self.backend.status(with_prefix_digest)

    def config(self) -> EngineConfig:
        return self.backend.config

    def label(self) -> Membership:
        return self.membership

    def set_label(self, state: str, since_s: float) -> None:
        self.membership = Membership(self.membership.owner, state, since_s)

    async def shutdown(self) -> None:
        await self.backend.shutdown()
