"""What every engine backend offers the actor (and the router, through it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

from app.engines.config import EngineConfig
from app.engines.messages import EngineRequest, EngineStatus, StructuredOutput, TokenEvent

STATUS_WINDOW = 32  # recent iterations / queue waits kept for status()


@dataclass(frozen=True)
class EngineCapabilities:
    """What a backend does beyond generating token ids; the service asks before it
    routes, so a request no engine can serve is the client's clear 400."""

    kind: str  # what the engines are, as an error message names them
    logprobs: bool  # token log-probabilities
    structured_outputs: bool  # grammar-constrained decoding
    text: bool  # real text, which stop strings and tool parsers read


class EngineBackendBase(ABC):
    """One engine behind one async interface; the Ray actor is a shell around it.

    Backends stream `TokenEvent` batches stamped with wall-clock seconds
    (`time.time()`), accept token-ID resumes, abort, and report `EngineStatus`.
    """

    CAPABILITIES: ClassVar[EngineCapabilities]

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        self.engine_id = engine_id
        self.config = config

    @staticmethod
    def constraint_error(structured: StructuredOutput) -> str | None:
        """Why this backend cannot decode under `structured` (None: it can)."""
        return None

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
