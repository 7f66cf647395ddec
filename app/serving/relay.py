"""What an ingress in front of the router replicas does with a request it forwards, so
that a replica's death is retried on another replica without the client noticing.

The ingress names every request (the client's id, else one it makes) and asks for SSE
ids on a stream, whatever the client asked: a retry then carries the same id, and a
stream's retry carries `Last-Event-ID`, so the replica that takes it re-attaches the
request where its engine runs it and sends only the events the client lacks (see
app/serving/replies.py). The ids go on to the client only if it asked for them itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from app.serving.replies import EVENT_STREAM, FRESH_ID_HEADER, REQUEST_ID_HEADERS, resumable

RELAY_ID_PREFIX = "relay-"


@dataclass(frozen=True)
class Forwarded:
    """A request as the ingress forwards it: the headers each try sends (lower-case
    names), and whether the client reads SSE ids itself."""

    headers: dict[str, str]
    client_reads_ids: bool
    minted: bool  # the ingress made the request's id: its first try is surely new

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> Forwarded:
        lower = {name.lower(): value for name, value in headers.items()}
        named = next((lower[h] for h in REQUEST_ID_HEADERS if h in lower), None)
        client_reads_ids = resumable(named, lower)
        lower.pop(FRESH_ID_HEADER, None)  # only the ingress says so
        if named is None:
            lower["x-request-id"] = RELAY_ID_PREFIX + uuid.uuid4().hex
        accept = lower.get("accept", "")
        if EVENT_STREAM not in accept:
            lower["accept"] = f"{accept}, {EVENT_STREAM}" if accept else EVENT_STREAM
        return cls(lower, client_reads_ids, minted=named is None)

    def first(self) -> dict[str, str]:
        """The headers of the first try: an id the ingress made needs no look-up."""
        return self.headers | {FRESH_ID_HEADER: "1"} if self.minted else dict(self.headers)

    def retry(self, last_event_id: int | None) -> dict[str, str]:
        """The headers of a try after one that broke with `last_event_id` tokens sent
        (None: before the first event reached the client)."""
        if last_event_id is None:
            return dict(self.headers)
        return self.headers | {"last-event-id": str(last_event_id)}


@dataclass
class StreamCursor:
    """The SSE events relayed to the client so far: the token count the last one ended
    at (`Last-Event-ID` of a retry), with id lines dropped for a client that did not
    ask for them."""

    keep_ids: bool
    last_event_id: int | None = None
    started: bool = False  # an event reached the client: a retry must not repeat it

    def relay(self, text: str) -> str:
        """One event's text as the client gets it; notes its id."""
        self.started = True
        lines = text.split("\n")
        for line in lines:
            if line.startswith("id: "):
                self.last_event_id = int(line.removeprefix("id: "))
        if self.keep_ids:
            return text
        return "\n".join(line for line in lines if not line.startswith("id: "))

    def resume_from(self) -> int | None:
        """`Last-Event-ID` for the next try: the last id relayed, or 0 tokens when only
        events without a token (a chat's role) reached the client."""
        if self.last_event_id is None and self.started:
            return 0
        return self.last_event_id


@dataclass(frozen=True)
class RelayHead:
    """The first part of a router replica's answer to a forwarded request: the reply's
    status and headers, and whether SSE events or one JSON body follow."""

    status_code: int
    headers: dict[str, str]
    streamed: bool


def retry_backoff_s(attempt: int) -> float:
    """The wait before try `attempt + 1`: Serve needs a moment to see a replica dead."""
    return min(0.1 * 2**attempt, 2.0)
