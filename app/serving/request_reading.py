"""A parsed request read into what the router runs: one generation request per choice.

Every check of a request against the served model and the engines (its model, token
ids against the vocabulary and the context, logprobs, output constraints, tool
parsing) is made here, before anything is routed, so a request that cannot run is the
client's 400 and never a half-routed reply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from app.engines.base import EngineBackendBase
from app.engines.messages import SamplingSpec, StructuredOutput
from app.serving.api import ApiError, ChatCompletionRequest, OpenAiRequest, invalid_request
from app.serving.config import ServeConfig
from app.serving.flight import GenerationRequest
from app.serving.replies import named_session
from app.serving.tokenizer import OutputText, Tokenizer
from app.serving.tools import ToolCallReader, ToolParsing, tool_call_reader


@dataclass(frozen=True)
class ReadRequest:
    """A request read: per choice (`n`), what to run and how its output is shown."""

    requests: list[GenerationRequest]
    readers: list[ToolCallReader | None]  # reads tool calls out of the text; None: plain
    texts: list[OutputText]


def sampling(body: OpenAiRequest, structured: StructuredOutput | None) -> SamplingSpec:
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


class RequestReader:
    """Reads parsed bodies (and their headers) against the served model and engines."""

    def __init__(self, config: ServeConfig, tokenizer: Tokenizer,
                 engines: type[EngineBackendBase], tool_parsing: ToolParsing | None,
                 clock: Callable[[], float]) -> None:
        """`engines`: the backend, asked what it can do; `clock`: the router's, which
        stamps each request's arrival."""
        self.config = config
        self.tokenizer = tokenizer
        self.engines = engines
        self.tool_parsing = tool_parsing
        self.clock = clock

    def read(self, body: OpenAiRequest, headers: Mapping[str, str], received_perf_s: float,
             request_id: str) -> ReadRequest:
        """The request's choices; the session is the body's, else the one its headers
        name."""
        session_id = body.session_id or named_session(
            headers, self.config.session_headers, self.config.session_cookies)
        requests = self._generation_requests(body, received_perf_s, request_id, session_id)
        readers = self._tool_readers(body, requests)
        texts = [self._output_text(body, request, reader)
                 for request, reader in zip(requests, readers, strict=True)]
        return ReadRequest(requests, readers, texts)

    def _generation_requests(self, body: OpenAiRequest, received_perf_s: float,
                            request_id: str, session_id: str | None
                            ) -> list[GenerationRequest]:
        """One request per choice (`n`); choice i of response `cmpl-<id>` is request
        `<id>` when n = 1, else `<id>.<i>` (its seed, when given, seed + i, as
        vLLM's)."""
        if body.model not in self.config.served_model_names:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.config.served_model_names[0]!r}", "not_found_error",
                           "model")
        text, token_ids = self._prompt(body)
        structured = self._checked(body, token_ids)
        spec = sampling(body, structured)
        arrival_s = self.clock()
        requests = []
        for index in range(body.n):
            seed = None if body.seed is None else body.seed + index
            requests.append(GenerationRequest(
                request_id=request_id if body.n == 1 else f"{request_id}.{index}",
                prompt_token_ids=tuple(token_ids),
                sampling=replace(spec, seed=seed),
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

    def _prompt(self, body: OpenAiRequest) -> tuple[str | None, list[int]]:
        """The prompt's text (None: given as token ids) and its token ids."""
        if isinstance(body, ChatCompletionRequest):
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            text = self.tokenizer.render_chat(body.messages, tools)
            return text, self.tokenizer.encode(text)
        if isinstance(body.prompt, str):
            return body.prompt, self.tokenizer.encode(body.prompt)
        return None, list(body.prompt)

    def _checked(self, body: OpenAiRequest, token_ids: list[int]) -> StructuredOutput | None:
        """The output's constraint, once the request is found to fit the model's
        vocabulary and context and the engines can do what it asks."""
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
        chat = body if isinstance(body, ChatCompletionRequest) else None
        if chat is not None and chat.may_call_tools and self.tool_parsing is None:
            raise invalid_request(
                "tool_choice: 'auto' (the default with tools) needs the model family's tool "
                "parser, which this server is not configured with (tool_call_parser); use "
                "'required', a named function or 'none'", "tool_choice")
        structured = body.structured
        constrained_by = ("tools" if chat is not None and chat.calls_tools
                          else "response_format")
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
        return structured

    def _tool_readers(self, body: OpenAiRequest, requests: list[GenerationRequest]
                     ) -> list[ToolCallReader | None]:
        """A tool-call reader per choice (None where the reply cannot call tools)."""
        if not isinstance(body, ChatCompletionRequest):
            return [None] * len(requests)
        return [tool_call_reader(body, self.tool_parsing, r.prompt_token_ids)
                for r in requests]

    def _output_text(self, body: OpenAiRequest, request: GenerationRequest,
                    reader: ToolCallReader | None) -> OutputText:
        """How one choice's output is shown: its stops, and special tokens as its tool
        parser needs them, else as the request says."""
        skip_special = (body.skip_special_tokens if reader is None
                        or reader.skip_special_tokens is None
                        else reader.skip_special_tokens)
        return OutputText(self.tokenizer, body.stop, body.stop_token_ids,
                          body.include_stop_str_in_output, request.sampling.min_tokens,
                          skip_special)
