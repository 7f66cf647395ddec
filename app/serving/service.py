"""The OpenAI-compatible service: HTTP-free request handling around `LiveRouter`.

The Serve deployment maps each endpoint onto one method here and wraps the result
in a JSON or streaming response; everything between (validation, tokenizing,
routing, detokenizing, error mapping) lives here, so it is the same code with any
transport.
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
from app.engines.messages import SamplingSpec, StructuredOutput, TokenEvent
from app.routing.base import RejectCode
from app.routing.registry import RoutingOptions, build_routing
from app.routing.view import RouteRequest
from app.serving.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    MigrateRequest,
    RequestSummary,
    ResponseMeta,
    StreamOptions,
    error_body,
    invalid_request,
    parse_body,
    sse,
    usage,
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
from app.serving.logprobs import LogprobsFormatter
from app.serving.replies import (
    FRESH_ID_HEADER,
    ReplyLog,
    ReplyStore,
    body_digest,
    client_request_id,
    last_event_id,
    named_session,
    request_headers,
    resumable,
)
from app.serving.telemetry import MetricFactory, NullFactory, RouterMetrics
from app.serving.tokenizer import HfTokenizer, OutputText, Tokenizer, WordHashTokenizer
from app.serving.tools import ToolCallReader, ToolParsing, tool_call_reader

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


Event = tuple[int | None, str]  # (output tokens sent up to it, None: no token; SSE text)


@dataclass
class ChoiceStream:
    """One choice of a streamed reply: how far it was sent, how its output is shown."""

    index: int
    flight: Flight
    reader: ToolCallReader | None  # reads tool calls out of the text; None: plain text
    formatter: LogprobsFormatter | None  # None: no logprobs asked for
    num_sent: int = 0  # output tokens already sent

    def skip_seen(self) -> None:
        """A re-attached choice: the output it already holds is the client's (sent
        before its reconnect); the next chunk starts after it."""
        output = self.flight.output
        if not output.token_ids:
            return
        assert isinstance(output.text, OutputText)
        self.num_sent = len(output.token_ids)
        text = output.text.delta(False)
        if self.reader is not None:
            self.reader.delta(text, output.token_ids, False)

    def chunk(self, meta: ResponseMeta, batch_finished: bool) -> dict[str, Any] | None:
        """The chunk for the tokens since the last one (None: nothing to show yet)."""
        output = self.flight.output
        assert isinstance(output.text, OutputText)
        final = output.finish_reason is not None and batch_finished
        start, self.num_sent = self.num_sent, len(output.token_ids)
        text = output.text.delta(final)
        logprobs = None if self.formatter is None else self.formatter.format(
            output.token_ids[start:], output.logprobs[start:])
        finish_reason = output.finish_reason if final else None
        delta = None
        if self.reader is not None:
            delta = self.reader.delta(text, output.token_ids[start:], final)
            if delta is None and not final and logprobs is None:
                return None  # e.g. a call's name still incomplete
            delta = delta or {}
            if finish_reason is not None:
                finish_reason = self.reader.finish_reason(finish_reason, streamed=True)
        return meta.chunk(self.index, text, finish_reason, output.stop_reason, logprobs, delta)


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
        self.engines = backend_class(config.engine_template.backend)  # asked what it can do
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
        self.tool_parsing = tool_parsing(config, self.tokenizer)
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
            body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
            digest = body_digest(raw)
            if client_id is not None and (log := self.replies.get(client_id)) is not None:
                return await self._again(log, digest, after)
            request_id = client_id or f"{next(self._ids)}-{uuid.uuid4().hex[:12]}"
            log = self.replies.open(request_id, body.stream, digest)
        except ApiError as exc:
            return JsonReply(exc.status_code, exc.body())
        named = request_headers(request_id)
        try:
            session = body.session_id or named_session(
                headers, self.config.session_headers, self.config.session_cookies)
            requests = self._generation_requests(body, chat, received, request_id, session)
            readers = self._tool_readers(body, requests, chat)
            flights = await self._submit_all(
                requests, body, readers, after=after, looked_up=looked_up,
                look_up=client_id is not None and FRESH_ID_HEADER not in headers)
        except ApiError as exc:
            refused = JsonReply(exc.status_code, exc.body(), named)
            if body.stream:
                log.append(None, sse(exc.body()))
                log.append(None, sse("[DONE]"))
            self.replies.discard(log, refused)
            return refused
        meta = ResponseMeta.new(f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                                body.model, chat)
        if body.stream:
            events = self._stream(flights, readers, meta, body.stream_options or StreamOptions(),
                                  resumed=after is not None,
                                  event_ids=resumable(client_id, headers))
            self.replies.produce(log, asyncio.create_task(self._record_stream(log, events)))
            return StreamReply(self.replies.follow(log, after), named)
        self.replies.produce(log, asyncio.create_task(
            self._record_whole(log, self._collect(flights, readers, meta), named)))
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
            log.append(None, sse(error_body(f"{type(exc).__name__}: {exc}", "server_error")))
            log.append(None, sse("[DONE]"))
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
    def _generation_requests(self, body: Any, chat: bool, received_perf_s: float,
                             request_id: str, session_id: str | None
                             ) -> list[GenerationRequest]:
        """One request per choice (`n`); choice i of response `cmpl-<id>` is request
        `<id>` when n = 1, else `<id>.<i>` (its seed, when given, seed + i, as
        vLLM's). `session_id`: the body's, else the one its headers name."""
        if body.model not in self.config.served_model_names:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.served_model_names[0]!r}", "not_found_error",
                           "model")
        if chat:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            text = self.tokenizer.render_chat(body.messages, tools)
            token_ids = self.tokenizer.encode(text)
        elif isinstance(body.prompt, str):
            text, token_ids = body.prompt, self.tokenizer.encode(body.prompt)
        else:
            text, token_ids = None, list(body.prompt)
        if not token_ids:
            raise invalid_request("prompt has no tokens", "prompt")
        vocab = self.config.engine_template.instance.model.vocab_size
        for field_name, ids in (("prompt", token_ids), ("stop_token_ids", body.stop_token_ids),
                                ("logit_bias", [int(t) for t in body.logit_bias])):
            if ids and max(ids) >= vocab:
                raise invalid_request(f"{field_name}: token ids must be < {vocab}", field_name)
        budget = body.output_budget
        limit = self.config.engine_template.max_model_len
        if len(token_ids) + budget > limit:
            raise invalid_request(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({budget}) exceeds "
                f"the model context of {limit} tokens", "max_tokens")
        if chat and body.may_call_tools and self.tool_parsing is None:
            raise invalid_request(
                "tool_choice: 'auto' (the default with tools) needs the model family's tool "
                "parser, which this server is not configured with (tool_call_parser); use "
                "'required', a named function or 'none'", "tool_choice")
        structured = body.structured
        constrained_by = "tools" if chat and body.calls_tools else "response_format"
        capabilities = self.engines.CAPABILITIES
        if body.num_top_logprobs is not None and not capabilities.logprobs:
            raise invalid_request(f"logprobs: {capabilities.kind} engines compute no token "
                                  "probabilities", "logprobs")
        if structured is not None:
            if not capabilities.structured_outputs:
                raise invalid_request(f"{constrained_by}: {capabilities.kind} engines "
                                      "generate no text to constrain", constrained_by)
            error = self.engines.constraint_error(structured)
            if error is not None:
                raise invalid_request(f"{constrained_by}: {error}", constrained_by)
        sampling = self._sampling(body, structured)
        arrival_s = self.router.clock()
        requests = []
        for index in range(body.n):
            seed = None if body.seed is None else body.seed + index
            requests.append(GenerationRequest(
                request_id=request_id if body.n == 1 else f"{request_id}.{index}",
                prompt_token_ids=tuple(token_ids),
                sampling=replace(sampling, seed=seed),
                arrival_s=arrival_s,
                slo_s=body.slo_s if body.slo_s is not None else self.config.default_slo_s,
                prompt_text=text,
                task=body.task,
                streamed=body.stream,
                session_id=session_id,
                step_index=body.step_index,
                received_perf_s=received_perf_s,
            ))
        return requests

    @staticmethod
    def _sampling(body: Any, structured: StructuredOutput | None) -> SamplingSpec:
        """The engines' sampling parameters (unset ones take OpenAI's / vLLM's defaults)."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingSpec(
            max_tokens=body.output_budget,
            temperature=given(body.temperature, 1.0),
            top_p=given(body.top_p, 1.0),
            top_k=max(given(body.top_k, 0), 0),
            min_p=given(body.min_p, 0.0),
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0),
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
            logit_bias=tuple((int(t), v) for t, v in body.logit_bias.items()),
            logprobs=body.num_top_logprobs,
            structured=structured,
        )

    def _tool_readers(self, body: Any, requests: list[GenerationRequest],
                      chat: bool) -> list[ToolCallReader | None]:
        """A tool-call reader per choice (None where the reply cannot call tools)."""
        if not chat:
            return [None] * len(requests)
        return [tool_call_reader(body, self.tool_parsing, r.prompt_token_ids)
                for r in requests]

    async def _submit_all(self, requests: list[GenerationRequest], body: Any,
                          readers: list[ToolCallReader | None], look_up: bool = False,
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
            for request, reader in zip(requests, readers, strict=True):
                skip_special = (body.skip_special_tokens if reader is None
                                or reader.skip_special_tokens is None
                                else reader.skip_special_tokens)
                text = OutputText(self.tokenizer, body.stop, body.stop_token_ids,
                                  body.include_stop_str_in_output, request.sampling.min_tokens,
                                  skip_special)
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
                if after and len(requests) > 1:
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

    def _summary(self, flight: Flight) -> RequestSummary:
        finish_s = flight.output.finish_s
        end = finish_s if finish_s is not None else self.router.clock()
        first_token_s = flight.output.first_token_s
        kv = flight.kv
        return RequestSummary(
            instance_ids=tuple(flight.placement.instance_ids),
            prefill_instance=flight.placement.prefill_instance_id,
            kv_transfer_s=None if kv is None else kv.transfer_s,
            kv_loaded_tokens=0 if kv is None else kv.loaded_tokens,
            moves=tuple(m.as_dict() for m in flight.placement.moves),
            num_migrations=flight.placement.num_migrations,
            slo_s=flight.request.slo_s,
            e2e_s=end - flight.request.arrival_s,
            ttft_s=(None if first_token_s is None
                    else first_token_s - flight.request.arrival_s),
            predicted_output_tokens=flight.route.predicted_output_tokens,
        )

    def _logprobs(self, flight: Flight, chat: bool) -> dict[str, Any] | None:
        """The whole output's logprobs, when asked for."""
        formatter = self._formatter(flight, chat)
        if formatter is None:
            return None
        return formatter.format(flight.output.token_ids, flight.output.logprobs)

    def _formatter(self, flight: Flight, chat: bool) -> LogprobsFormatter | None:
        wanted = flight.request.sampling.logprobs is not None
        return LogprobsFormatter(self.tokenizer, chat) if wanted else None

    def _usage(self, flights: Sequence[Flight]) -> dict[str, Any]:
        """The prompt counted once (as vLLM does for n > 1), every choice's output."""
        return usage(len(flights[0].request.prompt_token_ids),
                     sum(len(f.output.token_ids) for f in flights),
                     flights[0].output.num_cached_tokens)

    async def _collect(self, flights: list[Flight], readers: list[ToolCallReader | None],
                       meta: ResponseMeta) -> JsonReply:
        async def drain(flight: Flight) -> None:
            async for _ in self.router.stream(flight):
                pass

        results = await asyncio.gather(*(drain(f) for f in flights), return_exceptions=True)
        for result in results:
            if isinstance(result, EngineLost):
                return JsonReply(502, error_body(str(result), "engine_error"))
            if isinstance(result, BaseException):
                raise result
        choices = []
        for index, (flight, reader) in enumerate(zip(flights, readers, strict=True)):
            output = flight.output
            assert isinstance(output.text, OutputText)
            text, tool_calls = output.text.text, None
            finish_reason = output.finish_reason or "stop"
            if reader is not None:
                reply = reader.read(text, output.token_ids)
                text, tool_calls = reply.content, reply.tool_calls
                finish_reason = reader.finish_reason(finish_reason, streamed=False)
            choices.append(meta.choice(
                index, text, finish_reason, output.stop_reason,
                self._logprobs(flight, meta.chat), tool_calls))
        self._tell_final_answers(flights, readers)
        return JsonReply(200, meta.full(choices, self._usage(flights),
                                        [self._summary(f) for f in flights]))

    def _tell_final_answers(self, flights: list[Flight],
                            readers: list[ToolCallReader | None]) -> None:
        """An agent step whose reply could call a tool and did not is its session's final
        answer: the router tells the controller, which stops counting the session open."""
        for flight, reader in zip(flights, readers, strict=True):
            if reader is not None and not reader.called and flight.route.session_id:
                self.router.session_answered(flight.route.session_id)

    async def _stream(self, flights: list[Flight], readers: list[ToolCallReader | None],
                      meta: ResponseMeta, options: StreamOptions, resumed: bool = False,
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
        choices = [ChoiceStream(i, flight, reader, self._formatter(flight, meta.chat))
                   for i, (flight, reader) in enumerate(zip(flights, readers, strict=True))]
        for choice in choices:
            choice.skip_seen()
        num_prompt_tokens = len(flights[0].request.prompt_token_ids)

        def with_usage(chunk: dict[str, Any], num_output_tokens: int) -> dict[str, Any]:
            """`chunk`, with its choice's usage so far when asked for (vLLM's
            `continuous_usage_stats`)."""
            if options.include_usage and options.continuous_usage_stats:
                chunk["usage"] = usage(num_prompt_tokens, num_output_tokens,
                                       flights[0].output.num_cached_tokens)
            return chunk

        try:
            if meta.chat and not resumed:
                for index in range(len(flights)):
                    yield None, sse(with_usage(meta.opening_chunk(index), 0))
            num_open = len(flights)
            while num_open:
                index, item = await queue.get()
                if item is None:
                    num_open -= 1
                    continue
                if isinstance(item, EngineLost):
                    yield None, sse(error_body(str(item), "engine_error"))
                    yield None, sse("[DONE]")
                    return
                if isinstance(item, BaseException):
                    raise item
                chunk = choices[index].chunk(meta, item[-1].finished)
                shown[index].set()
                if chunk is not None:
                    offset = sum(c.num_sent for c in choices)
                    yield offset, sse(with_usage(chunk, choices[index].num_sent),
                                      offset if event_ids else None)
            self._tell_final_answers(flights, readers)
            yield None, sse(meta.last_chunk(
                self._usage(flights) if options.include_usage else None,
                [self._summary(f) for f in flights]))
            yield None, sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()
