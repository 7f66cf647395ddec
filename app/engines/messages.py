"""Plain data passed between router, engines and simulator.

Both engine backends (vLLM and simulated) and the discrete-event simulator speak
these types, so the routing code never knows which substrate it drives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from app.engines.prefix import prefix_block_hashes


class RequestStatus(IntEnum):
    """Ordered lifecycle: `is_finished` is `status >= FINISHED_STOPPED`."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's form (vLLM's structured outputs): `kind` json (a JSON
    schema, as JSON text), json_object, regex, choice (a JSON list of strings) or
    grammar (EBNF)."""

    kind: str
    spec: str = ""

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"structured output kind must be one of {self.KINDS}")


@dataclass(frozen=True)
class SamplingSpec:
    """What an engine samples with: the OpenAI / vLLM sampling surface the router passes
    on. Stop strings are not here: the router matches them on the text it decodes (so a
    match spanning a move is found), see `OutputText` in `app/serving/tokenizer.py`."""

    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def resumable(self) -> bool:
        """Whether continuing on another engine by token ids samples as staying would.

        Presence and frequency penalties count the *output* tokens, which a resumed
        engine sees as prompt; a seeded sampler restarts its random stream; a grammar
        restarts from its beginning. Such requests are not moved to meet a deadline;
        when their engine fails they are run again from the start."""
        seeded = self.seed is not None and self.temperature > 0
        return not (seeded or self.presence_penalty or self.frequency_penalty
                    or self.structured is not None)


@dataclass(frozen=True)
class EngineRequest:
    """One generation call. `resume_token_ids` are tokens generated elsewhere before a
    migration: the engine re-prefills prompt + resume ids and continues from there."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingSpec = SamplingSpec()
    resume_token_ids: Sequence[int] = ()
    kv_transferred: bool = False  # decode role: prompt KV already delivered by a prefill engine
    kv_transfer_params: dict[str, Any] | None = None  # decode role: from the prefill's result
    priority: int = 0  # engines in priority mode run lower values first (then arrival)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if len(self.resume_token_ids) >= self.sampling.max_tokens:
            raise ValueError(
                f"request {self.request_id}: {len(self.resume_token_ids)} resume tokens "
                f"leave nothing to generate (max_tokens={self.sampling.max_tokens})"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_to_generate(self) -> int:
        return self.sampling.max_tokens - len(self.resume_token_ids)

    @property
    def num_min_tokens_left(self) -> int:
        """`min_tokens` still owed after the resumed ones."""
        return max(self.sampling.min_tokens - len(self.resume_token_ids), 0)

    def block_hashes(self) -> tuple[int, ...]:
        return prefix_block_hashes(self.prompt_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives (rank order)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


KV_PREFIX_PARAM = "kv_prefix_tokens"  # a submission's kv_transfer_params: load this prefix


@dataclass(frozen=True)
class StoredPromptKv:
    """A prompt's KV a unified engine's connector stored (shared storage): its first
    `num_tokens` tokens, under `storage_key`; a move can load it on another engine."""

    storage_key: str
    num_tokens: int

    def as_params(self) -> dict[str, Any]:
        return {"storage_key": self.storage_key, "stored_tokens": self.num_tokens}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> StoredPromptKv | None:
        if not params or "stored_tokens" not in params:
            return None
        return cls(str(params["storage_key"]), int(params["stored_tokens"]))


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, timestamped by the engine (wall or virtual seconds)."""

    request_id: str
    token_id: int
    index: int  # position in the output (counting resume tokens)
    time_s: float
    finish_reason: str | None = None  # set on the last token
    # first token of a submission: context tokens whose KV the engine found (prefix
    # cache, or delivered by a KV connector) instead of computing them
    num_cached_tokens: int | None = None
    # last token of a prefill-stage request: what a decode engine needs to fetch the
    # prompt's KV (connector-specific; vLLM's kv_transfer_params); first token of a
    # unified engine's submission: where its connector stored the prompt's KV
    # (`StoredPromptKv.as_params`), for a later move to load
    kv_transfer_params: dict[str, Any] | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# An engine submission's id is the client request's, then "@<n>" for its n-th move and
# ":prefill" for its prefill stage (`Flight.engine_request_id`); client ids hold neither.
ATTEMPT_MARK = "@"
PREFILL_SUFFIX = ":prefill"


def client_request_id(engine_request_id: str) -> str:
    """The client request an engine submission belongs to."""
    return engine_request_id.removesuffix(PREFILL_SUFFIX).split(ATTEMPT_MARK)[0]


def attempt_of(engine_request_id: str) -> int:
    """The submission's number among its request's (0: the first; -1: a prefill stage)."""
    if engine_request_id.endswith(PREFILL_SUFFIX):
        return -1
    _, mark, attempt = engine_request_id.partition(ATTEMPT_MARK)
    return int(attempt) if mark else 0


@dataclass(frozen=True)
class EngineRecord:
    """What an engine holds of one submission (`OutputJournal`): a router replica
    re-attaches a request from it."""

    request_id: str  # the engine submission's id
    prompt_token_ids: tuple[int, ...]
    resume_token_ids: tuple[int, ...]  # generated before this submission
    events: tuple[TokenEvent, ...]  # this submission's tokens so far
    ended: bool = False
    aborted: bool = False  # ended without finishing (an abort, or its engine failed)

    @property
    def attempt(self) -> int:
        return attempt_of(self.request_id)

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1].finished and not self.aborted

    def output_events(self, time_s: float) -> list[TokenEvent]:
        """The whole output so far as events: the resumed tokens (stamped `time_s`),
        then this submission's."""
        resumed = [TokenEvent(self.request_id, token, index, time_s)
                   for index, token in enumerate(self.resume_token_ids)]
        return [*resumed, *self.events]


@dataclass(frozen=True)
class PrefillTotals:
    """An engine's prefill work since it started, as monotonic counters: a poller
    differences two reports to learn the prefill time per token in between, the
    way the simulator learns it from each iteration."""

    num_iterations: int = 0  # iterations that computed prompt tokens
    num_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    busy_s: float = 0.0  # summed duration of those iterations

    def add(self, duration_s: float, num_tokens: int) -> PrefillTotals:
        """These totals plus one iteration that computed `num_tokens` prompt tokens."""
        return PrefillTotals(
            self.num_iterations + 1, self.num_tokens + num_tokens, self.busy_s + duration_s
        )

    def since(self, earlier: PrefillTotals) -> PrefillTotals:
        """The work done between an earlier report and this one."""
        return PrefillTotals(
            self.num_iterations - earlier.num_iterations,
            self.num_tokens - earlier.num_tokens,
            self.busy_s - earlier.busy_s,
        )


@dataclass(frozen=True)
class EngineStatus:
    """Cheap black-box figures an engine reports; the router's only view of it."""

    engine_id: str
    gpu_type: str
    role: str
    num_waiting: int
    num_running: int
    recent_iteration_s: tuple[float, ...]  # latest iteration latencies, oldest first
    recent_queue_wait_s: tuple[float, ...]  # arrival -> first scheduled, recent requests
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_cached_prefix_blocks: int
    prefix_digest: frozenset[int] = field(default_factory=frozenset)  # cached block hashes
    time_s: float = 0.0
    # monotonic counters: a poller takes only the newest (counter delta) window entries
    num_iterations: int = 0
    num_queue_wait_samples: int = 0
    num_finished: int = 0
    prefill: PrefillTotals = PrefillTotals()
    # tokens per KV block: the engine's own (vLLM chooses per platform: 16 on GPUs, 128
    # on CPUs), so the router counts KV room in the blocks the engine allocates
    kv_block_size: int = 16

    @property
    def kv_usage(self) -> float:
        total = self.num_kv_blocks_used + self.num_kv_blocks_free
        return self.num_kv_blocks_used / total if total else 0.0

