"""Featurisation time per request of the MoE predictor: TF-IDF rows and the whole
`TextFeaturizer.transform`, in batches as the router's micro-batcher forms them.

Usage: python -m benchmarks.featurize_speed [--prompts PATH] [--fit 3000] [--batch 64]
       [--repeats 3]

The featurizer is fitted on the first `--fit` prompts; every prompt is then featurised
once per repeat on this thread (the numba kernel is single-threaded), the row cache
emptied before each repeat so that no text is a cache hit. The best repeat is printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from app.workloads.workload import load_prompts
from benchmarks.cli import run_command
from predictor.base import PredictionInput
from predictor.features import TextFeaturizer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / (
    "prompt_lengths.jsonl")


def seconds_per_item(featurise: Callable[[list[Any]], object], items: Sequence[Any],
                     batch_size: int, repeats: int, before_each: Callable[[], None]
                     ) -> float:
    """The best repeat's time per item of featurising `items` in batches."""
    best = float("inf")
    for _ in range(repeats):
        before_each()
        start = time.perf_counter()
        for first in range(0, len(items), batch_size):
            featurise(list(items[first:first + batch_size]))
        best = min(best, time.perf_counter() - start)
    return best / len(items)


def fitted_featurizer(prompts: Sequence[str], fit: int) -> TextFeaturizer:
    return TextFeaturizer().fit([PredictionInput(p) for p in prompts[:fit]])


def speed(
    prompts: Annotated[Path, typer.Option(help="prompt_lengths.jsonl")] = DEFAULT_PROMPTS,
    fit: Annotated[int, typer.Option(help="prompts the featurizer is fitted on")] = 3000,
    batch: Annotated[int, typer.Option(help="requests per batch")] = 64,
    repeats: Annotated[int, typer.Option(help="passes over the prompts (best kept)")] = 3,
) -> None:
    """Print microseconds per request of the TF-IDF rows and of the whole transform."""
    texts = [row.prompt for row in load_prompts(prompts)]
    featurizer = fitted_featurizer(texts, fit)
    inputs = [PredictionInput(text) for text in texts]
    tfidf = seconds_per_item(featurizer._tfidf.transform, texts, batch, repeats, lambda: None)
    transform = seconds_per_item(featurizer.transform, inputs, batch, repeats,
                                 lambda: featurizer.__dict__.pop("_rows", None))
    print(f"{len(texts)} prompts, fitted on {min(fit, len(texts))}, batch {batch}, "
          f"{len(featurizer.vectorizer_.vocabulary_)} terms")
    print(f"tfidf rows: {1e6 * tfidf:.2f} us/request")
    print(f"transform:  {1e6 * transform:.2f} us/request")


def main(argv: list[str] | None = None) -> int:
    return run_command(speed, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
