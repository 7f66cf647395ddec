"""Engine actor: the Ray shell around one engine backend (app/engines/).

The backends (simulated or vLLM) hold all engine logic and are Ray-free; the actor
only exposes them to the router and runs each submission through the output journal
(app/engines/journal.py: it outlives the caller, another router replica can read it,
and callers poll it rather than being streamed to). `output_stream` reads one.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from app.engines.config import EngineConfig
from app.engines.factory import make_backend
from app.engines.journal import OutputJournal, follow
from app.engines.messages import EngineRecord, EngineRequest, EngineStatus, TokenEvent


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

    def submit(self, request: EngineRequest) -> None:
        """Start a submission; its tokens are read by `poll` (ValueError: an id seen)."""
        self.journal.start(request)

    async def poll(self, request_id: str, from_index: int, linger: bool
                   ) -> tuple[list[TokenEvent], bool]:
        """A submission's tokens from output index `from_index` on (any caller's), and
        whether they are all; with `linger` it waits the engine's `stream_interval_s`
        after the first for more (`OutputJournal.poll`)."""
        linger_s = self.backend.config.stream_interval_s if linger else 0.0
        return await self.journal.poll(request_id, from_index, linger_s)

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


async def _poll_remote(actor: Any, request_id: str, from_index: int, linger: bool
                       ) -> tuple[list[TokenEvent], bool]:
    return await actor.poll.remote(request_id, from_index, linger)


def output_stream(actor: Any, request_id: str, from_index: int
                  ) -> AsyncIterator[list[TokenEvent]]:
    """An engine actor's submission `request_id` from output index `from_index` on, as
    it comes: the first batch at once, each later one a stream interval's tokens."""
    return follow(functools.partial(_poll_remote, actor, request_id), from_index)


async def generate_on(actor: Any, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
    """Start `request` on an engine actor and read its new tokens."""
    await actor.submit.remote(request)
    async for batch in output_stream(actor, request.request_id,
                                     len(request.resume_token_ids)):
        yield batch
