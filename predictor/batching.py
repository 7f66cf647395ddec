"""Micro-batching for the router: concurrent requests share one `Predictor.predict`.

A request that finds the inference thread idle is predicted at once: its batch starts
on the event loop's next turn, with whatever arrived in the same turn. Only under load
does a batch wait: requests that arrive while a batch runs queue, and the next batch
starts when the running one ends and its oldest request has waited `max_wait_s`
(at once when `max_batch_size` requests are queued). Ray Serve's `@serve.batch` cannot
do this: it holds even a lone request for its whole wait. Each caller gets its own
result, or the batch's exception.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from predictor.base import PredictionInput, Predictor

__all__ = ["PredictionBatcher", "use_one_inference_thread"]


def use_one_inference_thread() -> None:
    """Run torch on one thread in the router process: micro-batches of a few dozen
    prompts gain nothing from intra-op threads, which contend with the router's own
    work (MoE, batch 20, 2 cores: 0.82 ms per request on torch's default threads,
    0.16 ms on one; `goodserve overhead` measures it in place)."""
    import torch

    torch.set_num_threads(1)


@dataclass(frozen=True)
class Waiting:
    """A queued request and the caller's future for its predicted length."""

    request: PredictionInput
    future: asyncio.Future[float]
    arrived_s: float  # the event loop's clock


class PredictionBatcher:
    """Batching front of a fitted `Predictor` for asyncio callers (the Serve router).

    Every call must come from one event loop (the first call's). Batches run one at a
    time on one inference thread, as torch was tuned for (`use_one_inference_thread`),
    so the event loop keeps serving. The predictor must not be re-fitted while the
    batcher runs.
    """

    def __init__(
        self,
        predictor: Predictor,
        max_batch_size: int = 64,
        max_wait_s: float = 0.002,
    ) -> None:
        if max_batch_size < 1 or max_wait_s < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_wait_s >= 0, not "
                             f"{max_batch_size} and {max_wait_s}")
        self._predictor = predictor
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._inference = ThreadPoolExecutor(1, thread_name_prefix="prediction-batcher")
        self._queue: deque[Waiting] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False  # a batch is on the inference thread
        self._next_batch: asyncio.Handle | None = None  # the scheduled start of one
        self._closed = False

    async def predict_async(self, request: PredictionInput) -> float:
        """The predicted total output length of `request`, from the batch it joins."""
        if self._closed:
            raise RuntimeError("the prediction batcher is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("a PredictionBatcher serves the event loop of its first call")
        future: asyncio.Future[float] = loop.create_future()
        self._queue.append(Waiting(request, future, loop.time()))
        if not self._running:
            if len(self._queue) >= self.max_batch_size:
                self._start_batch()
            elif self._next_batch is None:  # idle: this turn's arrivals, then at once
                self._next_batch = loop.call_soon(self._start_batch)
        return await future

    def _start_batch(self) -> None:
        """Up to `max_batch_size` queued requests (oldest first) onto the inference
        thread; requests whose callers gave up are dropped."""
        if self._next_batch is not None:
            self._next_batch.cancel()
            self._next_batch = None
        batch: list[Waiting] = []
        while self._queue and len(batch) < self.max_batch_size:
            waiting = self._queue.popleft()
            if not waiting.future.done():
                batch.append(waiting)
        if not batch:
            return
        assert self._loop is not None
        try:
            work = self._loop.run_in_executor(
                self._inference, self._predictor.predict, [w.request for w in batch])
        except RuntimeError as error:  # closed: the inference thread is gone
            self._fail(batch, error)
            self._after_batch()
            return
        self._running = True
        work.add_done_callback(partial(self._finish, batch))

    def _finish(self, batch: list[Waiting], done: asyncio.Future) -> None:
        """The batch's lengths, or its exception, to each caller; then the next batch."""
        self._running = False
        try:
            lengths = done.result()
            if len(lengths) != len(batch):
                raise RuntimeError(f"predicted {len(lengths)} lengths for a batch of "
                                   f"{len(batch)} requests")
        except Exception as error:  # the callers handle it
            self._fail(batch, error)
        else:
            for waiting, length in zip(batch, lengths, strict=True):
                if not waiting.future.done():  # else its caller gave up meanwhile
                    waiting.future.set_result(float(length))
        self._after_batch()

    @staticmethod
    def _fail(batch: list[Waiting], error: Exception) -> None:
        """The same exception to every caller of the batch."""
        for waiting in batch:
            if not waiting.future.done():
                waiting.future.set_exception(error)

    def _after_batch(self) -> None:
        """Under load: the next batch once full, or once its oldest request has waited
        `max_wait_s` (at once when it already has)."""
        if not self._queue or self._running or self._next_batch is not None:
            return
        assert self._loop is not None
        if len(self._queue) >= self.max_batch_size:
            self._start_batch()
        else:
            start_s = self._queue[0].arrived_s + self.max_wait_s
            self._next_batch = self._loop.call_at(start_s, self._start_batch)

    def close(self) -> None:
        """End the inference thread once its batch is done; later calls, and requests
        still queued, raise RuntimeError."""
        self._closed = True
        self._inference.shutdown(wait=False)
