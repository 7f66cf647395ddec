"""Micro-batcher: size and time flushes, per-caller results and errors, equivalence with
direct predict under concurrency."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import numpy as np
import pytest

from predictor.base import PredictionInput, Predictor
from predictor.batching import PredictionBatcher
from predictor.history import TaskHistoryPredictor
from predictor.moe import MoEPredictor
from predictor.synthetic import make_synthetic_records

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("batching_outside_replicas")]


class RecordingPredictor(Predictor):
    """Length = 10 * words + k, so every request has its own answer; logs each batch's
    size and the thread that predicted it."""

    kind = "recording"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        self.batch_sizes_: list[int] = []
        self.threads_: list[int] = []
        return self

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        self.threads_.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("model exploded")
        self.batch_sizes_.append(len(inputs))
        return np.array([10.0 * len(i.prompt.split()) + i.num_generated_tokens for i in inputs])

    def _save_state(self, directory: Path) -> None:
        raise NotImplementedError

    def _load_state(self, directory: Path) -> None:
        raise NotImplementedError


def words(n: int) -> PredictionInput:
    return PredictionInput("w " * n)


async def predict_all(batcher: PredictionBatcher, requests: Sequence[PredictionInput],
                      timeout_s: float = 5.0) -> list[float]:
    calls = asyncio.gather(*(batcher.predict_async(r) for r in requests))
    return await asyncio.wait_for(calls, timeout_s)


async def test_one_predict_serves_many_concurrent_callers_in_order():
    predictor = RecordingPredictor().fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.05)
    probe = [PredictionInput("w " * (i % 7 + 1), num_generated_tokens=i) for i in range(20)]
    got = await predict_all(batcher, probe)
    batcher.close()
    assert predictor.batch_sizes_ == [20]
    assert got == [10.0 * (i % 7 + 1) + i for i in range(20)]


async def test_full_batches_flush_without_waiting_for_the_window():
    predictor = RecordingPredictor().fit([], [])
    # A 10 s window: only the size trigger can flush these batches within the timeout.
    batcher = PredictionBatcher(predictor, max_batch_size=8, max_wait_s=10.0)
    got = await predict_all(batcher, [words(i + 1) for i in range(24)], timeout_s=2.0)
    batcher.close()
    assert predictor.batch_sizes_ == [8, 8, 8]
    assert got == [10.0 * (i + 1) for i in range(24)]


async def test_a_partial_batch_flushes_when_its_first_request_has_waited():
    predictor = RecordingPredictor().fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.2)
    started = time.perf_counter()
    first = asyncio.ensure_future(batcher.predict_async(words(1)))
    await asyncio.sleep(0.05)
    assert not first.done() and predictor.batch_sizes_ == []  # still inside the window
    second = asyncio.ensure_future(batcher.predict_async(words(2)))
    got = await asyncio.wait_for(asyncio.gather(first, second), 2.0)
    waited_s = time.perf_counter() - started
    batcher.close()
    assert got == [10.0, 20.0] and predictor.batch_sizes_ == [2]  # the late one joined
    assert 0.19 <= waited_s < 1.0


async def test_an_error_reaches_every_caller_of_its_batch_and_the_batcher_goes_on():
    predictor = RecordingPredictor(fail=True).fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=8, max_wait_s=0.05)
    calls = [batcher.predict_async(words(1)) for _ in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5.0)
    assert len(predictor.threads_) == 1  # one batch failed
    assert all(isinstance(r, RuntimeError) and str(r) == "model exploded" for r in results)
    predictor.fail = False
    assert await predict_all(batcher, [words(3)]) == [30.0]
    batcher.close()


async def test_predictions_run_on_one_thread_off_the_event_loop():
    predictor = RecordingPredictor().fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=2, max_wait_s=0.0)
    await predict_all(batcher, [words(i + 1) for i in range(6)])
    batcher.close()
    assert len(predictor.threads_) >= 3 and len(set(predictor.threads_)) == 1
    assert predictor.threads_[0] != threading.get_ident()


async def test_a_closed_batcher_refuses_new_predictions():
    batcher = PredictionBatcher(RecordingPredictor().fit([], []), max_wait_s=0.0)
    assert await batcher.predict_async(PredictionInput("a b c", num_generated_tokens=5)) == 35.0
    batcher.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        await asyncio.wait_for(batcher.predict_async(words(1)), 5.0)


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
async def test_concurrent_callers_get_the_same_results_as_direct_predict(make_predictor):
    records = make_synthetic_records(100, seed=4)
    inputs = [r.to_input() for r in records]
    predictor = make_predictor().fit(inputs, [r.output_tokens for r in records])
    probe = [PredictionInput(inp.prompt, "", k, inp.task) for k, inp in enumerate(inputs)]
    expected = predictor.predict(probe)
    batcher = PredictionBatcher(predictor, max_batch_size=16, max_wait_s=0.002)
    got = await predict_all(batcher, probe, timeout_s=30.0)
    batcher.close()
    # Same rows, other batch compositions: equal up to float32 summation order.
    np.testing.assert_allclose(got, expected, rtol=1e-5)
