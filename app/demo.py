"""Main job until live serving lands: a local Ray cluster of simulated engines
pinned to four GPU kinds plus one real vLLM CPU engine, answering a few requests
and printing what each took next to what the hardware model predicts."""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from app.config import (
    ClusterConfig,
    EngineBackend,
    EngineConfig,
    InstanceGroup,
    SchedulerConfig,
)
from app.engine_types import EngineRequest, SamplingSpec, TokenEvent

DEFAULT_TINY_MODEL_DIR = Path.home() / ".cache" / "goodserve" / "tiny-llama"


def default_demo_cluster(tiny_model_dir: Path | None) -> ClusterConfig:
    """The embedded default: H800, A800, A40, 2xV100 simulated (+ a vLLM CPU engine)."""
    sim = SchedulerConfig(max_num_seqs=64)
    groups = [
        InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp, scheduler=sim))
        for g, tp in (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
    ]
    if tiny_model_dir is not None:
        vllm = EngineConfig(
            gpu_type="cpu",
            model="tiny-llama",
            backend=EngineBackend.VLLM,
            model_path=str(tiny_model_dir),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
        )
        groups.append(InstanceGroup(engine=vllm))
    return ClusterConfig(name="demo", groups=groups)


@dataclass(frozen=True)
class RequestTiming:
    """Measured latency of one request on one engine."""

    engine_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float


def timing_of(
    engine_id: str, request: EngineRequest, sent_s: float, events: list[TokenEvent]
) -> RequestTiming:
    if not events:
        raise RuntimeError(f"{engine_id}: request {request.request_id} produced no tokens")
    return RequestTiming(
        engine_id=engine_id,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(events),
        ttft_s=events[0].time_s - sent_s,
        tpot_s=(events[-1].time_s - events[0].time_s) / max(len(events) - 1, 1),
        e2e_s=events[-1].time_s - sent_s,
    )


def make_demo_requests(
    num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int
) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [
        EngineRequest(
            request_id=f"demo-{i}",
            prompt_token_ids=[rng.randrange(2, vocab_size) for _ in range(prompt_len)],
            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
        )
        for i in range(num_requests)
    ]


async def run_on_engines(handles, requests_per_engine: int, prompt_len: int, max_tokens: int):
    """Send the same small workload to every engine concurrently; return timings."""
    import time

    from deployments.cluster import collect_tokens

    async def one(handle, request):
        sent = time.time()
        events = await collect_tokens(handle, request)
        return timing_of(handle.engine_id, request, sent, events)

    jobs = []
    for h in handles:
        vocab = h.config.instance.model.vocab_size
        for r in make_demo_requests(requests_per_engine, prompt_len, max_tokens, vocab, seed=0):
            jobs.append(one(h, EngineRequest(f"{h.engine_id}-{r.request_id}",
                                             r.prompt_token_ids, r.sampling)))
    return await asyncio.gather(*jobs)


def format_report(handles, timings: list[RequestTiming], prompt_len: int, max_tokens: int) -> str:
    lines = [
        f"{'engine':22s} {'backend':7s} {'ttft_s':>8s} {'tpot_ms':>8s} {'e2e_s':>7s} "
        f"{'solo_model_s':>12s}"
    ]
    for h in handles:
        mine = [t for t in timings if t.engine_id == h.engine_id]
        predicted = h.config.instance.solo_latency_s(prompt_len, max_tokens)
        lines.append(
            f"{h.engine_id:22s} {h.config.backend.value:7s} "
            f"{statistics.median(t.ttft_s for t in mine):8.3f} "
            f"{statistics.median(t.tpot_s for t in mine) * 1e3:8.2f} "
            f"{statistics.median(t.e2e_s for t in mine):7.3f} {predicted:12.3f}"
        )
    return "\n".join(lines)
