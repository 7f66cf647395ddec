"""Micro-batcher: a lone request at once, size and time flushes under load, per-caller
results and errors, equivalence with direct predict under concurrency."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import numpy as np
import pytest

from predictor.base import PredictionInput, Predictor
from predictor.batching import PredictionBatcher
from predictor.history import TaskHistoryPredictor
from predictor.moe import MoEPredictor
from predictor.synthetic import make_synthetic_records

pytestmark = pytest.mark.unit


class RecordingPredictor(Predictor):
    """Length = 10 * words + k, so every request has its own answer; logs each batch's
    size and the thread that predicted it, then holds the batch until `gate` opens."""

    kind = "recording"

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.fail = fail
        self.gate = gate

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        self.batch_sizes_: list[int] = []
        self.threads_: list[int] = []
        return self

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        self.threads_.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("model exploded")
        self.batch_sizes_.append(len(inputs))
        if self.gate is not None:
            self.gate.wait(5.0)
        return np.array([10.0 * len(i.prompt.split()) + i.num_generated_tokens for i in inputs])

    def _save_state(self, directory: Path) -> None:
        raise NotImplementedError

    def _load_state(self, directory: Path) -> None:
        raise NotImplementedError


def words(n: int) -> PredictionInput:
    return PredictionInput("w " * n)


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Poll `condition` (the inference thread's progress) from the event loop."""
    deadline = time.perf_counter() + timeout_s
    while not condition():
        assert time.perf_counter() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def predict_all(batcher: PredictionBatcher, requests: Sequence[PredictionInput],
                      timeout_s: float = 5.0) -> list[float]:
    calls = asyncio.gather(*(batcher.predict_async(r) for r in requests))
    return await asyncio.wait_for(calls, timeout_s)


async def test_one_predict_serves_many_concurrent_callers_in_order():
    """Requests of one event-loop turn share the batch that starts at once (a 10 s
    window would outlast the timeout)."""
    predictor = RecordingPredictor().fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=10.0)
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


async def test_a_lone_request_is_predicted_at_once_whatever_the_window():
    predictor = RecordingPredictor().fit([], [])
    # A 10 s window: a lone request that waited for it would miss the timeout.
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=10.0)
    for n in range(1, 6):
        assert await asyncio.wait_for(batcher.predict_async(words(n)), 2.0) == 10.0 * n
    batcher.close()
    assert predictor.batch_sizes_ == [1] * 5


async def test_requests_arriving_during_a_batch_join_the_next_one():
    gate = threading.Event()
    predictor = RecordingPredictor(gate=gate).fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.0)
    first = asyncio.ensure_future(batcher.predict_async(words(1)))
    await until(lambda: predictor.batch_sizes_ == [1])  # started alone, held at the gate
    later = [asyncio.ensure_future(batcher.predict_async(words(n))) for n in (2, 3, 4)]
    await asyncio.sleep(0.02)
    assert predictor.batch_sizes_ == [1] and not any(f.done() for f in [first, *later])
    gate.set()
    got = await asyncio.wait_for(asyncio.gather(first, *later), 2.0)
    batcher.close()
    assert got == [10.0, 20.0, 30.0, 40.0] and predictor.batch_sizes_ == [1, 3]


async def test_under_load_a_partial_batch_waits_until_its_oldest_request_has_waited():
    gate = threading.Event()
    predictor = RecordingPredictor(gate=gate).fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.2)
    first = asyncio.ensure_future(batcher.predict_async(words(1)))
    await until(lambda: predictor.batch_sizes_ == [1])
    arrived = time.perf_counter()
    second = asyncio.ensure_future(batcher.predict_async(words(2)))
    gate.set()
    assert await asyncio.wait_for(first, 2.0) == 10.0
    await asyncio.sleep(0.05)
    assert not second.done() and predictor.batch_sizes_ == [1]  # inside its window
    third = asyncio.ensure_future(batcher.predict_async(words(3)))
    got = await asyncio.wait_for(asyncio.gather(second, third), 2.0)
    waited_s = time.perf_counter() - arrived
    batcher.close()
    assert got == [20.0, 30.0] and predictor.batch_sizes_ == [1, 2]  # the late one joined
    assert 0.19 <= waited_s < 1.0


async def test_a_caller_that_gave_up_is_left_out_of_its_batch():
    gate = threading.Event()
    predictor = RecordingPredictor(gate=gate).fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.0)
    first = asyncio.ensure_future(batcher.predict_async(words(1)))
    await until(lambda: predictor.batch_sizes_ == [1])
    gone, kept = (asyncio.ensure_future(batcher.predict_async(words(n))) for n in (2, 3))
    await asyncio.sleep(0)
    gone.cancel()
    gate.set()
    assert await asyncio.wait_for(asyncio.gather(first, kept), 2.0) == [10.0, 30.0]
    batcher.close()
    assert gone.cancelled() and predictor.batch_sizes_ == [1, 1]


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
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(batcher.predict_async(words(1)), 5.0)


async def test_closing_ends_the_running_batch_and_fails_the_queued_requests():
    gate = threading.Event()
    predictor = RecordingPredictor(gate=gate).fit([], [])
    batcher = PredictionBatcher(predictor, max_batch_size=64, max_wait_s=0.0)
    running = asyncio.ensure_future(batcher.predict_async(words(1)))
    await until(lambda: predictor.batch_sizes_ == [1])
    queued = [asyncio.ensure_future(batcher.predict_async(words(2))) for _ in range(2)]
    await asyncio.sleep(0)
    batcher.close()
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(running, *queued, return_exceptions=True),
                                     2.0)
    assert results[0] == 10.0 and predictor.batch_sizes_ == [1]
    assert all(isinstance(r, RuntimeError) and "shutdown" in str(r) for r in results[1:])


def test_a_batch_size_below_one_or_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="max_batch_size"):
        PredictionBatcher(RecordingPredictor(), max_batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        PredictionBatcher(RecordingPredictor(), max_wait_s=-0.001)


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
