"""Stream batching between an engine and the router.

Each engine iteration yields a batch of tokens per request; sent one by one over
Ray, those batches cost the router more than the routing itself at a few thousand
tokens per second. `coalesce` merges the batches of a time window (like vLLM's
stream interval): the first batch (time to first token) goes out at once, later
ones every `interval_s` at most, and the last one as soon as the stream ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def coalesce(source: AsyncIterator[list[T]], interval_s: float) -> AsyncIterator[list[T]]:
    """`source`'s items, concatenated per window of `interval_s` (0 = pass through)."""
    if interval_s <= 0:
        async for batch in source:
            yield batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for batch in source:
                queue.put_nowait(batch)
            queue.put_nowait(_END)
        except Exception as exc:  # hand the failure to the consumer
            queue.put_nowait(exc)

    task = asyncio.create_task(pump())
    loop = asyncio.get_running_loop()
    try:
        first = True
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            pending = list(item)
            ended = False
            if not first:
                deadline = loop.time() + interval_s
                while (remaining := deadline - loop.time()) > 0:
                    try:
                        item = await asyncio.wait_for(queue.get(), remaining)
                    except TimeoutError:
                        break
                    if item is _END:
                        ended = True
                        break
                    if isinstance(item, Exception):
                        yield pending
                        raise item
                    pending.extend(item)
            first = False
            yield pending
            if ended:
                return
    finally:
        task.cancel()
