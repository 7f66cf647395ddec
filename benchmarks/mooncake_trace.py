"""Write a small seeded trace in the Mooncake format, for replay by AIPerf.

Usage: python -m benchmarks.mooncake_trace --out trace.jsonl [--requests 30] [--seed 0]

One JSON object per line, as AIPerf's `--custom-dataset-type mooncake_trace` reads it:
`timestamp` (ms after the first request, ascending), `input_length` and `output_length`
(tokens) and `hash_ids`, one id per 512-token block of the prompt (Mooncake's block
size, AIPerf's default for this format; the last block may be partial). Requests of one
prefix group share their first blocks' ids, so AIPerf writes them the same prompt prefix
and the server sees prefix reuse, as in the published Mooncake traces. Generated here
from a seed: nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.cli import run_command

BLOCK_TOKENS = 512  # Mooncake's hash block; AIPerf's default --isl-block-size for it
PREFIX_GROUPS = 3  # shared system prompts, one to two blocks each


def trace_rows(requests: int, seed: int, duration_s: float, min_input: int,
               max_input: int, min_output: int, max_output: int) -> list[dict[str, Any]]:
    """The trace's rows: Poisson-like arrivals over `duration_s`, lengths drawn uniformly."""
    rng = random.Random(seed)
    prefixes = [[1000 * (group + 1) + i for i in range(rng.randint(1, 2))]
                for group in range(PREFIX_GROUPS)]
    next_unique = 100_000
    gaps = [rng.expovariate(1.0) for _ in range(requests)]
    scale = 1000.0 * duration_s / max(sum(gaps[1:]), 1e-9)
    rows, at_ms = [], 0.0
    for index in range(requests):
        if index:
            at_ms += gaps[index] * scale
        input_length = rng.randint(min_input, max_input)
        blocks = math.ceil(input_length / BLOCK_TOKENS)
        prefix = rng.choice(prefixes)[:max(blocks - 1, 0)]  # the last block stays its own
        unique = list(range(next_unique, next_unique + blocks - len(prefix)))
        next_unique += len(unique)
        rows.append({"timestamp": round(at_ms), "input_length": input_length,
                     "output_length": rng.randint(min_output, max_output),
                     "hash_ids": prefix + unique})
    return rows


def write(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    requests: Annotated[int, typer.Option(help="number of requests", min=1)] = 30,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    duration_s: Annotated[float, typer.Option(
        help="seconds from the first request to the last", min=0.0)] = 15.0,
    min_input: Annotated[int, typer.Option(help="shortest prompt, tokens", min=1)] = 128,
    max_input: Annotated[int, typer.Option(help="longest prompt, tokens", min=1)] = 1536,
    min_output: Annotated[int, typer.Option(help="shortest output, tokens", min=1)] = 16,
    max_output: Annotated[int, typer.Option(help="longest output, tokens", min=1)] = 64,
) -> int:
    """Write the trace to `out`, one request per line."""
    if min_input > max_input or min_output > max_output:
        raise typer.BadParameter("a minimum length is above its maximum")
    rows = trace_rows(requests, seed, duration_s, min_input, max_input, min_output,
                      max_output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} requests over {rows[-1]['timestamp'] / 1000:.1f} s to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(write, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
