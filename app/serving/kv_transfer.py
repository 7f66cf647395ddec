"""How a prompt's KV reaches the decode engine in disaggregated serving.

The router runs a request's prefill on a prefill engine (prompt -> first token), asks
the transport to hand the prompt's KV over, then submits the decode to the engine it
chose with the prompt + first token, marked as having its KV (and the connector's
parameters). Once the decode engine has produced a token the KV is released. A
transport that fails raises; the router then lets the decode engine prefill the prompt
itself (by token ids), so nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.engines.config import KvConnectorConfig, KvConnectorKind
from app.hardware.kv_link import KvLink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvHandoff:
    """A transfer handed to the decode stage."""

    transfer_s: float | None  # modelled transfer time; None: measured at the decode's start
    params: dict[str, Any] | None = None  # for the decode engine (vLLM kv_transfer_params)


class KvTransport(ABC):
    """Delivers the KV of a prompt just prefilled to a decode engine."""

    def __init__(self, link: KvLink) -> None:
        self.link = link  # the router's model of the link (what placement expects)

    @abstractmethod
    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float, now: float,
                       params: dict[str, Any] | None) -> KvHandoff:
        """Hand over the prompt's KV; `params` came with the prefill's last token."""

    @abstractmethod
    def release(self, params: dict[str, Any] | None) -> None:
        """The decode engine has the KV (or will never load it): free what holds it."""

    @abstractmethod
    def sweep(self) -> None:
        """Delete stored KV nobody loaded in time."""


class SimulatedLink(KvTransport):
    """The simulator's FIFO link in real time, for simulated engines: a transfer
    waits behind the ones before it and takes bytes / bandwidth. The bandwidth is the
    config's divided by the engines' `time_scale`, so the link slows with them."""

    def __init__(self, bandwidth_gbps: float, time_scale: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        super().__init__(KvLink(bandwidth_gbps / time_scale))
        self._sleep = sleep

    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float, now: float,
                       params: dict[str, Any] | None) -> KvHandoff:
        done = self.link.enqueue(now, num_prompt_tokens * kv_bytes_per_token)
        await self._sleep(done - now)
        return KvHandoff(done - now)

    def release(self, params: dict[str, Any] | None) -> None:
        """Nothing holds a modelled transfer."""

    def sweep(self) -> None:
        """Nothing is stored."""


class ConnectorTransport(KvTransport):
    """vLLM engines with a KV connector move the KV themselves: the prefill engine
    stores or exposes it, the decode engine loads it when it schedules the request
    (`params` tell it where). The router passes the parameters on and, for the
    shared-storage connector, deletes the stored KV once loaded, and whatever no
    decode loaded after `kv_ttl_s`, so the storage does not grow without bound.
    The link model (`bandwidth_gbps`) only informs placement."""

    def __init__(self, connector: KvConnectorConfig, bandwidth_gbps: float,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(KvLink(bandwidth_gbps))
        self.connector = connector
        self.clock = clock
        self._last_sweep_s = -float("inf")

    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float, now: float,
                       params: dict[str, Any] | None) -> KvHandoff:
        if params is None:
            raise RuntimeError("the prefill engine returned no KV transfer parameters")
        self.link.enqueue(now, num_prompt_tokens * kv_bytes_per_token)
        self.sweep()
        return KvHandoff(None, params)

    def release(self, params: dict[str, Any] | None) -> None:
        if self.connector.kind != KvConnectorKind.EXAMPLE or not params:
            return  # NIXL frees the prefill's blocks once read (or on its own timeout)
        key = self._stored(params.get("storage_key"))
        if key is not None:
            shutil.rmtree(key, ignore_errors=True)

    def _stored(self, key: object) -> Path | None:
        """`key` when it is a directory right under the storage root (never elsewhere)."""
        if not isinstance(key, str):
            return None
        path = Path(key)
        return path if path.parent == Path(self.connector.shared_storage_path) else None

    def sweep(self) -> None:
        """Delete stored KV older than the TTL (at most once per quarter TTL): hand-offs
        no decode engine loaded, and unified engines' stored prompts (kept for moves)."""
        if self.connector.kind != KvConnectorKind.EXAMPLE:
            return
        now = self.clock()
        ttl = self.connector.kv_ttl_s
        if now - self._last_sweep_s < ttl / 4:
            return
        self._last_sweep_s = now
        root = Path(self.connector.shared_storage_path)
        if not root.is_dir():
            return
        for entry in root.iterdir():
            try:
                if entry.is_dir() and now - entry.stat().st_mtime > ttl:
                    shutil.rmtree(entry, ignore_errors=True)
            except FileNotFoundError:  # released meanwhile
                continue
