"""Every request's output, kept by the engine that generates it, so another router
replica can pick the request up where it is.

A router replica that dies takes its memory of the requests it was streaming with it,
while their generations go on in the engines. The journal decouples the two: a
submission runs in a task of its own and appends its tokens here; callers read the
journal (from any output index), not the generation. A second reader (a replica that
re-attaches the request for a client's retry) sees what was produced so far, then the
rest as it comes.

A caller reads by polling (`poll`: the tokens past an index, waiting for the first),
not through a stream the engine pushes: an engine actor's pushed stream, once it ends,
waits for the caller to acknowledge every batch, and with the caller's node lost that
wait held the engine's whole event loop until Ray declared the node dead (15-30 s).
A poll's reply to a dead caller is simply lost.

Only an explicit `abort` stops a generation at once. One nobody has polled for
`detached_grace_s` before it ended (the caller died, or stopped reading without an
abort) is aborted then: long enough for a retry to re-attach it.
Ended submissions (finished, aborted or failed) stay readable for `retain_s`, at most
`max_ended` of them: a retry of a request that just finished gets its output again
instead of running it twice, and an aborted one (moved, or its client left) is a
checkpoint another engine continues from by token ids.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
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
    num_polling: int = 0  # polls waiting on it now
    polled_s: float = 0.0  # when a poll last returned (or it started)
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
        self.clock = clock
        self.detached_grace_s = detached_grace_s
        self.entries: dict[str, JournalEntry] = {}  # engine request id -> entry
        self._ended = Retention(retain_s, max_ended, clock)
        self._tasks: set[asyncio.Task] = set()

    def start(self, request: EngineRequest) -> None:
        """Begin a submission (its tokens go to the journal); ValueError for an id seen."""
        self.sweep()
        if request.request_id in self.entries:
            raise ValueError(f"duplicate request id {request.request_id}")
        entry = JournalEntry(request, polled_s=self.clock())
        self.entries[request.request_id] = entry
        task = entry.task = asyncio.ensure_future(self._run(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._check_detached_later(entry, self.detached_grace_s)

    async def generate(self, request: EngineRequest, linger_s: float = 0.0
                       ) -> AsyncIterator[list[TokenEvent]]:
        """Start the submission and read it from its first new token."""
        self.start(request)
        async for batch in self.read(request.request_id, len(request.resume_token_ids),
                                     linger_s):
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

    async def poll(self, request_id: str, from_index: int, linger_s: float = 0.0
                   ) -> tuple[list[TokenEvent], bool]:
        """The submission's tokens from output index `from_index` on: waits for the
        first (or the end), then up to `linger_s` for more, so that one reply carries
        a window's tokens (as vLLM's stream interval does). (tokens, whether the
        output is complete.) Raises the engine's error once every token before it was
        read; KeyError when the journal does not hold the submission."""
        entry = self.entries[request_id]
        entry.num_polling += 1
        try:
            position = bisect.bisect_left(entry.events, from_index, key=_output_index)
            while position == len(entry.events) and not entry.ended:
                await entry.changed.wait()
            if linger_s > 0 and not entry.ended:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(linger_s):
                        while not entry.ended:
                            await entry.changed.wait()
            batch = entry.events[position:]
            failed = entry.error is not None and not entry.aborted
            if failed and not batch:
                raise entry.error
            return batch, entry.ended and not failed
        finally:
            entry.num_polling -= 1
            entry.polled_s = self.clock()

    async def read(self, request_id: str, from_index: int, linger_s: float = 0.0
                   ) -> AsyncIterator[list[TokenEvent]]:
        """The submission's tokens from `from_index` on, as they come (`follow` over
        `poll`)."""
        async def poll(index: int, linger: bool) -> tuple[list[TokenEvent], bool]:
            return await self.poll(request_id, index, linger_s if linger else 0.0)

        async for batch in follow(poll, from_index):
            yield batch

    def _check_detached_later(self, entry: JournalEntry, delay_s: float) -> None:
        asyncio.get_event_loop().call_later(delay_s, self._abort_if_detached, entry)

    def _abort_if_detached(self, entry: JournalEntry) -> None:
        """Abort a running submission nobody polled for `detached_grace_s`; otherwise
        look again when that could first be so."""
        if entry.ended:
            return
        unread_s = self.clock() - entry.polled_s
        if entry.num_polling or unread_s < self.detached_grace_s:
            self._check_detached_later(entry, self.detached_grace_s - unread_s
                                       if not entry.num_polling else self.detached_grace_s)
            return
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


Poll = Callable[[int, bool], Awaitable[tuple[list[TokenEvent], bool]]]


async def follow(poll: Poll, from_index: int) -> AsyncIterator[list[TokenEvent]]:
    """A submission's tokens from output index `from_index` on, by polling: the first
    batch as soon as it is there, each later one lingering for a window's tokens.
    `poll(index, linger)` is `OutputJournal.poll` of one submission, in this process or
    an engine actor's."""
    index, linger = from_index, False
    while True:
        batch, complete = await poll(index, linger)
        if batch:
            index = batch[-1].index + 1
            yield batch
        if complete:
            return
        linger = True


def _output_index(event: TokenEvent) -> int:
    return event.index


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
