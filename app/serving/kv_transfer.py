"""How a prompt's KV reaches the decode engine in disaggregated serving.

The router runs a request's prefill on a prefill engine (prompt -> first token), then
asks the transport to deliver the prompt's KV to the decode engine it chose, then
submits the decode there with the prompt + first token, marked as having its KV. A
transport that fails raises; the router then lets the decode engine prefill the
prompt itself (by token ids), so nothing is lost.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.kv_link import KvLink


@dataclass(frozen=True)
class KvHandoff:
    """A finished transfer, as the reply reports it."""

    transfer_s: float  # wall seconds from the prefill's end to the KV being usable
    num_tokens: int  # prompt tokens whose KV the decode engine receives


class KvTransport(ABC):
    """Delivers the KV of a prompt just prefilled to a decode engine."""

    def __init__(self, link: KvLink) -> None:
        self.link = link  # the router's model of the link (what placement expects)

    @abstractmethod
    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float,
                       now: float) -> KvHandoff:
        """Move the prompt's KV (raises when the transfer fails)."""


class SimulatedLink(KvTransport):
    """The simulator's FIFO link in real time, for simulated engines: a transfer
    waits behind the ones before it and takes bytes / bandwidth. The bandwidth is the
    config's divided by the engines' `time_scale`, so the link slows with them."""

    def __init__(self, bandwidth_gbps: float, time_scale: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        super().__init__(KvLink(bandwidth_gbps / time_scale))
        self._sleep = sleep

    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float,
                       now: float) -> KvHandoff:
        done = self.link.enqueue(now, num_prompt_tokens * kv_bytes_per_token)
        await self._sleep(done - now)
        return KvHandoff(done - now, num_prompt_tokens)
