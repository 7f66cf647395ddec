"""Featurisation time per request of the MoE predictor: TF-IDF rows and the whole
`TextFeaturizer.transform`, in batches as the router's micro-batcher forms them; with
`--whole-predict`, the whole `Predictor.predict` of a trained MoE, against another
version of the `predictor` package with `--baseline`.

Usage: python -m benchmarks.featurize_speed [--prompts PATH] [--fit 3000] [--batch 64]
       [--repeats 3] [--whole-predict DIR [--baseline ROOT]]

The featurizer is fitted on the first `--fit` prompts; every prompt is then featurised
once per repeat on this thread (the numba kernel is single-threaded), the row cache
emptied before each repeat so that no text is a cache hit. The best repeat is printed.

`--whole-predict DIR`: the MoE saved in DIR (`predictor train` output) predicts every
prompt (with its task) once per round in batches of `--batch`, on one torch thread as
in the router, the row cache emptied before each batch (arrivals are new texts); the
min and median over `--repeats` rounds are printed. `--baseline ROOT`: the MoE loaded
by the `predictor` package under ROOT as well (another version of it, e.g.
`mkdir ROOT && git archive HEAD predictor | tar -x -C ROOT`), each version in a worker
process, the two timed in turn in each round; and whether they predict bitwise the
same lengths.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from app.workloads.workload import load_prompts
from benchmarks.cli import run_command
from predictor.base import PredictionInput, Predictor
from predictor.batching import use_one_inference_thread
from predictor.features import TextFeaturizer
from predictor.registry import load_predictor

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / (
    "prompt_lengths.jsonl")
PACKAGE = "predictor"


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


def package_modules() -> dict[str, Any]:
    """The imported modules of the `predictor` package, taken out of `sys.modules`."""
    names = [name for name in sys.modules if name.split(".")[0] == PACKAGE]
    return {name: sys.modules.pop(name) for name in names}


def load_moe(directory: Path, package_root: Path | None = None) -> Predictor:
    """The MoE saved in `directory`, loaded by this `predictor` package or by the one
    under `package_root`: imported apart, its modules are then referenced by the
    predictor alone, and this package's are back in `sys.modules`."""
    if package_root is None:
        return load_predictor(directory, "moe")
    ours = package_modules()
    sys.path.insert(0, str(package_root))
    try:
        return importlib.import_module(f"{PACKAGE}.registry").load_predictor(directory, "moe")
    finally:
        sys.path.remove(str(package_root))
        package_modules()
        sys.modules.update(ours)


def predict_seconds(predictor: Predictor, batches: Sequence[list[PredictionInput]]
                    ) -> tuple[float, np.ndarray]:
    """Seconds per request of `predict` over the batches, each batch's texts new to the
    row cache as an arrival's are; and the lengths."""
    total, lengths = 0.0, []
    for batch in batches:
        predictor.featurizer_.__dict__.pop("_rows", None)  # type: ignore[attr-defined]
        start = time.perf_counter()
        lengths.append(predictor.predict(batch))
        total += time.perf_counter() - start
    return total / sum(map(len, batches)), np.concatenate(lengths)


def timing_worker(directory: Path, package_root: Path | None,
                  inputs: Sequence[PredictionInput], batch_size: int,
                  connection: Connection) -> None:
    """A worker process: the MoE loaded and warmed up, then one timed round (seconds per
    request and the lengths) per true message. One package per process: numba's cached
    kernels of two versions of one module clash in one process."""
    use_one_inference_thread()
    predictor = load_moe(directory, package_root)
    batches = [list(inputs[i:i + batch_size]) for i in range(0, len(inputs), batch_size)]
    predict_seconds(predictor, batches[:1])  # lazy allocations
    while connection.recv():
        connection.send(predict_seconds(predictor, batches))


def whole_predict(directory: Path, baseline: Path | None, inputs: Sequence[PredictionInput],
                  batch_size: int, rounds: int) -> None:
    """Print `predict`'s microseconds per request, min and median over the rounds, of
    this package and the baseline's, each in its worker, the two timed in turn."""
    roots = {"this package": None} | ({} if baseline is None else {
        f"baseline {baseline}": baseline})
    context = multiprocessing.get_context("spawn")
    workers = {}
    for name, root in roots.items():
        connection, worker_end = context.Pipe()
        process = context.Process(target=timing_worker, daemon=True, args=(
            directory, root, list(inputs), batch_size, worker_end))
        process.start()
        workers[name] = (process, connection)
    seconds: dict[str, list[float]] = {name: [] for name in workers}
    lengths = {}
    for _ in range(rounds):
        for name, (_, connection) in workers.items():
            connection.send(True)
            taken, lengths[name] = connection.recv()
            seconds[name].append(taken)
    for process, connection in workers.values():
        connection.send(False)
        process.join()
    print(f"whole predict: MoE of {directory}, batch {batch_size}, one torch thread, "
          f"{rounds} rounds")
    for name, taken in seconds.items():
        print(f"{name}: min {1e6 * min(taken):.2f} median {1e6 * float(np.median(taken)):.2f}"
              " us/request")
    if baseline is not None:
        print(f"same lengths (bitwise): {np.array_equal(*lengths.values())}")


def speed(
    prompts: Annotated[Path, typer.Option(help="prompt_lengths.jsonl")] = DEFAULT_PROMPTS,
    fit: Annotated[int, typer.Option(help="prompts the featurizer is fitted on")] = 3000,
    batch: Annotated[int, typer.Option(help="requests per batch")] = 64,
    repeats: Annotated[int, typer.Option(
        help="passes over the prompts (best kept; --whole-predict: rounds)")] = 3,
    whole_predict_dir: Annotated[Path | None, typer.Option(
        "--whole-predict", help="a trained predictor directory: time its MoE's predict"
    )] = None,
    baseline: Annotated[Path | None, typer.Option(
        help="root of another `predictor` package to time alternately (--whole-predict)"
    )] = None,
) -> int:
    """Print microseconds per request of the TF-IDF rows and of the whole transform."""
    if baseline is not None and whole_predict_dir is None:
        print("error: --baseline needs --whole-predict", file=sys.stderr)
        return 2
    rows = load_prompts(prompts)
    texts = [row.prompt for row in rows]
    featurizer = fitted_featurizer(texts, fit)
    inputs = [PredictionInput(text) for text in texts]
    tfidf = seconds_per_item(featurizer._tfidf.transform, texts, batch, repeats, lambda: None)
    transform = seconds_per_item(featurizer.transform, inputs, batch, repeats,
                                 lambda: featurizer.__dict__.pop("_rows", None))
    print(f"{len(texts)} prompts, fitted on {min(fit, len(texts))}, batch {batch}, "
          f"{len(featurizer.vectorizer_.vocabulary_)} terms")
    print(f"tfidf rows: {1e6 * tfidf:.2f} us/request")
    print(f"transform:  {1e6 * transform:.2f} us/request")
    if whole_predict_dir is not None:
        tasked = [PredictionInput(row.prompt, task=row.task or None) for row in rows]
        whole_predict(whole_predict_dir, baseline, tasked, batch, repeats)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(speed, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
