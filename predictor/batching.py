"""Micro-batching for the router: concurrent requests share one `Predictor.predict`.

Ray Serve's `@serve.batch` does the flush (a batch runs when it holds `max_batch_size`
requests or when its first one has waited `max_wait_s`) and hands each caller its own
result, or the batch's exception. The prediction itself runs on one inference thread,
since torch blocks the event loop the router serves from.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from predictor.base import PredictionInput, Predictor

__all__ = ["PredictionBatcher", "use_one_inference_thread"]


def use_one_inference_thread() -> None:
    """Run torch on one thread in the router process: micro-batches of a few dozen
    prompts gain nothing from intra-op threads, which contend with the router's own
    work (MoE, batch 20, 2 cores: 0.82 ms per request on torch's default threads,
    0.16 ms on one; `goodserve overhead` measures it in place)."""
    import torch

    torch.set_num_threads(1)


class PredictionBatcher:
    """Batching front of a fitted `Predictor` for asyncio callers (the Serve router).

    Built inside a Serve replica (the router deployment): Serve's batch queue reads the
    replica's `max_ongoing_requests`. Every call must come from one event loop: the queue
    binds to the loop of the first call. The predictor must not be re-fitted while the
    batcher runs.
    """

    def __init__(
        self,
        predictor: Predictor,
        max_batch_size: int = 64,
        max_wait_s: float = 0.002,
    ) -> None:
        from ray import serve

        self._predictor = predictor
        # One thread, as torch was tuned for (`use_one_inference_thread`), and one that
        # `close` can end; batches run one at a time (Serve's max_concurrent_batches=1).
        self._inference = ThreadPoolExecutor(1, thread_name_prefix="prediction-batcher")
        # Decorated per instance: a class-level `@serve.batch` queues every instance's
        # requests together, with their sizes set once for all.
        self._batched = serve.batch(max_batch_size=max_batch_size,
                                    batch_wait_timeout_s=max_wait_s)(self._predict_batch)

    async def predict_async(self, request: PredictionInput) -> float:
        """The predicted total output length of `request`, from the batch it joins."""
        return await self._batched(request)

    async def _predict_batch(self, requests: list[PredictionInput]) -> list[float]:
        """One `Predictor.predict` for a flushed batch, off the event loop."""
        loop = asyncio.get_running_loop()
        lengths = await loop.run_in_executor(self._inference, self._predictor.predict, requests)
        return [float(length) for length in lengths]

    def close(self) -> None:
        """End the inference thread once its batch is done; later calls raise
        RuntimeError."""
        self._inference.shutdown(wait=False)
