"""Tool calls in chat replies, read as vLLM's chat server reads them.

- `tool_choice` "required" or a named function: the output is constrained to the calls'
  JSON (`ChatCompletionRequest.structured`), so no parser is needed. A stream announces
  each call once its name is complete, then sends its arguments as they are generated
  (vLLM's own streaming functions).
- "auto": the model writes calls, or plain text, in its family's own syntax; vLLM's tool
  parser for that family (`tool_call_parser` in the config, vLLM's `--tool-call-parser`)
  finds them, in a whole reply and in a stream.

One reader per choice: stream parsers keep state between deltas.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.serving.api import ChatCompletionRequest, NamedToolChoice, new_tool_call

if TYPE_CHECKING:
    from vllm.parser.abstract_parser import Parser

logger = logging.getLogger(__name__)

RANDOM_IDS = "random"  # vLLM's tool-call id type for every family but Kimi's


@dataclass(frozen=True)
class ToolReply:
    """A whole chat choice read for tool calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None  # None: a plain reply (no `tool_calls` key)


class ToolCallReader(ABC):
    """Reads one chat choice's tool calls, whole (`read`) or streamed (`delta`)."""

    # whether the reply's text leaves special tokens out; None: as the request says
    skip_special_tokens: bool | None = None

    def __init__(self) -> None:
        self.called = False  # a call was read, or a call delta streamed

    @abstractmethod
    def read(self, text: str, token_ids: Sequence[int]) -> ToolReply:
        """The whole output as a reply's content and tool calls."""

    @abstractmethod
    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """The chunk delta for newly streamed output (`text`, its `token_ids`); None when
        nothing can be sent yet (a call's name is still incomplete)."""

    @abstractmethod
    def finish_reason(self, engine_reason: str, streamed: bool) -> str:
        """OpenAI's finish reason: "tool_calls" where a call ended the reply."""


class NamedCallReader(ToolCallReader):
    """`tool_choice` naming a function: the output is that call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def read(self, text: str, token_ids: Sequence[int]) -> ToolReply:
        self.called = bool(text.strip())
        return ToolReply("", [new_tool_call(self.name, text)] if self.called else [])

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        from vllm.tool_parsers.streaming import extract_named_tool_call_streaming

        if not text:
            return None
        message, self.called = extract_named_tool_call_streaming(
            delta_text=text, function_name=self.name, function_name_returned=self.called,
            tool_call_idx=0, tool_call_id_type=RANDOM_IDS, tokenizer=None)
        return _delta_dict(message)

    def finish_reason(self, engine_reason: str, streamed: bool) -> str:
        return engine_reason  # OpenAI's: a named call ends in "stop"


class RequiredCallsReader(ToolCallReader):
    """`tool_choice: "required"`: the output is a JSON array of `{name, parameters}`."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""  # streamed so far

    def read(self, text: str, token_ids: Sequence[int]) -> ToolReply:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:  # cut short (max_tokens): no call, as vLLM's
            return ToolReply("", [])
        self.called = bool(calls)
        return ToolReply("", [new_tool_call(c["name"], json.dumps(c["parameters"],
                                                                   ensure_ascii=False))
                              for c in calls])

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

        previous, self._text = self._text, self._text + text
        message, announced = extract_required_tool_call_streaming(
            previous_text=previous, current_text=self._text, tool_call_idx=0,
            tool_call_id_type=RANDOM_IDS)
        self.called = self.called or announced
        return _delta_dict(message)

    def finish_reason(self, engine_reason: str, streamed: bool) -> str:
        if engine_reason == "stop" and (self.called or not streamed):
            return "tool_calls"
        return engine_reason


class ParsedCallsReader(ToolCallReader):
    """`tool_choice: "auto"`: the model family's tool parser reads the output."""

    def __init__(self, parser: Parser, request: Any, prompt_token_ids: Sequence[int],
                 parallel_tool_calls: bool | None) -> None:
        super().__init__()
        self.parser = parser
        self.request = request  # vLLM's own ChatCompletionRequest, as its parsers read it
        self.prompt_token_ids = list(prompt_token_ids)
        self.only_first = parallel_tool_calls is False
        self._failed = False  # the parser raised: the rest of the stream is plain text
        # some families mark calls with special tokens, and their parsers ask to see them
        self.skip_special_tokens = request.skip_special_tokens

    def read(self, text: str, token_ids: Sequence[int]) -> ToolReply:
        try:
            _, content, calls = self.parser.parse(text, self.request, enable_auto_tools=True,
                                                  model_output_token_ids=list(token_ids))
        except Exception:  # a parser bug on odd output: the client still gets the text
            logger.exception("the tool parser failed; the reply is plain text")
            return ToolReply(text, None)
        if not calls:
            return ToolReply(content, None)
        self.called = True
        tool_calls = [new_tool_call(c.name, c.arguments) | ({"id": c.id} if c.id else {})
                      for c in calls]
        return ToolReply(content, tool_calls[:1] if self.only_first else tool_calls)

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        if self._failed:
            return {"content": text} if text or finished else None
        try:
            message = self.parser.parse_delta(text, list(token_ids), self.request,
                                              self.prompt_token_ids, finished=finished)
        except Exception:  # a parser bug on odd output: the rest streams as plain text
            logger.exception("the tool parser failed; the stream goes on as plain text")
            self._failed = True
            return {"content": text}
        if message is not None and message.tool_calls:
            self.called = True
            if self.only_first:
                message.tool_calls = [c for c in message.tool_calls if c.index == 0]
        return _delta_dict(message)

    def finish_reason(self, engine_reason: str, streamed: bool) -> str:
        if self.called and (engine_reason == "stop" or not streamed):
            return "tool_calls"
        return engine_reason


def _delta_dict(message: Any) -> dict[str, Any] | None:
    """vLLM's `DeltaMessage` as OpenAI's chunk delta (what was set, reasoning left out)."""
    if message is None:
        return None
    delta = message.model_dump(mode="json", exclude_unset=True)
    delta.pop("reasoning", None)
    return delta


class ToolParsing:
    """The served model family's tool parser (vLLM's), for `tool_choice: "auto"`."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        """Raises ValueError for a name vLLM does not know, or a parser the model's
        tokenizer cannot serve (it lacks the family's call markers)."""
        from vllm.parser import ParserManager
        from vllm.tool_parsers import ToolParserManager

        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        if name not in known:
            raise ValueError(f"tool_call_parser: {name!r} is not one of vLLM's tool parsers "
                             f"({', '.join(known)})")
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer)
        except TypeError as exc:  # vLLM's check of the tokenizer
            raise ValueError(f"tool_call_parser: {name!r} cannot read this model's output: "
                             f"{exc.__cause__ or exc}") from exc
        self.tokenizer = tokenizer

    def reader(self, body: ChatCompletionRequest,
               prompt_token_ids: Sequence[int]) -> ParsedCallsReader:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as VllmChatRequest,
        )

        request = VllmChatRequest.model_validate(body.model_dump(
            mode="json", by_alias=True, exclude_none=True,
            include={"model", "messages", "tools", "tool_choice", "parallel_tool_calls",
                     "skip_special_tokens"}))
        parser = self.parser_cls(self.tokenizer, request.tools)
        request = parser.adjust_request(request)
        return ParsedCallsReader(parser, request, prompt_token_ids, body.parallel_tool_calls)


def tool_call_reader(body: ChatCompletionRequest, parsing: ToolParsing | None,
                     prompt_token_ids: Sequence[int]) -> ToolCallReader | None:
    """The reader for one choice of `body`; None when the reply cannot call tools."""
    if isinstance(body.tool_choice, NamedToolChoice):
        return NamedCallReader(body.tool_choice.function.name)
    if body.tool_choice == "required":
        return RequiredCallsReader()
    if body.tools and body.tool_choice in (None, "auto") and parsing is not None:
        return parsing.reader(body, prompt_token_ids)
    return None
