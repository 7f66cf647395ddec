"""Replies written from the flights of a request: the whole JSON reply, or a stream's
chunks as server-sent events, with OpenAI's usage and the `goodserve` summary.

Only what the client reads is decided here (text, tool calls, logprobs, finish
reasons, usage, where the request ran); when to write it (draining, pumping the
router's streams, keeping the reply by id) is the service's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.serving.api import StreamOptions
from app.serving.flight import Flight
from app.serving.logprobs import LogprobsFormatter
from app.serving.tokenizer import OutputText, Tokenizer
from app.serving.tools import ToolCallReader

Event = tuple[int | None, str]  # (output tokens sent up to it, None: no token; SSE text)


@dataclass(frozen=True)
class RequestSummary:
    """What the router reports about a finished request (the `goodserve` extension)."""

    instance_ids: tuple[str, ...]  # unified or decode instances, in visit order
    num_migrations: int
    slo_s: float | None
    e2e_s: float
    predicted_output_tokens: int | None
    ttft_s: float | None = None  # arrival to first token; None: no token came
    prefill_instance: str | None = None  # disaggregated: where the prompt was computed
    kv_transfer_s: float | None = None  # disaggregated: prefill -> decode KV transfer
    kv_loaded_tokens: int = 0  # prompt tokens whose KV the decode engine loaded
    # each move (migration or fail-over): target, reason, path (token-ids or kv), KV
    # bytes, estimated and measured time to the target's first token, tokens it loaded
    moves: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, flight: Flight, clock: Callable[[], float]) -> RequestSummary:
        """`flight`'s summary; a request not finished yet ends at `clock`'s now."""
        finish_s = flight.output.finish_s
        end = finish_s if finish_s is not None else clock()
        first_token_s = flight.output.first_token_s
        kv = flight.kv
        return cls(
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

    @property
    def met_deadline(self) -> bool | None:
        return None if self.slo_s is None else self.e2e_s <= self.slo_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance_ids": list(self.instance_ids),
            "num_migrations": self.num_migrations,
            "slo_s": self.slo_s,
            "e2e_s": round(self.e2e_s, 6),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "met_deadline": self.met_deadline,
            "predicted_output_tokens": self.predicted_output_tokens,
            "prefill_instance": self.prefill_instance,
            "decode_instance": self.instance_ids[-1] if self.prefill_instance else None,
            "kv_transfer_s": (None if self.kv_transfer_s is None
                              else round(self.kv_transfer_s, 6)),
            "kv_loaded_tokens": self.kv_loaded_tokens,
            "moves": list(self.moves),
        }


def goodserve_summary(summaries: Sequence[RequestSummary]) -> dict[str, Any]:
    body = summaries[0].as_dict()
    if len(summaries) > 1:
        body["choices"] = [s.as_dict() for s in summaries]
    return body


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the engine found cached (its prefix hit)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def sse(payload: dict[str, Any] | str, event_id: int | None = None) -> str:
    """One server-sent event; `event_id` (the output tokens sent up to it) is what a
    reconnecting client sends back as `Last-Event-ID`."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n" if event_id is None else f"id: {event_id}\ndata: {data}\n\n"


def sse_data(event: str) -> str:
    """The data of one server-sent event as `sse` writes it (its id line skipped)."""
    return next(line.removeprefix("data: ") for line in event.splitlines()
                if line.startswith("data: "))


def stream_error(body: dict[str, Any]) -> list[Event]:
    """The events that end a stream with an error: the error, then `[DONE]`."""
    return [(None, sse(body)), (None, sse("[DONE]"))]


@dataclass(frozen=True)
class ResponseMeta:
    """Identity of one response, shared by its chunks."""

    response_id: str
    model: str
    chat: bool
    created: int

    @classmethod
    def new(cls, response_id: str, model: str, chat: bool) -> ResponseMeta:
        return cls(response_id, model, chat, int(time.time()))

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(self, index: int, text: str | None, finish_reason: str,
               stop_reason: str | int | None, logprobs: dict[str, Any] | None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One choice of a full reply (`tool_calls` None: a reply without the key)."""
        if tool_calls is not None:
            content = {"message": {"role": "assistant", "content": text,
                                   "tool_calls": tool_calls}}
        elif self.chat:
            content = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"text": text}
        return {"index": index, **content, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def full(self, choices: list[dict[str, Any]], usage: dict[str, Any],
             summaries: Sequence[RequestSummary]) -> dict[str, Any]:
        """The reply; `goodserve` tells where the first choice ran (with `n` > 1 every
        choice's summary is under `goodserve.choices`)."""
        return self._envelope(self.object_name, choices) | {
            "usage": usage, "goodserve": goodserve_summary(summaries)}

    def chunk(self, index: int, text: str, finish_reason: str | None = None,
              stop_reason: str | int | None = None, logprobs: dict[str, Any] | None = None,
              delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice's chunk: `text`, or for chat a `delta` read for tool calls."""
        if self.chat:
            content = {"delta": {"content": text} if delta is None else delta}
        else:
            content = {"text": text}
        choice = {"index": index, **content, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._envelope(self.chunk_object_name, [choice])

    def opening_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant's role (as OpenAI's)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice])

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def last_chunk(self, usage: dict[str, Any] | None,
                   summaries: Sequence[RequestSummary]) -> dict[str, Any]:
        """The stream's closing chunk: no choice, the usage when asked for
        (`stream_options.include_usage`) and the `goodserve` summary."""
        body = self._envelope(self.chunk_object_name, []) | {
            "goodserve": goodserve_summary(summaries)}
        if usage is not None:
            body["usage"] = usage
        return body


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


@dataclass(frozen=True)
class ReplyWriter:
    """Writes one response from its flights (one per choice) once they have output."""

    meta: ResponseMeta
    flights: Sequence[Flight]
    readers: Sequence[ToolCallReader | None]  # per choice; None: plain text
    tokenizer: Tokenizer
    clock: Callable[[], float]  # the router's: it ends the summary of an unfinished flight

    def formatter(self, flight: Flight) -> LogprobsFormatter | None:
        """How `flight`'s logprobs are shown; None: none asked for."""
        wanted = flight.request.sampling.logprobs is not None
        return LogprobsFormatter(self.tokenizer, self.meta.chat) if wanted else None

    def usage(self) -> dict[str, Any]:
        """The prompt counted once (as vLLM does for n > 1), every choice's output."""
        return usage(len(self.flights[0].request.prompt_token_ids),
                     sum(len(f.output.token_ids) for f in self.flights),
                     self.flights[0].output.num_cached_tokens)

    def summaries(self) -> list[RequestSummary]:
        return [RequestSummary.of(f, self.clock) for f in self.flights]

    def whole(self) -> dict[str, Any]:
        """The full JSON reply, its flights finished; reading each choice for tool calls
        tells its reader whether the model called one."""
        choices = []
        for index, (flight, reader) in enumerate(zip(self.flights, self.readers, strict=True)):
            output = flight.output
            assert isinstance(output.text, OutputText)
            text, tool_calls = output.text.text, None
            finish_reason = output.finish_reason or "stop"
            if reader is not None:
                reply = reader.read(text, output.token_ids)
                text, tool_calls = reply.content, reply.tool_calls
                finish_reason = reader.finish_reason(finish_reason, streamed=False)
            formatter = self.formatter(flight)
            logprobs = (None if formatter is None
                        else formatter.format(output.token_ids, output.logprobs))
            choices.append(self.meta.choice(index, text, finish_reason, output.stop_reason,
                                            logprobs, tool_calls))
        return self.meta.full(choices, self.usage(), self.summaries())


class StreamWriter:
    """Writes one stream's events: every choice's chunks as its tokens come (each with
    its index), then the closing chunk and `[DONE]`."""

    def __init__(self, writer: ReplyWriter, options: StreamOptions, resumed: bool,
                 event_ids: bool) -> None:
        """`resumed`: the client reconnected, and holds the output the flights already
        have; `event_ids`: chunks carry their SSE ids (`resumable`)."""
        self.writer = writer
        self.options = options
        self.resumed = resumed
        self.event_ids = event_ids
        self.choices = [ChoiceStream(i, flight, reader, writer.formatter(flight))
                        for i, (flight, reader)
                        in enumerate(zip(writer.flights, writer.readers, strict=True))]
        for choice in self.choices:
            choice.skip_seen()

    def _with_usage(self, chunk: dict[str, Any], num_output_tokens: int) -> dict[str, Any]:
        """`chunk`, with its choice's usage so far when asked for (vLLM's
        `continuous_usage_stats`)."""
        if self.options.include_usage and self.options.continuous_usage_stats:
            first = self.writer.flights[0]
            chunk["usage"] = usage(len(first.request.prompt_token_ids), num_output_tokens,
                                   first.output.num_cached_tokens)
        return chunk

    def opening(self) -> list[Event]:
        """A chat stream's first chunk of each choice (none when resumed)."""
        meta = self.writer.meta
        if not meta.chat or self.resumed:
            return []
        return [(None, sse(self._with_usage(meta.opening_chunk(index), 0)))
                for index in range(len(self.choices))]

    def chunk(self, index: int, batch_finished: bool) -> Event | None:
        """Choice `index`'s chunk for its tokens since the last (None: nothing to show
        yet, e.g. a tool call's name incomplete); its SSE id is the output tokens sent
        up to it, over every choice."""
        choice = self.choices[index]
        chunk = choice.chunk(self.writer.meta, batch_finished)
        if chunk is None:
            return None
        offset = sum(c.num_sent for c in self.choices)
        return offset, sse(self._with_usage(chunk, choice.num_sent),
                           offset if self.event_ids else None)

    def closing(self) -> list[Event]:
        """The closing chunk (the usage when asked for, the summaries), then `[DONE]`."""
        writer = self.writer
        last = writer.meta.last_chunk(writer.usage() if self.options.include_usage else None,
                                      writer.summaries())
        return [(None, sse(last)), (None, sse("[DONE]"))]
