"""Time per streamed token of `OutputText`, by output length: it should stay flat.

Usage: python -m benchmarks.detokenize_speed [--lengths 256 1024 4096 16384] [--repeats 3]

Each output streams one token per chunk with a stop string that never matches (so every
token is searched) and a delta read per token, on the tiny model's byte-level BPE (built
locally) and on `WordHashTokenizer`. For comparison, "whole decode" is what decoding the
whole output at every chunk costs per token (the least the former implementation did),
estimated from `decode(ids[:k])` at evenly spaced k.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from app.engines.tiny_model import TINY_MODEL_NAME, build_tokenizer
from app.hardware.specs import get_model
from app.serving.tokenizer import HfTokenizer, OutputText, Tokenizer, WordHashTokenizer
from benchmarks.cli import run_command

# some characters span tokens in the tiny vocabulary, as in real byte-level BPE output
TEXT = ("the router picks an instance and a watchdog migrates requests at risk; "
        "prix 5€ au café, naïve 😀 日本語 ")
NEVER_MATCHES = "\x00never\x00"
WHOLE_DECODE_SAMPLES = 32
DEFAULT_LENGTHS = (256, 1024, 4096, 16384)


def stream_seconds(tokenizer: Tokenizer, ids: list[int], repeats: int) -> float:
    """The best time of streaming `ids` one token per chunk, reading every delta."""
    best = float("inf")
    for _ in range(repeats):
        output = OutputText(tokenizer, stop=[NEVER_MATCHES])
        start = time.perf_counter()
        for token in ids:
            output.observe([token])
            output.delta()
        output.delta(final=True)
        best = min(best, time.perf_counter() - start)
    return best


def whole_decode_seconds_per_chunk(tokenizer: Tokenizer, ids: list[int]) -> float:
    """Mean time of decoding the output so far, over evenly spaced chunks."""
    lengths = [len(ids) * (i + 1) // WHOLE_DECODE_SAMPLES for i in range(WHOLE_DECODE_SAMPLES)]
    start = time.perf_counter()
    for length in lengths:
        tokenizer.decode(ids[:length])
    return (time.perf_counter() - start) / len(lengths)


def output_ids(tokenizer: Tokenizer, length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids.extend(tokenizer.encode(TEXT))
    return ids[:length]


def speed(
    lengths: Annotated[list[int] | None, typer.Option(
        help=f"output lengths in tokens (default {' '.join(map(str, DEFAULT_LENGTHS))})")] = None,
    repeats: Annotated[int, typer.Option(help="streams timed per length (best kept)")] = 3,
) -> None:
    """Print microseconds per streamed token, incremental and whole decode per chunk."""
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        build_tokenizer(Path(tokenizer_dir), get_model(TINY_MODEL_NAME).vocab_size)
        tokenizers = {"tiny byte-level BPE": HfTokenizer(tokenizer_dir),
                      "WordHashTokenizer": WordHashTokenizer(vocab_size=32000)}
    print(f"{'tokenizer':<20} {'tokens':>7} {'incremental us/token':>21} "
          f"{'whole decode us/token':>22}")
    for name, tokenizer in tokenizers.items():
        for length in lengths or DEFAULT_LENGTHS:
            ids = output_ids(tokenizer, length)
            incremental = stream_seconds(tokenizer, ids, repeats) / length
            whole = whole_decode_seconds_per_chunk(tokenizer, ids)
            print(f"{name:<20} {length:>7} {1e6 * incremental:>21.2f} {1e6 * whole:>22.2f}")


def main(argv: list[str] | None = None) -> int:
    return run_command(speed, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
