"""What every engine backend offers the actor (and the router, through it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from app.config import EngineConfig
from app.engine_types import EngineRequest, EngineStatus, TokenEvent

STATUS_WINDOW = 32  # recent iterations / queue waits kept for status()


class EngineBackendBase(ABC):
    """One engine behind one async interface; the Ray actor is a shell around it.

    Backends stream `TokenEvent` batches stamped with wall-clock seconds
    (`time.time()`), accept token-ID resumes, abort, and report `EngineStatus`.
    """

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        self.engine_id = engine_id
        self.config = config

    @abstractmethod
    async def start(self) -> None:
        """Load the model / start the step loop. Idempotent."""

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        """Stream the request's new tokens, a batch per engine iteration."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request; True if it was running or waiting here."""

    @abstractmethod
    def status(self, with_prefix_digest: bool = True) -> EngineStatus:
        """Cheap black-box figures; never blocks on the engine."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Release the engine (processes, memory)."""
