"""The OpenAI-compatible service: HTTP-free request handling around `LiveRouter`.

The Serve deployment maps each endpoint onto one method here and wraps the result
in a JSON or streaming response; everything between lives here or below, so it is
the same code with any transport: the request read (`request_reading`), routed and
answered once (reply logs by id, re-attach), the reply written (`reply_writing`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from app.engines.config import KvConnectorKind
from app.engines.factory import backend_class
from app.engines.messages import TokenEvent
from app.routing.base import RejectCode
from app.routing.registry import RoutingOptions, build_routing
from app.routing.view import RouteRequest
from app.serving.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    MigrateRequest,
    OpenAiRequest,
    StreamOptions,
    error_body,
    parse_body,
)
from app.serving.auth import Access, ApiKeys, RateLimiter
from app.serving.config import ServeConfig
from app.serving.flight import Flight, GenerationRequest
from app.serving.instances import EngineClient
from app.serving.kv_transfer import ConnectorTransport, KvTransport, SimulatedLink
from app.serving.live_router import (
    EngineLost,
    EngineUnanswered,
    Found,
    LiveRouter,
    Predict,
    RequestRejected,
    StatusFeed,
)
from app.serving.replies import (
    FRESH_ID_HEADER,
    ReplyLog,
    ReplyStore,
    body_digest,
    client_request_id,
    last_event_id,
    request_headers,
    resumable,
)
from app.serving.reply_writing import (
    Event,
    ReplyWriter,
    ResponseMeta,
    StreamWriter,
    stream_error,
)
from app.serving.request_reading import ReadRequest, RequestReader
from app.serving.telemetry import MetricFactory, NullFactory, RouterMetrics
from app.serving.tokenizer import HfTokenizer, OutputText, Tokenizer, WordHashTokenizer
from app.serving.tools import ToolParsing

if TYPE_CHECKING:
    from predictor.base import Predictor

logger = logging.getLogger(__name__)


def make_tokenizer(config: ServeConfig) -> Tokenizer:
    """The served model's tokenizer; word hashing for simulated engines that name none."""
    engine = config.engine_template
    path = config.tokenizer_path or engine.model_path or engine.tokenizer_path
    if path is not None:
        return HfTokenizer(path)
    if config.engine_capabilities.text:
        raise ValueError("tokenizer_path is required for engines without a local model_path")
    return WordHashTokenizer(config.engine_template.instance.model.vocab_size)


def load_length_predictor(config: ServeConfig) -> Predictor | None:
    """The trained predictor the config names; None = running history of finished lengths."""
    if config.routing.predictor_dir is None:
        return None
    from predictor.registry import load_predictor

    return load_predictor(config.routing.predictor_dir, config.routing.predictor_name)


def make_predict(predictor: Predictor | None) -> tuple[Predict | None, Callable[[], None]]:
    """The router's arrival-time length prediction, micro-batched across concurrent
    requests (GPU when the predictor has one), and the function that stops it."""
    if predictor is None:
        return None, lambda: None
    from predictor.base import PredictionInput
    from predictor.batching import PredictionBatcher, use_one_inference_thread

    use_one_inference_thread()
    batcher = PredictionBatcher(predictor)

    async def predict(route: RouteRequest) -> float:
        return await batcher.predict_async(PredictionInput(route.prompt or "", task=route.task))

    return predict, batcher.close


def routing_options(config: ServeConfig, predictor: Predictor | None) -> RoutingOptions:
    """The registry's options; the watchdog re-predicts with the same predictor object."""
    factory = None
    if predictor is not None:
        from app.routing.length import PredictorLength

        factory = lambda: PredictorLength(predictor)  # noqa: E731
    return config.routing.routing_options(factory)


def drop(task: asyncio.Future) -> None:
    """A task whose outcome nobody needs: cancelled, or when done its exception read, so
    that none is logged as lost."""
    if not task.cancel() and not task.cancelled():
        task.exception()


@dataclass(frozen=True)
class JsonReply:
    status_code: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamReply:
    """A streamed reply: its SSE lines and the response headers."""

    events: AsyncIterator[str]
    headers: Mapping[str, str] = field(default_factory=dict)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events


def tool_parsing(config: ServeConfig, tokenizer: Tokenizer) -> ToolParsing | None:
    """The model family's tool parser the config names (ValueError when it cannot run)."""
    if config.tool_call_parser is None:
        return None
    return ToolParsing(config.tool_call_parser, tokenizer.backend)


def api_keys(config: ServeConfig) -> ApiKeys:
    """The configured keys (environment and the config's files) with the rate limit."""
    auth = config.auth
    limiter = (None if auth.rate_limit_rps is None
               else RateLimiter(auth.rate_limit_rps, auth.rate_limit_burst))
    return ApiKeys.load(auth.keys_file, auth.admin_keys_file, limiter=limiter)


def kv_transport(config: ServeConfig) -> KvTransport | None:
    """How prompts' KV moves between the pools, and for unified vLLM engines with the
    example connector, the store a move can load a prompt's KV from (None: unified
    engines move by token ids)."""
    engine, gbps = config.engine_template, config.cluster.kv_link_gbps
    connector = engine.kv_connector
    if config.cluster.mode == "disaggregated":
        return (SimulatedLink(gbps, engine.time_scale) if connector is None
                else ConnectorTransport(connector, gbps))
    if connector is None or connector.kind != KvConnectorKind.EXAMPLE:
        return None
    return ConnectorTransport(connector, gbps)


class CompletionService:
    """Validates, routes and answers OpenAI completion and chat requests."""

    def __init__(
        self,
        config: ServeConfig,
        clients: Sequence[EngineClient],
        tokenizer: Tokenizer | None = None,
        companion: Callable[[LiveRouter], Awaitable[None]] | None = None,
        metrics: MetricFactory | None = None,
        status_feed: StatusFeed | None = None,
    ) -> None:
        """`companion` runs beside the router from its start until `close` (the Serve
        shell follows the controller's registry with it); `metrics` makes the
        router's instruments (Ray's in the Serve shell; none by default);
        `status_feed` gives the engines' published reports (None: the router polls
        each engine)."""
        self.config = config
        self.tokenizer = tokenizer or make_tokenizer(config)
        predictor = load_length_predictor(config)
        predict, self._close_predictor = make_predict(predictor)
        stack = build_routing(config.routing.policy, routing_options(config, predictor))
        self.router = LiveRouter(clients, stack, predict=predict,
                                 poll_interval_s=config.poll_interval_s,
                                 kv_transport=kv_transport(config),
                                 move_rule=config.cluster.move_path,
                                 request_priority=config.cluster.request_priority,
                                 status_feed=status_feed,
                                 metrics=RouterMetrics(metrics or NullFactory(),
                                                       config.routing.policy))
        self.keys = api_keys(config)
        self.reader = RequestReader(config, self.tokenizer,
                                    backend_class(config.engine_template.backend),
                                    tool_parsing(config, self.tokenizer), self.router.clock)
        self.closing = False  # shutting down: new requests get a 503, those in flight finish
        self.replies = ReplyStore(retain_s=config.reply_retain_s,
                                  max_retained=config.max_retained_replies,
                                  grace_s=config.unread_grace_s)
        self._ids = itertools.count()
        self._start_lock = asyncio.Lock()
        self._started = False
        self._companion = companion
        self._companion_task: asyncio.Task | None = None

    async def start(self) -> None:
        async with self._start_lock:
            if not self._started:
                await self.router.start()
                if self._companion is not None:
                    self._companion_task = asyncio.ensure_future(self._companion(self.router))
                self._started = True

    def close(self) -> None:
        self.router.close()
        if self._companion_task is not None:
            self._companion_task.cancel()
        self._close_predictor()

    # ---- endpoints -------------------------------------------------------------------
    def check_size(self, num_bytes: int) -> None:
        """A body over `max_request_bytes` is refused before it is parsed."""
        limit = self.config.max_request_bytes
        if num_bytes > limit:
            raise ApiError(413, f"request body of {num_bytes} bytes exceeds the limit of "
                           f"{limit} bytes", "invalid_request_error")

    def too_large(self, content_length: str | None) -> JsonReply | None:
        """The 413 for a declared `Content-Length` over the limit (the body unread)."""
        try:
            self.check_size(int(content_length or 0))
        except ApiError as exc:
            return JsonReply(exc.status_code, exc.body())
        except ValueError:
            return JsonReply(400, error_body("Content-Length is not a number",
                                             "invalid_request_error"))
        return None

    def authorize(self, authorization: str | None, access: Access) -> JsonReply | None:
        """None when the request's `Authorization` header lets it in; else the reply."""
        denied = self.keys.check(authorization, access, time.monotonic())
        if denied is None:
            return None
        return JsonReply(denied.status_code, error_body(denied.message, denied.error_type),
                         denied.headers)

    async def complete(self, raw: bytes | Callable[[], Awaitable[bytes]], chat: bool,
                       received_perf_s: float | None = None,
                       headers: Mapping[str, str] | None = None
                       ) -> JsonReply | StreamReply:
        """A full JSON reply, or the SSE lines of a streamed one. `raw`: the body, or
        how to read it (HTTP), read once the engines are being asked about a
        client-named request (`_look_up_early`). `received_perf_s`: the request's
        arrival (`time.perf_counter()`; default now), where its arrival-to-placement
        time starts, so reading, parsing and tokenizing count in it. `headers`
        (lower-case names) may carry the request's id (`X-Request-Id`,
        `Idempotency-Key`) and a reconnecting stream's `Last-Event-ID`: a request whose
        id runs or ran lately is answered from it, never run twice."""
        received = time.perf_counter() if received_perf_s is None else received_perf_s
        headers = headers or {}
        looked_up: dict[str, asyncio.Task[Found | None]] = {}
        try:
            return await self._complete(raw, chat, received, headers, looked_up)
        finally:
            for task in looked_up.values():  # a look-up nobody took (an error, n > 1)
                drop(task)

    async def _complete(self, raw: bytes | Callable[[], Awaitable[bytes]], chat: bool,
                        received: float, headers: Mapping[str, str],
                        looked_up: dict[str, asyncio.Task[Found | None]]
                        ) -> JsonReply | StreamReply:
        """`complete`; `looked_up` holds the look-ups started and not yet taken."""
        try:
            await self.start()
            if self.closing:
                raise ApiError(503, "the server is shutting down; retry on another",
                               "service_unavailable")
            if not isinstance(raw, bytes):
                looked_up.update(self._look_up_early(headers))
                raw = await raw()
            self.check_size(len(raw))
            client_id = client_request_id(headers)
            after = last_event_id(headers)
            body: OpenAiRequest = parse_body(
                raw, ChatCompletionRequest if chat else CompletionRequest)
            digest = body_digest(raw)
            if client_id is not None and (log := self.replies.get(client_id)) is not None:
                return await self._again(log, digest, after)
            request_id = client_id or f"{next(self._ids)}-{uuid.uuid4().hex[:12]}"
            log = self.replies.open(request_id, body.stream, digest)
        except ApiError as exc:
            return JsonReply(exc.status_code, exc.body())
        named = request_headers(request_id)
        try:
            read = self.reader.read(body, headers, received, request_id)
            flights = await self._submit_all(
                read, after=after, looked_up=looked_up,
                look_up=client_id is not None and FRESH_ID_HEADER not in headers)
        except ApiError as exc:
            refused = JsonReply(exc.status_code, exc.body(), named)
            if body.stream:
                for offset, text in stream_error(exc.body()):
                    log.append(offset, text)
            self.replies.discard(log, refused)
            return refused
        meta = ResponseMeta.new(f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                                body.model, chat)
        writer = ReplyWriter(meta, flights, read.readers, self.tokenizer, self.router.clock)
        if body.stream:
            events = self._stream(writer, body.stream_options or StreamOptions(),
                                  resumed=after is not None,
                                  event_ids=resumable(client_id, headers))
            self.replies.produce(log, asyncio.create_task(self._record_stream(log, events)))
            return StreamReply(self.replies.follow(log, after), named)
        self.replies.produce(log, asyncio.create_task(
            self._record_whole(log, self._collect(writer), named)))
        return await self.replies.whole(log)

    def _look_up_early(self, headers: Mapping[str, str]
                       ) -> dict[str, asyncio.Task[Found | None]]:
        """The engines asked, from the headers alone, whether they run the request the
        client names (another replica may have started it), so that the answer comes
        while the body is read, parsed, tokenized and predicted rather than after: by
        its id, which is its one choice's. None asked where no look-up is due (no id or
        an invalid one, which is refused later; an id the ingress made; one this replica
        holds a reply for)."""
        if FRESH_ID_HEADER in headers:
            return {}
        try:
            client_id = client_request_id(headers)
        except ApiError:
            return {}
        if client_id is None or self.replies.get(client_id) is not None:
            return {}
        return {client_id: asyncio.ensure_future(self.router.find(client_id))}

    async def _again(self, log: ReplyLog, digest: str, after: int | None
                     ) -> JsonReply | StreamReply:
        """A request whose id has a reply here (running, or kept after its end); the
        same id on another body is a 409."""
        if log.digest != digest:
            raise ApiError(409, f"request id {log.request_id} is in use by another request",
                           "conflict", "x-request-id")
        if log.streamed:
            return StreamReply(self.replies.follow(log, after), request_headers(log.request_id))
        return await self.replies.whole(log)

    @staticmethod
    async def _record_stream(log: ReplyLog, events: AsyncIterator[Event]) -> None:
        try:
            async for offset, text in events:
                log.append(offset, text)
        except Exception as exc:  # a bug: the client gets an error, not a hang
            logger.exception("stream of request %s failed", log.request_id)
            for offset, text in stream_error(
                    error_body(f"{type(exc).__name__}: {exc}", "server_error")):
                log.append(offset, text)
        finally:
            log.end()

    @staticmethod
    async def _record_whole(log: ReplyLog, reply: Awaitable[JsonReply],
                            headers: Mapping[str, str]) -> None:
        try:
            made = await reply
            log.end(replace(made, headers={**made.headers, **headers}))
        except Exception as exc:  # a bug: the client gets an error, not a hang
            logger.exception("request %s failed", log.request_id)
            log.end(JsonReply(500, error_body(f"{type(exc).__name__}: {exc}", "server_error"),
                              headers))

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "goodserve"}
            for name in self.config.served_model_names]}

    async def health(self) -> JsonReply:
        await self.start()
        healthy = [i for i, inst in self.router.instances.items() if inst.healthy]
        status = "closing" if self.closing else "ok" if healthy else "unavailable"
        return JsonReply(200 if status == "ok" else 503,
                         {"status": status, "healthy_instances": healthy})

    async def instances(self) -> dict[str, Any]:
        """Per-instance view the router routes on (ops and debugging)."""
        await self.start()
        now = self.router.clock()
        view = self.router.view(now)
        rows = []
        for iid, inst in self.router.instances.items():
            v = view.by_id.get(iid)
            rows.append({
                "instance_id": iid,
                "gpu_type": inst.spec.gpu.name,
                "tp": inst.spec.tp,
                "healthy": inst.healthy,
                "num_running": v.num_running if v else None,
                "num_waiting": v.num_waiting if v else None,
                "num_iterations": inst.status.num_iterations if inst.status else None,
            })
        return {"policy": self.config.routing.policy, "instances": rows,
                "counters": vars(self.router.counters())}

    async def migrate(self, raw: bytes) -> JsonReply:
        """Operator move of one request: {"request_id": ..., "target": optional id}
        (without a target the policy picks among the other instances)."""
        try:
            await self.start()
            move = parse_body(raw, MigrateRequest)
            request_id = move.request_id
            moved = self.router.migrate(request_id, move.target)
        except ApiError as exc:
            return JsonReply(exc.status_code, exc.body())
        except ValueError as exc:
            return JsonReply(400, error_body(str(exc), "invalid_request_error", "target"))
        if not moved:
            return JsonReply(404, error_body(
                f"request {request_id!r} is not in flight (or already moving, or still in "
                "its prefill stage)",
                "not_found_error", "request_id"))
        return JsonReply(200, {"request_id": request_id, "target": moved, "moving": True})

    # ---- helpers -----------------------------------------------------------------------
    async def _submit_all(self, read: ReadRequest, look_up: bool = False,
                          after: int | None = None,
                          looked_up: dict[str, asyncio.Task[Found | None]] | None = None
                          ) -> list[Flight]:
        """Route every choice; when one is refused, those already routed are dropped.
        With `look_up` (the client named the request) a choice an engine already runs
        for another replica is re-attached there, the client holding its first `after`
        tokens (a stream's `Last-Event-ID`); `looked_up` holds the engines' answers
        already asked for, by choice id (taken from it)."""
        looked_up = {} if looked_up is None else looked_up
        flights: list[Flight] = []
        try:
            for request, text in zip(read.requests, read.texts, strict=True):
                asked = looked_up.pop(request.request_id, None)
                if asked is None and look_up:
                    asked = self.router.find(request.request_id)
                if asked is None:
                    flights.append(await self._submit(request, text))
                    continue
                routing = asyncio.ensure_future(self.router.routed(request))
                found = await self._answer(asked, routing)
                if found is None:
                    flights.append(await self._submit(request, text, routing))
                    continue
                if after and len(read.requests) > 1:
                    raise ApiError(409, "a stream of several choices resumes only on the "
                                   "router replica that made it; send it again without "
                                   "Last-Event-ID for the whole stream", "conflict",
                                   "last-event-id")
                try:
                    flights.append(self.router.reattach(request, found, text, after or 0))
                except ValueError as exc:
                    raise ApiError(409, str(exc), "conflict", "x-request-id") from None
        except ApiError:
            for flight in flights:
                self.router.cancel(flight)
            raise
        return flights

    @staticmethod
    async def _answer(asked: Awaitable[Found | None],
                      routing: asyncio.Future[RouteRequest]) -> Found | None:
        """The engines' answer to a look-up, the request's routing (its prediction) made
        meanwhile; the routing is dropped where an engine holds the request or one did
        not answer."""
        try:
            found = await asked
        except BaseException as exc:
            drop(routing)
            if isinstance(exc, EngineUnanswered):
                raise ApiError(503, f"{exc}; retry with the same request id",
                               "service_unavailable") from None
            raise
        if found is not None:
            drop(routing)
        return found

    async def _submit(self, request: GenerationRequest, text: OutputText,
                      routing: Awaitable[RouteRequest] | None = None) -> Flight:
        """The request placed (`routing`: its route being made, else made here)."""
        try:
            if routing is None:
                return await self.router.submit(request, text)
            return self.router.place(request, await routing, text)
        except RequestRejected as exc:
            # a prompt no engine can hold is the client's to fix; the rest is load
            status = 400 if exc.code is RejectCode.CONTEXT_TOO_LONG else 503
            raise ApiError(status, f"request not admitted: {exc}", exc.code.value) from None

    async def _collect(self, writer: ReplyWriter) -> JsonReply:
        """The whole reply once every choice has finished (a 502 for an engine lost)."""
        async def drain(flight: Flight) -> None:
            async for _ in self.router.stream(flight):
                pass

        results = await asyncio.gather(*(drain(f) for f in writer.flights),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, EngineLost):
                return JsonReply(502, error_body(str(result), "engine_error"))
            if isinstance(result, BaseException):
                raise result
        reply = writer.whole()
        self._tell_final_answers(writer)
        return JsonReply(200, reply)

    def _tell_final_answers(self, writer: ReplyWriter) -> None:
        """An agent step whose reply could call a tool and did not is its session's final
        answer: the router tells the controller, which stops counting the session open."""
        for flight, reader in zip(writer.flights, writer.readers, strict=True):
            if reader is not None and not reader.called and flight.route.session_id:
                self.router.session_answered(flight.route.session_id)

    async def _stream(self, writer: ReplyWriter, options: StreamOptions, resumed: bool = False,
                      event_ids: bool = True) -> AsyncIterator[Event]:
        """Chunks of every choice as they come (interleaved, each with its index), then
        the closing chunk and `[DONE]`; an engine lost ends the stream with an error. A
        choice that may call tools sends what its reader makes of the text: nothing while
        a call's name is incomplete, then the call's deltas. Each chunk with tokens
        carries the output tokens sent up to it (its SSE id; written out with
        `event_ids`, `resumable`); a `resumed` stream (the client reconnected)
        starts after the tokens its flights already hold."""
        queue: asyncio.Queue[tuple[int, list[TokenEvent] | BaseException | None]] = (
            asyncio.Queue())
        flights = writer.flights

        # a choice's next tokens are taken only once its last ones are in a chunk: the
        # chunk is read off the output so far, which must not run ahead of its batch
        shown = [asyncio.Event() for _ in flights]

        async def pump(index: int, flight: Flight) -> None:
            try:
                async for batch in self.router.stream(flight, self.config.stream_chunk_tokens):
                    shown[index].clear()
                    queue.put_nowait((index, batch))
                    await shown[index].wait()
                queue.put_nowait((index, None))
            except Exception as exc:  # handed to the consumer
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, f)) for i, f in enumerate(flights)]
        chunks = StreamWriter(writer, options, resumed, event_ids)
        try:
            for event in chunks.opening():
                yield event
            num_open = len(flights)
            while num_open:
                index, item = await queue.get()
                if item is None:
                    num_open -= 1
                    continue
                if isinstance(item, EngineLost):
                    for event in stream_error(error_body(str(item), "engine_error")):
                        yield event
                    return
                if isinstance(item, BaseException):
                    raise item
                chunk = chunks.chunk(index, item[-1].finished)
                shown[index].set()
                if chunk is not None:
                    yield chunk
            self._tell_final_answers(writer)
            for event in chunks.closing():
                yield event
        finally:
            for task in tasks:
                task.cancel()
