"""OpenAI-compatible request schema with GoodServe's SLO extension, and the error body.

Plain pydantic, no web framework: the Serve deployment maps HTTP onto these, and tests
check them without a server. Extensions to the OpenAI body: `slo_s` (end-to-end
deadline in seconds after arrival: the time to the last token), `task` (declared task
type, a predictor feature) and vLLM's `ignore_eos`. Replies (`reply_writing`) carry a
`goodserve` object saying where the request ran and whether it met its deadline.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from app.engines.messages import StructuredOutput

BodyModel = TypeVar("BodyModel", bound=BaseModel)


class ApiError(Exception):
    """An error the API reports as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self, status_code: int, message: str, error_type: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param)


def error_body(message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": None}}


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


TokenId = Annotated[int, Field(ge=0)]
TokenIdText = Annotated[str, Field(pattern=r"^[0-9]+$", max_length=12)]  # JSON keys are text
MAX_CHOICES = 16  # `n` above this is refused (each choice is a request to route)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
_INT64 = 2**63 - 1

# Fields vLLM's OpenAI server accepts that this server does not honour. A request that
# sets one to anything but its neutral value gets a 400 naming it, never a silent drop.
# A unit test checks vLLM's own protocol models against these lists, so a field vLLM
# adds shows up there.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "suffix": ("",), "best_of": (1,), "use_beam_search": (False,),
    "length_penalty": (1.0,), "prompt_logprobs": (), "logprob_token_ids": ([],),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "bad_words": ([],), "allowed_token_ids": (), "prompt_embeds": (),
    "truncate_prompt_tokens": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "return_token_offsets": (False,), "watermarking": (False,),
    "thinking_token_budget": (), "repetition_detection": (), "mm_payload": (),
    "return_mm_kwargs": (False,), "kv_transfer_params": (), "ec_transfer_params": (),
    "vllm_xargs": (), "spaces_between_special_tokens": (True,), "add_special_tokens": (),
    "continue_final_message": (False,), "documents": (), "chat_template": (),
    "chat_template_kwargs": (), "mm_processor_kwargs": (), "audio": (), "modalities": (),
    "prediction": (), "reasoning_effort": (), "include_reasoning": (True,),
    "parallel_tool_calls": (True,), "web_search_options": (), "media_io_kwargs": (),
    "routed_experts_prompt_start": (0,), "stream_interval": (), "cache_salt": (),
    "priority": (0,), "add_generation_prompt": (True,), "return_prompt_text": (False,),
}
# Fields vLLM accepts that change nothing in the output; accepted and ignored.
NO_EFFECT_FIELDS = frozenset({"request_id", "truncation_side"})


def unsupported_field(data: dict[str, Any], schema: type[BaseModel]) -> str | None:
    """The first field of a request body this server cannot honour, if any (a field
    `schema` defines is honoured: `tools` in chat, not in completions)."""
    for name, neutral in UNSUPPORTED_FIELDS.items():
        value = data.get(name)
        if value is not None and value not in neutral and name not in schema.model_fields:
            return name
    return None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required with type json_schema, and only then")
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsBody:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self

    def constraint(self) -> StructuredOutput:
        if self.json_ is not None:
            spec = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json", spec)
        if self.json_object:
            return StructuredOutput("json_object")
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        kind = "regex" if self.regex is not None else "grammar"
        return StructuredOutput(kind, self.regex if self.regex is not None else self.grammar)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the usage of the whole request
    # with include_usage, every chunk carries its choice's usage so far (vLLM's)
    continuous_usage_stats: bool = False


class _OpenAiBody(BaseModel):
    """Fields shared by completions and chat completions: OpenAI's sampling surface and
    vLLM's extensions to it (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
    `stop_token_ids`, `include_stop_str_in_output`, `ignore_eos`, `skip_special_tokens`).

    Unknown fields are ignored (OpenAI clients send many); fields vLLM defines that we
    cannot honour are refused (`UNSUPPORTED_FIELDS`).
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: all tokens
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[TokenId] | None = Field(None, validate_default=True)
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[TokenIdText, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, validate_default=True)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    user: str | None = None
    slo_s: float | None = Field(None, gt=0, description="end-to-end deadline after arrival")
    task: str | None = Field(None, max_length=200)
    session_id: str | None = Field(
        None, min_length=1, max_length=200,
        description="agent session (conversation) this request continues (default: the "
        "one its headers name, such as X-Session-Affinity, or llm-d's cookie): its steps go "
        "where their shared context is cached unless the deadline needs another GPU, a "
        "step after the first is never turned away, and length estimates learn from its "
        "earlier steps (the session-affinity policy alone pins a session to one engine)")
    session_step: int | None = Field(
        None, ge=0, description="this request's step in its session, 0 for the first: a "
        "session is admitted or turned away at its first step, never later (default: "
        "a chat request's assistant turns, else 0)")

    @property
    def step_index(self) -> int:
        """The request's step in its session (`session_step`, else inferred)."""
        return self.session_step if self.session_step is not None else 0

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int] | None) -> list[int]:
        return list(ids or [])

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float]:
        return dict(bias or {})

    @model_validator(mode="after")
    def _consistent(self) -> _OpenAiBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must not exceed max_tokens")
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format: give it or structured_outputs, not both")
        return self

    @property
    def structured(self) -> StructuredOutput | None:
        """The output's constraint, if any (`response_format` or `structured_outputs`)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.json_schema is None:
            return StructuredOutput("json_object")
        return StructuredOutput("json", json.dumps(self.response_format.json_schema.schema_))

    @property
    def output_budget(self) -> int:
        """Most tokens to generate per choice (16 when the request names none)."""
        return self.max_tokens or 16



class CompletionRequest(_OpenAiBody):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives to report per token; None = no logprobs."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call an assistant message made earlier in the conversation."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's text (text parts joined, as chat templates see them)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it."""
        return self.model_dump(exclude_none=True) | {"content": self.text}


class InstructionMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[TextPart]


class AssistantMessage(_Message):
    """An earlier assistant turn: its text, its tool calls, or both."""

    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("content: required unless the message makes tool calls")
        return self


class ToolMessage(_Message):
    """A tool's result, answering the call `tool_call_id`."""

    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


ChatMessage = Annotated[InstructionMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A function the model may call (OpenAI's `tools` entry)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


def _parameters(function: FunctionSpec) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def tool_calls_schema(tools: Sequence[ToolSpec], parallel_tool_calls: bool | None) -> dict:
    """The JSON schema `tool_choice: "required"` constrains the output to (vLLM's): a
    list of at least one {name, parameters} of the given functions."""
    choices = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                               "parameters": _parameters(t.function)},
                "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": choices}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def new_tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ChatCompletionRequest(_OpenAiBody):
    """Chat completions; `tools` with `tool_choice` "required" or a named function
    constrain the output to the calls' JSON (vLLM's structured outputs, no tool parser
    needed); "auto" (the default with tools) needs the model family's tool parser, which
    the server checks (`app/serving/tools.py`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_possible(self) -> ChatCompletionRequest:
        choice = self.tool_choice if self.tool_choice is not None else (
            "auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or ()}:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if self.calls_tools and (
                self.response_format is not None or self.structured_outputs is not None):
            raise ValueError("tool_choice: cannot be combined with response_format")
        return self

    @property
    def step_index(self) -> int:
        """`session_step`, else the assistant turns already in the conversation: each
        ended an earlier step."""
        if self.session_step is not None:
            return self.session_step
        return sum(isinstance(m, AssistantMessage) for m in self.messages)

    @property
    def calls_tools(self) -> bool:
        """The reply is tool calls ("required" or a named function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def may_call_tools(self) -> bool:
        """The model chooses whether to call ("auto", the default when tools are given)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def structured(self) -> StructuredOutput | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            function = next(t.function for t in self.tools or () if t.function.name == name)
            return StructuredOutput("json", json.dumps(_parameters(function)))
        if self.tool_choice == "required":
            assert self.tools is not None
            return StructuredOutput("json", json.dumps(
                tool_calls_schema(self.tools, self.parallel_tool_calls)))
        return super().structured

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# A completion or chat body: what the service reads into requests and answers
OpenAiRequest = CompletionRequest | ChatCompletionRequest


class MigrateRequest(BaseModel):
    """`POST /admin/migrate`: move a request; without `target` the policy picks."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    target: str | None = None


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/admin/migrate": MigrateRequest,
}


def openapi_request_bodies() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The POST routes' OpenAPI `requestBody`s (path -> body) and the component schemas
    they refer to: the bodies these models validate, published so clients and fuzzers
    see what the server accepts."""
    _, top = models_json_schema([(m, "validation") for m in REQUEST_BODIES.values()],
                                ref_template="#/components/schemas/{model}")
    bodies = {path: {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        for path, model in REQUEST_BODIES.items()}
    return bodies, top["$defs"]


def json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request("body must be a JSON object")
    return data


def parse_body(raw: bytes, schema: type[BodyModel]) -> BodyModel:
    """Validate a JSON body; every failure is one clear `invalid_request_error`."""
    data = json_object(raw)
    unsupported = unsupported_field(data, schema)
    if unsupported is not None:
        raise invalid_request(f"{unsupported}: not supported by this server", unsupported)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        error = _most_telling(exc.errors())
        where = ".".join(str(p) for p in error["loc"] if not _is_union_member(p)) or None
        message = error["msg"].removeprefix("Value error, ")
        raise invalid_request(f"{where}: {message}" if where else message, where) from None


def _most_telling(errors: Sequence[Any]) -> Any:
    """The error to report: for a value a union takes in several forms (a prompt as
    text or token ids), the form it was written in fails on something other than
    its type."""
    return next((e for e in errors if not e["type"].endswith("_type")), errors[0])


def _is_union_member(part: str | int) -> bool:
    """Pydantic names the union member in an error's location (`list[constrained-int]`)."""
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-"))


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """Plain-text transcript ending with the assistant's turn (models without a template)."""
    lines = [f"{m.role}: {m.text}" for m in messages]
    return "\n".join([*lines, "assistant:"])
