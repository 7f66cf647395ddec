"""Micro-batcher: flush rule, equivalence with direct predict under concurrency."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

import numpy as np
import pytest

from predictor.base import PredictionInput, Predictor
from predictor.batching import PredictionBatcher, should_flush
from predictor.history import TaskHistoryPredictor
from predictor.moe import MoEPredictor
from predictor.synthetic import make_synthetic_records

pytestmark = pytest.mark.unit


class RecordingPredictor(Predictor):
    """Length = 10 * words + k, so every request has its own answer; logs batch sizes."""

    kind = "recording"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        self.batch_sizes_: list[int] = []
        return self

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        if self.fail:
            raise RuntimeError("model exploded")
        self.batch_sizes_.append(len(inputs))
        return np.array([10.0 * len(i.prompt.split()) + i.num_generated_tokens for i in inputs])

    def _save_state(self, directory: Path) -> None:
        raise NotImplementedError

    def _load_state(self, directory: Path) -> None:
        raise NotImplementedError


def test_flush_rule():
    assert should_flush(64, oldest_arrival_s=0.0, now_s=0.0, max_batch_size=64, max_wait_s=0.002)
    assert not should_flush(
        3, oldest_arrival_s=1.0, now_s=1.001, max_batch_size=64, max_wait_s=0.002
    )
    assert should_flush(3, oldest_arrival_s=1.0, now_s=1.002, max_batch_size=64, max_wait_s=0.002)


def tiny_moe() -> MoEPredictor:
    return MoEPredictor(
        num_experts=4,
        expert_hidden_dim=8,
        gate_hidden_dim=8,
        expert_epochs=2,
        gate_epochs=2,
        max_features=128,
        device="cpu",
    )


@pytest.mark.parametrize(
    "make_predictor", [lambda: TaskHistoryPredictor(min_task_samples=5), tiny_moe]
)
def test_concurrent_threads_get_the_same_results_as_direct_predict(make_predictor):
    records = make_synthetic_records(100, seed=4)
    inputs = [r.to_input() for r in records]
    predictor = make_predictor().fit(inputs, [r.output_tokens for r in records])
    probe = [PredictionInput(inp.prompt, "", k, inp.task) for k, inp in enumerate(inputs)]
    expected = predictor.predict(probe)
    with PredictionBatcher(predictor, max_batch_size=16, max_wait_s=0.002) as batcher:
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(batcher.predict, probe))
        assert batcher.num_batches < len(probe)  # requests were actually batched
    # Same rows, other batch compositions: equal up to float32 summation order.
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_batches_never_exceed_max_size_and_full_batches_flush_early():
    predictor = RecordingPredictor().fit([], [])
    probe = [PredictionInput("w " * (i + 1)) for i in range(50)]
    # A 10 s window: only the size trigger (or close) can flush these batches in time.
    with PredictionBatcher(predictor, max_batch_size=8, max_wait_s=10.0) as batcher:
        futures = [batcher.submit(p) for p in probe[:48]]
        results = [f.result(timeout=5) for f in futures]
        tail = [batcher.submit(p) for p in probe[48:]]
    assert [f.result(timeout=0) for f in tail] == [490.0, 500.0]  # close() drained them
    assert results == [10.0 * (i + 1) for i in range(48)]
    assert max(predictor.batch_sizes_) <= 8 and predictor.batch_sizes_[:6] == [8] * 6


def test_errors_reach_every_caller_and_lifecycle_is_explicit():
    batcher = PredictionBatcher(RecordingPredictor(fail=True).fit([], []), max_wait_s=0.0)
    with pytest.raises(RuntimeError, match="not running"):
        batcher.submit(PredictionInput("x"))
    with batcher:
        futures = [batcher.submit(PredictionInput("x")) for _ in range(3)]
        for future in futures:
            with pytest.raises(RuntimeError, match="model exploded"):
                future.result(timeout=5)
    with pytest.raises(RuntimeError, match="not running"):
        batcher.submit(PredictionInput("x"))
    assert not any(t.name == "prediction-batcher" and t.is_alive() for t in threading.enumerate())


async def test_predict_async():
    predictor = RecordingPredictor().fit([], [])
    with PredictionBatcher(predictor, max_wait_s=0.0) as batcher:
        assert await batcher.predict_async(PredictionInput("a b c", num_generated_tokens=5)) == 35.0
