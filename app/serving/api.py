"""OpenAI-compatible request/response schema with GoodServe's SLO extension.

Plain pydantic and dict builders, no web framework: the Serve deployment maps HTTP
onto these, and tests check them without a server. Extensions to the OpenAI body:
`slo_s` (end-to-end deadline in seconds after arrival: the time to the last token),
`task` (declared task type, a predictor feature) and vLLM's `ignore_eos`. Responses
carry a `goodserve` object saying where the request ran and whether it met its
deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema

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


class _OpenAiBody(BaseModel):
    """Fields shared by completions and chat completions.

    Unknown fields are ignored (OpenAI clients send many); fields we cannot honour
    (`n` > 1, `stop`, `logprobs`, ...) are rejected rather than silently dropped.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    seed: int | None = None
    stream: bool = False
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: int | bool | None = None
    ignore_eos: bool = False
    slo_s: float | None = Field(None, gt=0, description="end-to-end deadline after arrival")
    task: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _supported(self) -> _OpenAiBody:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.stop:
            raise ValueError("stop: stop strings are not supported")
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        return self


class CompletionRequest(_OpenAiBody):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and (not prompt or min(prompt) < 0):
            raise ValueError("prompt token ids must be a non-empty list of ids >= 0")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_OpenAiBody):
    messages: list[ChatMessage] = Field(min_length=1)


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
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise invalid_request(f"{where}: {message}" if where else message, where) from None


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """Plain-text transcript ending with the assistant's turn (models without a template)."""
    lines = [f"{m.role}: {m.content}" for m in messages]
    return "\n".join([*lines, "assistant:"])


@dataclass(frozen=True)
class RequestSummary:
    """What the router reports about a finished request (the `goodserve` extension)."""

    instance_ids: tuple[str, ...]  # unified or decode instances, in visit order
    num_migrations: int
    slo_s: float | None
    e2e_s: float
    predicted_output_tokens: int | None
    prefill_instance: str | None = None  # disaggregated: where the prompt was computed
    kv_transfer_s: float | None = None  # disaggregated: prefill -> decode KV transfer
    kv_loaded_tokens: int = 0  # prompt tokens whose KV the decode engine loaded

    @property
    def met_deadline(self) -> bool | None:
        return None if self.slo_s is None else self.e2e_s <= self.slo_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance_ids": list(self.instance_ids),
            "num_migrations": self.num_migrations,
            "slo_s": self.slo_s,
            "e2e_s": round(self.e2e_s, 6),
            "met_deadline": self.met_deadline,
            "predicted_output_tokens": self.predicted_output_tokens,
            "prefill_instance": self.prefill_instance,
            "decode_instance": self.instance_ids[-1] if self.prefill_instance else None,
            "kv_transfer_s": (None if self.kv_transfer_s is None
                              else round(self.kv_transfer_s, 6)),
            "kv_loaded_tokens": self.kv_loaded_tokens,
        }


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

    def _envelope(self, object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, **choice}],
        }

    def full(
        self, text: str, finish_reason: str, usage: dict[str, int], summary: RequestSummary
    ) -> dict[str, Any]:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {
            "text": text
        }
        body = self._envelope(self.object_name, {**content, "finish_reason": finish_reason})
        return body | {"usage": usage, "goodserve": summary.as_dict()}

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        content = {"delta": {"content": text}} if self.chat else {"text": text}
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(name, {**content, "finish_reason": finish_reason})


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event line pair."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"
