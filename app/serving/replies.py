"""Request ids and the replies a router replica keeps by id.

Every request has an id: the client's `X-Request-Id`, else its `Idempotency-Key`, else
one the router makes. A request whose id is one still running or recently finished on
this replica never runs again: a whole reply is given again, a stream resumes after the
client's `Last-Event-ID` (each SSE event's id is the count of output tokens sent up to
it). The reply's production is a task of its own, apart from the HTTP connection: a
client that disconnects can come back; when no client has read it for `grace_s` it is
cancelled (its engine submission is aborted, and stays a checkpoint in the engine's
journal). Ended replies are kept `retain_s`, at most `max_retained` of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from typing import Any

from app.engines.journal import Retention
from app.serving.api import invalid_request

REQUEST_ID_HEADERS = ("x-request-id", "idempotency-key")  # in order of precedence
EVENT_STREAM = "text/event-stream"
# an ingress's first try of an id it made: no engine can run it yet, so none is asked
FRESH_ID_HEADER = "x-goodserve-fresh-id"
MAX_REQUEST_ID_LEN = 128
# engine submissions append "@<n>", ":prefill" and choices ".<i>" to it: none inside
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]+")


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The id the client gave (None: none); a 400 for one too long or with other
    characters than letters, digits, '-' and '_'."""
    for name in REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        if not 0 < len(value) <= MAX_REQUEST_ID_LEN or not REQUEST_ID_PATTERN.fullmatch(value):
            raise invalid_request(
                f"{name}: a request id is 1 to {MAX_REQUEST_ID_LEN} letters, digits, '-' "
                "or '_'", name)
        return value
    return None


MAX_SESSION_ID_LEN = 200  # as the body's `session_id`


def named_session(headers: Mapping[str, str], header_names: Sequence[str],
                  cookie_names: Sequence[str]) -> str | None:
    """The agent session a request's headers name, as clients name it: the first of
    `header_names` present (AIPerf's X-Session-Affinity, SageMaker's
    X-Amzn-SageMaker-Session-Id, ...), else the first of `cookie_names` among its cookies
    (llm-d's); None: none. A 400 for a name that is empty or too long."""
    named = next(((name, headers[name]) for name in header_names if name in headers), None)
    if named is None and cookie_names and "cookie" in headers:
        jar = SimpleCookie()
        try:
            jar.load(headers["cookie"])
        except CookieError:
            jar = SimpleCookie()  # a cookie header we cannot read names no session
        named = next(((f"cookie {name}", jar[name].value) for name in cookie_names
                      if name in jar), None)
    if named is None:
        return None
    source, value = named
    if not 0 < len(value.strip()) <= MAX_SESSION_ID_LEN:
        raise invalid_request(f"{source}: a session id is 1 to {MAX_SESSION_ID_LEN} "
                              "characters", source)
    return value.strip()


def resumable(client_id: str | None, headers: Mapping[str, str]) -> bool:
    """Whether a stream's events carry SSE ids: for a client that named its request (only
    it can resume) and accepts `text/event-stream`, as EventSource does. Clients that
    read SSE by `data:` lines alone, vLLM's benchmark among them (it sends an
    `x-request-id` too), fail on an `id:` line."""
    return client_id is not None and EVENT_STREAM in headers.get("accept", "")


def last_event_id(headers: Mapping[str, str]) -> int | None:
    """The output tokens a reconnecting client has (`Last-Event-ID`); None: none."""
    value = headers.get("last-event-id")
    if value is None or value == "":
        return None
    if not value.isdigit() or len(value) > 12:
        raise invalid_request("last-event-id: a count of tokens", "last-event-id")
    return int(value)


@dataclass(eq=False)
class ReplyLog:
    """One request's reply while it is made and for a while after: the SSE events of a
    stream (each with the token offset it ends at, None for events that carry no
    token), or the whole JSON reply."""

    request_id: str
    streamed: bool
    digest: str = ""  # the request's body, hashed: a retry sends the same
    events: list[tuple[int | None, str]] = field(default_factory=list)
    reply: Any = None  # the whole reply (a JsonReply), once made
    done: bool = False
    num_readers: int = 0
    producer: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def append(self, offset: int | None, text: str) -> None:
        self.events.append((offset, text))
        self._notify()

    def end(self, reply: Any = None) -> None:
        self.reply, self.done = reply, True
        self._notify()

    def start_after(self, after: int | None) -> int:
        """The position of the first event a client holding `after` tokens lacks: the one
        after the last event with an id of at most `after` (None: from the start)."""
        if after is None:
            return 0
        start = 0
        for position, (offset, _) in enumerate(self.events):
            if offset is not None and offset <= after:
                start = position + 1
        return start

    async def read(self, after: int | None) -> AsyncIterator[str]:
        """The stream's events a client holding `after` tokens lacks, as they come."""
        position = self.start_after(after)
        while True:
            changed = self.changed
            if position < len(self.events):
                position += 1
                yield self.events[position - 1][1]
                continue
            if self.done:
                return
            await changed.wait()

    async def whole(self) -> Any:
        """The whole reply, once made."""
        while not self.done:
            await self.changed.wait()
        return self.reply


class ReplyStore:
    """The replies of one replica by request id: those being made, and ended ones for
    `retain_s` (at most `max_retained`, the oldest forgotten first)."""

    def __init__(self, *, retain_s: float, max_retained: int, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.logs: dict[str, ReplyLog] = {}
        self._ended = Retention(retain_s, max_retained, clock)

    def get(self, request_id: str) -> ReplyLog | None:
        self.sweep()
        return self.logs.get(request_id)

    def open(self, request_id: str, streamed: bool, digest: str = "") -> ReplyLog:
        """A new reply; ValueError when the id has one."""
        if self.get(request_id) is not None:
            raise ValueError(f"request id {request_id} has a reply")
        log = ReplyLog(request_id, streamed, digest)
        self.logs[request_id] = log
        return log

    def produce(self, log: ReplyLog, producer: asyncio.Task) -> None:
        """`producer` makes the reply; the log is kept `retain_s` after it ends. One
        cancelled (nobody read it) is forgotten: a retry takes the request up from what
        its engine kept."""
        log.producer = producer
        producer.add_done_callback(lambda task: self.ended(log, task.cancelled()))

    def ended(self, log: ReplyLog, cancelled: bool = False) -> None:
        if cancelled:
            self.discard(log, log.reply)
        elif self.logs.get(log.request_id) is log:
            self._ended.ended(log.request_id)
        self.sweep()

    def discard(self, log: ReplyLog, refused: Any) -> None:
        """A request refused before it ran: whoever waits on it gets `refused`, and the
        id is free again."""
        log.end(refused)
        if self.logs.get(log.request_id) is log:
            del self.logs[log.request_id]

    def sweep(self) -> None:
        for request_id in self._ended.expired():
            self.logs.pop(request_id, None)

    async def follow(self, log: ReplyLog, after: int | None) -> AsyncIterator[str]:
        """A client reading a stream (`ReplyLog.read`), counted while it reads."""
        with self._reading(log):
            async for text in log.read(after):
                yield text

    async def whole(self, log: ReplyLog) -> Any:
        """A client waiting for a whole reply, counted while it waits."""
        with self._reading(log):
            return await log.whole()

    @contextmanager
    def _reading(self, log: ReplyLog) -> Iterator[None]:
        """While a client reads: with none left, the reply is cancelled unless one comes
        back within `grace_s`."""
        log.num_readers += 1
        try:
            yield
        finally:
            log.num_readers -= 1
            if log.num_readers == 0 and not log.done:
                asyncio.get_running_loop().call_later(self.grace_s, self._cancel_unread, log)

    @staticmethod
    def _cancel_unread(log: ReplyLog) -> None:
        if log.num_readers == 0 and not log.done and log.producer is not None:
            log.producer.cancel()


def body_digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def request_headers(request_id: str) -> dict[str, str]:
    """The response headers that name the request."""
    return {"X-Request-Id": request_id}
