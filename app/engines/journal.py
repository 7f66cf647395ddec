"""Every request's output, kept by the engine that generates it, so another router
replica can pick the request up where it is.

A router replica that dies takes its memory of the requests it was streaming with it,
while their generations go on in the engines. The journal decouples the two: a
submission runs in a task of its own and appends its tokens here; callers read the
journal (from any output index), not the generation. A second reader (a replica that
re-attaches the request for a client's retry) sees what was produced so far, then the
rest as it comes.

Only an explicit `abort` stops a generation at once. One whose last reader left before
it ended (the caller died, or its stream was closed without an abort) goes on for
`detached_grace_s`, long enough for a retry to re-attach it, and is aborted after.
Ended submissions (finished, aborted or failed) stay readable for `retain_s`, at most
`max_ended` of them: a retry of a request that just finished gets its output again
instead of running it twice, and an aborted one (moved, or its client left) is a
checkpoint another engine continues from by token ids.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from app.engines.base import EngineBackendBase
from app.engines.messages import EngineRecord, EngineRequest, TokenEvent, client_request_id

RETAIN_S = 60.0  # an ended submission's output stays readable this long
DETACHED_GRACE_S = 30.0  # a running submission with no reader is aborted after this
MAX_ENDED = 4096  # ended submissions kept at most (the oldest go first)


@dataclass(eq=False)
class JournalEntry:
    """One submission: its request, its tokens so far and how it ended."""

    request: EngineRequest
    events: list[TokenEvent] = field(default_factory=list)
    ended: bool = False
    aborted: bool = False  # ended by an abort (a move, a stop, a client that left)
    error: BaseException | None = None  # the engine failed it
    num_readers: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # the task that feeds it from the backend; cancelled by an abort, which closes the
    # backend's stream (an engine stops a request whose stream is closed)
    task: asyncio.Task | None = None

    def notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def record(self) -> EngineRecord:
        return EngineRecord(self.request.request_id, tuple(self.request.prompt_token_ids),
                            tuple(self.request.resume_token_ids), tuple(self.events),
                            ended=self.ended, aborted=self.aborted or self.error is not None)


class OutputJournal:
    """Runs a backend's submissions detached from their callers and keeps their output."""

    def __init__(self, backend: EngineBackendBase, *, retain_s: float = RETAIN_S,
                 detached_grace_s: float = DETACHED_GRACE_S, max_ended: int = MAX_ENDED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.detached_grace_s = detached_grace_s
        self.entries: dict[str, JournalEntry] = {}  # engine request id -> entry
        self._ended = Retention(retain_s, max_ended, clock)
        self._tasks: set[asyncio.Task] = set()

    def start(self, request: EngineRequest) -> None:
        """Begin a submission (its tokens go to the journal); ValueError for an id seen."""
        self.sweep()
        if request.request_id in self.entries:
            raise ValueError(f"duplicate request id {request.request_id}")
        entry = JournalEntry(request)
        self.entries[request.request_id] = entry
        task = entry.task = asyncio.ensure_future(self._run(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        """Start the submission and read it from its first new token."""
        self.start(request)
        async for batch in self.read(request.request_id, len(request.resume_token_ids)):
            yield batch

    async def _run(self, entry: JournalEntry) -> None:
        try:
            async for batch in self.backend.generate(entry.request):
                entry.events.extend(batch)
                entry.notify()
        except Exception as exc:  # handed to the readers
            entry.error = exc
        finally:
            entry.ended = True
            self._ended.ended(entry.request.request_id)
            entry.notify()

    async def read(self, request_id: str, from_index: int) -> AsyncIterator[list[TokenEvent]]:
        """The submission's tokens from output index `from_index` on, as they come; its
        engine's error, if it failed. KeyError when the journal does not hold it."""
        entry = self.entries[request_id]
        entry.num_readers += 1
        try:
            position = next((i for i, ev in enumerate(entry.events) if ev.index >= from_index),
                            len(entry.events))
            while True:
                changed = entry.changed
                if position < len(entry.events):
                    batch = entry.events[position:]
                    position += len(batch)
                    yield batch
                    continue
                if entry.ended:
                    if entry.error is not None and not entry.aborted:
                        raise entry.error
                    return
                await changed.wait()
        finally:
            entry.num_readers -= 1
            if entry.num_readers == 0 and not entry.ended:
                asyncio.get_event_loop().call_later(
                    self.detached_grace_s, self._abort_if_detached, entry)

    def _abort_if_detached(self, entry: JournalEntry) -> None:
        if entry.num_readers == 0 and not entry.ended:
            task = asyncio.ensure_future(self.abort(entry.request.request_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def abort(self, request_id: str) -> bool:
        """Stop a submission now; its output so far stays readable."""
        entry = self.entries.get(request_id)
        running = entry is not None and not entry.ended
        if running:
            entry.aborted = True
        aborted = await self.backend.abort(request_id)
        if running and entry.task is not None:
            entry.task.cancel()
        return aborted

    def find(self, request_id: str) -> list[EngineRecord]:
        """Every submission of the client request `request_id` held here."""
        self.sweep()
        return [entry.record() for eid, entry in self.entries.items()
                if client_request_id(eid) == request_id]

    def sweep(self) -> None:
        """Forget ended submissions past `retain_s`, and the oldest beyond `max_ended`."""
        for request_id in self._ended.expired():
            self.entries.pop(request_id, None)


class Retention:
    """Ids of ended things, oldest first, kept `retain_s` and at most `max_kept`."""

    def __init__(self, retain_s: float, max_kept: int, clock: Callable[[], float]) -> None:
        self.retain_s = retain_s
        self.max_kept = max_kept
        self.clock = clock
        self._ended: OrderedDict[str, float] = OrderedDict()  # id -> ended at

    def ended(self, key: str) -> None:
        self._ended[key] = self.clock()

    def expired(self) -> list[str]:
        """The ids past their time or beyond the bound, forgotten here."""
        expired_s = self.clock() - self.retain_s
        gone = []
        while self._ended:
            key, ended_s = next(iter(self._ended.items()))
            if ended_s > expired_s and len(self._ended) <= self.max_kept:
                break
            del self._ended[key]
            gone.append(key)
        return gone
