"""Micro-batching for the router: many threads submit, one worker predicts in batches.

Like Ray Serve's `@serve.batch`: a batch is flushed when it reaches `max_batch_size`
or when its oldest request has waited `max_wait_s`. The flush rule is a pure function
of counts and timestamps (`should_flush`), so it is testable without threads or clocks;
the worker itself waits on a real monotonic clock because it sleeps on a condition.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from predictor.base import PredictionInput, Predictor

__all__ = ["PredictionBatcher", "should_flush", "use_one_inference_thread"]


def use_one_inference_thread() -> None:
    """Run torch on one thread in the router process: micro-batches of a few dozen
    prompts gain nothing from intra-op threads, which contend with the router's own
    work (MoE, batch 20, 2 cores: 0.82 ms per request on torch's default threads,
    0.16 ms on one; `goodserve overhead` measures it in place)."""
    import torch

    torch.set_num_threads(1)


def should_flush(
    num_pending: int, oldest_arrival_s: float, now_s: float, max_batch_size: int, max_wait_s: float
) -> bool:
    """Flush when the batch is full or its oldest request has waited long enough."""
    return num_pending >= max_batch_size or now_s - oldest_arrival_s >= max_wait_s


@dataclass
class _Pending:
    request: PredictionInput
    arrival_s: float
    future: Future[float] = field(default_factory=Future)


class PredictionBatcher:
    """Thread-safe batching front of a fitted `Predictor`; results come back as futures.

    Use as a context manager, or call `start()` and `close()` explicitly. The predictor
    must not be re-fitted while the batcher runs.
    """

    def __init__(
        self,
        predictor: Predictor,
        max_batch_size: int = 64,
        max_wait_s: float = 0.002,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.predictor = predictor
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._worker: threading.Thread | None = None
        self.num_batches = 0  # batches predicted so far (for metrics and tests)

    def start(self) -> Self:
        with self._cond:
            if self._closed:
                raise RuntimeError("batcher is closed")
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="prediction-batcher", daemon=True
                )
                self._worker.start()
        return self

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting requests, predict those already queued, join the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def submit(self, request: PredictionInput) -> Future[float]:
        """Queue one request; the future resolves to its predicted total output length."""
        item = _Pending(request, time.monotonic())
        with self._cond:
            if self._closed or self._worker is None:
                raise RuntimeError("batcher is not running; call start() or use `with`")
            self._pending.append(item)
            if len(self._pending) == 1 or len(self._pending) >= self.max_batch_size:
                self._cond.notify()
        return item.future

    def predict(self, request: PredictionInput, timeout_s: float | None = None) -> float:
        """Blocking convenience around `submit`."""
        return self.submit(request).result(timeout_s)

    async def predict_async(self, request: PredictionInput) -> float:
        """Await a prediction from asyncio code (e.g. a Serve router) without blocking."""
        return await asyncio.wrap_future(self.submit(request))

    def _next_batch(self) -> list[_Pending]:
        """Block until a batch is due (or closing); empty list means stop."""
        with self._cond:
            while True:
                if self._pending:
                    now = time.monotonic()
                    oldest = self._pending[0].arrival_s
                    if self._closed or should_flush(
                        len(self._pending), oldest, now, self.max_batch_size, self.max_wait_s
                    ):
                        batch = self._pending[: self.max_batch_size]
                        del self._pending[: self.max_batch_size]
                        return batch
                    self._cond.wait(max(0.0, oldest + self.max_wait_s - now))
                elif self._closed:
                    return []
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while batch := self._next_batch():
            live = [item for item in batch if item.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                lengths = self.predictor.predict([item.request for item in live])
            except Exception as exc:  # hand the failure to every caller in the batch
                for item in live:
                    item.future.set_exception(exc)
                continue
            self.num_batches += 1
            for item, length in zip(live, lengths, strict=True):
                item.future.set_result(float(length))
