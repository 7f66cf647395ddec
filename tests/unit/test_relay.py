"""What an ingress forwards and relays (app/serving/relay.py), and that it serves the
router's routes."""

from __future__ import annotations

import pytest

from app.serving.relay import (
    RELAY_ID_PREFIX,
    Forwarded,
    StreamCursor,
    retry_backoff_s,
)
from app.serving.replies import EVENT_STREAM, FRESH_ID_HEADER
from app.serving.reply_writing import sse

pytestmark = pytest.mark.unit


def test_an_unnamed_request_gets_an_id_that_every_try_carries_and_only_the_first_is_fresh():
    forwarded = Forwarded.of({"Content-Type": "application/json"})
    request_id = forwarded.headers["x-request-id"]
    assert request_id.startswith(RELAY_ID_PREFIX) and forwarded.minted
    assert not forwarded.client_reads_ids  # it never asked for SSE ids
    assert forwarded.headers["accept"] == EVENT_STREAM  # the ingress reads them itself
    first, again = forwarded.first(), forwarded.retry(None)
    assert first[FRESH_ID_HEADER] == "1" and first["x-request-id"] == request_id
    assert FRESH_ID_HEADER not in again and again["x-request-id"] == request_id
    assert forwarded.retry(7)["last-event-id"] == "7"
    assert Forwarded.of({}).headers["x-request-id"] != request_id


def test_a_client_s_own_id_is_kept_looked_up_on_every_try_and_never_called_fresh():
    forwarded = Forwarded.of({"X-Request-Id": "mine", "Accept": "application/json",
                              FRESH_ID_HEADER: "1", "Last-Event-ID": "3"})
    assert forwarded.headers["x-request-id"] == "mine" and not forwarded.minted
    assert FRESH_ID_HEADER not in forwarded.first()  # only the ingress may say so
    assert forwarded.headers["accept"] == f"application/json, {EVENT_STREAM}"
    assert not forwarded.client_reads_ids  # named, but it does not read event streams
    assert forwarded.retry(None)["last-event-id"] == "3"  # its own resume point
    assert forwarded.retry(9)["last-event-id"] == "9"  # after what this connection relayed
    reads = Forwarded.of({"Idempotency-Key": "k1", "Accept": EVENT_STREAM})
    assert reads.client_reads_ids and reads.headers["idempotency-key"] == "k1"


def test_the_cursor_relays_events_without_ids_unless_asked_and_resumes_after_the_last():
    events = [sse({"role": "assistant"}), sse({"text": "a"}, 1), sse({"text": "bc"}, 3),
              sse({"goodserve": {}}), sse("[DONE]")]
    plain = StreamCursor(keep_ids=False)
    assert plain.resume_from() is None  # nothing relayed: the whole stream again
    assert plain.relay(events[0]) == events[0]
    assert plain.resume_from() == 0  # the role went out: a retry must not repeat it
    assert plain.relay(events[1]) == sse({"text": "a"})
    assert plain.relay(events[2]) == sse({"text": "bc"})
    assert plain.resume_from() == 3
    plain.relay(events[3])
    assert plain.resume_from() == 3  # events without tokens carry no id
    kept = StreamCursor(keep_ids=True)
    assert [kept.relay(e) for e in events] == events and kept.resume_from() == 3


def test_retries_back_off_and_the_wait_is_bounded():
    waits = [retry_backoff_s(i) for i in range(8)]
    assert waits == sorted(waits) and waits[0] > 0 and waits[-1] == 2.0


def test_the_ingress_serves_every_route_the_router_serves():
    from deployments.http_api import Route, http_app
    from deployments.ingress import ingress_app
    from deployments.router import RouterDeployment  # noqa: F401  (adds http_app's routes)

    def routes(app) -> set[tuple[str, str]]:
        return {(r.path, method) for r in app.routes if r.path in set(Route)
                for method in getattr(r, "methods", ())}

    assert routes(ingress_app) == routes(http_app)
    assert {path for path, _ in routes(http_app)} == set(Route)
    assert ingress_app.openapi()["paths"].keys() == http_app.openapi()["paths"].keys()
