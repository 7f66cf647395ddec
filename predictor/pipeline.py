"""Train the standard predictor set and score it: MAE, normalised MAE, batch latency.

Shared by `predictor.cli` and `benchmarks/predictor_accuracy.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from predictor.base import PredictionInput, Predictor
from predictor.data import LengthRecord
from predictor.registry import PredictorKind, make_predictor

__all__ = [
    "EvalResult",
    "evaluate_predictor",
    "evaluate_predictors",
    "predictor_kinds",
    "predictor_params",
    "reprediction_mae",
    "shuffled_training_data",
    "train_predictors",
]

LATENCY_BATCH_SIZE = 64
MAX_LATENCY_BATCHES = 20


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and speed of one predictor on one set of finished requests."""

    mae: float  # mean |predicted - true| output tokens
    nmae: float  # mae / mean(true)
    latency_ms_per_request: float  # predict() wall time / requests, batches of 64 (median)
    num_requests: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def predictor_kinds(records: Sequence[LengthRecord], with_encoder: bool) -> list[PredictorKind]:
    """The predictors worth training for this data: task history only if tasks exist."""
    kinds = [PredictorKind.MOE, PredictorKind.HISTORY]
    if any(r.task is not None for r in records):
        kinds.append(PredictorKind.HISTORY_TASK)
    kinds.append(PredictorKind.MLP)
    if with_encoder:
        kinds.append(PredictorKind.LLM_EMBEDDING)
    return kinds


def shuffled_training_data(
    records: Sequence[LengthRecord], seed: int
) -> tuple[list[PredictionInput], list[int]]:
    """Inputs and lengths in a seeded random order.

    History windows keep the most recent lengths, and a file sorted by source would
    otherwise leave them holding a single source.
    """
    order = np.random.default_rng(seed).permutation(len(records))
    return [records[i].to_input() for i in order], [records[i].output_tokens for i in order]


def predictor_params(
    kind: PredictorKind,
    num_experts: int = 9,
    seed: int = 0,
    encoder_path: str | None = None,
    show_progress: bool = False,
) -> dict[str, object]:
    """Hyperparameters the CLI and the benchmark pass to `make_predictor(kind, ...)`."""
    neural = {"random_state": seed, "show_progress": show_progress}
    if kind is PredictorKind.MOE:
        return {"num_experts": num_experts, **neural}
    if kind is PredictorKind.MLP:
        return neural
    if kind is PredictorKind.LLM_EMBEDDING:
        return {"encoder_path": encoder_path, **neural}
    return {}


def train_predictors(
    records: Sequence[LengthRecord],
    num_experts: int = 9,
    seed: int = 0,
    encoder_path: str | None = None,
    show_progress: bool = False,
) -> dict[str, Predictor]:
    """Fit the MoE and every applicable baseline on the same records."""
    inputs, lengths = shuffled_training_data(records, seed)
    predictors = {}
    for kind in predictor_kinds(records, with_encoder=encoder_path is not None):
        params = predictor_params(kind, num_experts, seed, encoder_path, show_progress)
        predictors[kind.value] = make_predictor(kind, **params).fit(inputs, lengths)
    return predictors


def measure_latency_ms(
    predictor: Predictor,
    inputs: Sequence[PredictionInput],
    batch_size: int = LATENCY_BATCH_SIZE,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds per request of `predict` on batches of `batch_size`.

    The median over batches (after a warm-up batch), so that a burst of other load
    on a shared machine does not dominate the figure.
    """
    batches = [inputs[i : i + batch_size] for i in range(0, len(inputs), batch_size)]
    batches = batches[: MAX_LATENCY_BATCHES + 1]
    predictor.predict(batches[0])  # warm-up: lazy allocations, caches
    per_request_ms = []
    for batch in batches[1:] or batches:
        start = clock()
        predictor.predict(batch)
        per_request_ms.append(1000.0 * (clock() - start) / len(batch))
    return float(np.median(per_request_ms))


def evaluate_predictor(
    predictor: Predictor, records: Sequence[LengthRecord], batch_size: int = LATENCY_BATCH_SIZE
) -> EvalResult:
    """Initial predictions (nothing generated yet) against the true lengths."""
    inputs = [r.to_input() for r in records]
    truth = np.array([r.output_tokens for r in records], dtype=np.float64)
    errors = np.abs(predictor.predict(inputs) - truth)
    mae = float(errors.mean())
    latency_ms = measure_latency_ms(predictor, inputs, batch_size)
    return EvalResult(mae, mae / float(truth.mean()), latency_ms, len(records))


def reprediction_mae(
    predictor: Predictor, records: Sequence[LengthRecord], interval_tokens: int = 50
) -> float:
    """MAE of the total re-predicted every `interval_tokens` generated tokens (watchdog
    style: each request contributes one sample per check it lives through)."""
    probe, truth = [], []
    for r in records:
        for k in range(interval_tokens, r.output_tokens, interval_tokens):
            probe.append(PredictionInput(r.prompt, num_generated_tokens=k, task=r.task))
            truth.append(r.output_tokens)
    if not probe:
        return 0.0
    return float(np.abs(predictor.predict(probe) - np.asarray(truth, dtype=np.float64)).mean())


def evaluate_predictors(
    predictors: Mapping[str, Predictor], records: Sequence[LengthRecord]
) -> dict[str, EvalResult]:
    return {name: evaluate_predictor(p, records) for name, p in predictors.items()}
