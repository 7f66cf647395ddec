"""Simulated engine backend: the shared continuous-batching model in real time.

It runs `app/sim/engine_core.py` (the model the discrete-event simulator runs in
virtual time) with iteration latency from the hardware model, stretched by the
config's `time_scale`, so routing can be exercised live without a GPU.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from app.engines.base import STATUS_WINDOW, EngineBackendBase, EngineCapabilities
from app.engines.config import EngineConfig
from app.engines.messages import EngineRequest, EngineStatus, TokenEvent
from app.sim.engine_core import SimEngineCore, SimSequence

_WORD = re.compile(r"[a-z]{2,}")


@functools.cache
def round_trip_vocabulary(path: str) -> tuple[int, ...]:
    """The ids of the tokenizer in `path` whose text is one lower-case word after a
    space, and that re-tokenize to themselves alone and after another word: text made
    of them tokenizes back to the same ids, one for one (ValueError when there are
    none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    special = set(tokenizer.all_special_ids)
    words = [(i, text) for i in range(len(tokenizer)) if i not in special
             and (text := tokenizer.decode([i])).startswith(" ")
             and _WORD.fullmatch(text[1:])]
    kept: tuple[int, ...] = ()
    if words:
        alone = tokenizer([w for _, w in words], add_special_tokens=False)["input_ids"]
        twice = tokenizer([w + w for _, w in words], add_special_tokens=False)["input_ids"]
        kept = tuple(i for (i, _), one, two in zip(words, alone, twice, strict=True)
                     if one == [i] and two == [i, i])
    if not kept:
        raise ValueError(f"tokenizer {path}: no token is a word that re-tokenizes alone")
    return kept


def prompt_seed(token_ids: list[int] | tuple[int, ...]) -> int:
    """Stable per-prompt seed so simulated tokens survive a token-ID resume."""
    digest = hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SimBackend(EngineBackendBase):
    """Shared engine model driven in real time; `time_scale` stretches iterations."""

    CAPABILITIES = EngineCapabilities("simulated", logprobs=False, structured_outputs=False,
                                      text=False)

    def __init__(
        self, engine_id: str, config: EngineConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(engine_id, config)
        self._clock = clock
        self._origin = clock()
        vocabulary = (None if config.tokenizer_path is None
                      else round_trip_vocabulary(config.tokenizer_path))
        self.core = SimEngineCore(config.instance, config.scheduler, status_window=STATUS_WINDOW,
                                  vocabulary=vocabulary)
        self._req_to_queue: dict[str, asyncio.Queue[list[TokenEvent] | None]] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    def _virtual_now(self) -> float:
        return (self._clock() - self._origin) / self.config.time_scale

    async def start(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._step_loop())

    async def _step_loop(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self.core.has_work:
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            step = self.core.begin_step(self._virtual_now())
            if step is None:  # work exists but nothing fits (KV full): let aborts free room
                await asyncio.sleep(0.001)
                continue
            await asyncio.sleep(step.duration_s * self.config.time_scale)
            events = self.core.complete_step(step, self._virtual_now())
            self._dispatch(events)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        wall = time.time()
        req_to_events: dict[str, list[TokenEvent]] = {}
        for ev in events:
            stamped = replace(ev, time_s=wall)
            req_to_events.setdefault(ev.request_id, []).append(stamped)
        for request_id, batch in req_to_events.items():
            queue = self._req_to_queue.get(request_id)
            if queue is not None:
                queue.put_nowait(batch)
                if batch[-1].finished:
                    queue.put_nowait(None)

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        await self.start()
        if request.request_id in self._req_to_queue:
            raise ValueError(f"duplicate request id {request.request_id}")
        seq = SimSequence(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            max_output_tokens=request.sampling.max_tokens,
            arrival_s=self._virtual_now(),
            num_resumed_tokens=len(request.resume_token_ids),
            block_hashes=request.block_hashes(),
            token_seed=prompt_seed(tuple(request.prompt_token_ids)),
            skip_prefill=request.kv_transferred,
            priority=request.priority,
        )
        queue: asyncio.Queue[list[TokenEvent] | None] = asyncio.Queue()
        self._req_to_queue[request.request_id] = queue
        try:
            self.core.add_request(seq)
            assert self._wakeup is not None
            self._wakeup.set()
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._req_to_queue.pop(request.request_id, None)
            self.core.abort_request(request.request_id)  # no-op when it finished

    async def abort(self, request_id: str) -> bool:
        found = self.core.abort_request(request_id) is not None
        queue = self._req_to_queue.get(request_id)
        if queue is not None:
            queue.put_nowait(None)
        return found

    def status(self, with_prefix_digest: bool = True) -> EngineStatus:
        return self.core.status(self.engine_id, self.config.role.value, time.time(),
                                with_digest=with_prefix_digest)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None
