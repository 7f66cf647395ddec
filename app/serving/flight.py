"""One live request's router-side life, as explicit states.

A flight is in exactly one `FlightState`; each transition is one method, which refuses
(with `InvalidTransition`, changing nothing) when the flight is in a state it does not
leave that way:

    PREFILLING -> HANDING_OFF -> QUEUED -> RUNNING -> FINISHED
    (P/D only)    (P/D only)      ^  |       |
                                  |  v       v
                                  +-- MOVING (a migration: the old stream is ending)
    QUEUED / RUNNING -> QUEUED on another instance (fail-over)
    any live state -> CANCELLED (client gone) or LOST (engine failed, nowhere to go)

Its data is three small records: where it runs (`Placement`), the prompt's KV hand-off
from a prefill engine (`KvDelivery`, absent in unified mode) and what the client has
been sent (`OutputLog`). The router does the I/O (engines, KV transport, metrics) and
keeps its load counts by `Flight.is_running` after each transition.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from app.engines.messages import (
    ATTEMPT_MARK,
    KV_PREFIX_PARAM,
    PREFILL_SUFFIX,
    EngineRequest,
    SamplingSpec,
    StoredPromptKv,
    TokenEvent,
    TokenLogprobs,
)
from app.routing.instance_view import InstanceId
from app.routing.move_path import MovePath
from app.routing.view import RouteRequest
from app.serving.telemetry import MigrationReason
from app.serving.tokenizer import StopHit


@dataclass(frozen=True)
class GenerationRequest:
    """One client request, tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    arrival_s: float
    slo_s: float | None = None  # end-to-end deadline after arrival; None = best effort
    prompt_text: str | None = None
    task: str | None = None
    streamed: bool = False  # the client sees tokens as they come (a rerun must match them)
    session_id: str | None = None  # the agent session (conversation) it continues
    step_index: int = 0  # its step in that session, 0 for the first
    # time.perf_counter() when it reached the router (arrival_s is on the router's clock,
    # wall time, which can step): where arrival-to-placement is measured from; by
    # default when the request was made
    received_perf_s: float = field(default_factory=time.perf_counter)


class OutputHook(Protocol):
    """Output processing given at submit (the service's `OutputText`: stop strings, stop
    token ids, text). It sees every token the client is sent, on whichever engine it
    ran, and says where a stop ends the output ("stop at token k"); the router keeps the
    tokens through k and aborts the engine request, nothing more."""

    def observe(self, token_ids: Sequence[int]) -> StopHit | None:
        """Take new output tokens; where a stop ends the output among them."""

    def reset(self) -> None:
        """Forget the output (the request starts over, unseen)."""


class FlightState(StrEnum):
    PREFILLING = "prefilling"  # P/D: the prompt runs on a prefill engine
    HANDING_OFF = "handing-off"  # P/D: the prompt's KV goes to the decode engine
    QUEUED = "queued"  # submitted to its instance, no token from it yet
    RUNNING = "running"  # its instance has produced a token
    MOVING = "moving"  # a migration was asked: the stream on the old instance is ending
    FINISHED = "finished"
    CANCELLED = "cancelled"  # the client left, or a sibling choice was refused
    LOST = "lost"  # its engine failed and no other instance could continue it


TERMINAL = frozenset({FlightState.FINISHED, FlightState.CANCELLED, FlightState.LOST})
LIVE = frozenset(FlightState) - TERMINAL
MOVABLE = frozenset({FlightState.QUEUED, FlightState.RUNNING})  # what a migration may move


class InvalidTransition(RuntimeError):
    """A transition asked of a flight in a state it does not leave that way."""


class EngineLost(Exception):
    """A request's engine failed and no other instance could take it over."""


@dataclass
class MoveRecord:
    """One move (a migration or a fail-over): the path chosen by estimated time, then,
    from the target's first token, the path it took and what it cost."""

    target: InstanceId
    reason: MigrationReason
    path: MovePath  # planned; the one taken once the target has answered (`arrive`)
    estimate_s: float  # the planned path's estimate (`plan_move`)
    kv_bytes: float  # moved over the link (0 by token ids)
    load_tokens: int = 0  # the stored prompt prefix the target is asked to load
    start_s: float = 0.0  # when the flight left its old engine
    cached_tokens: int = 0  # context the target was known to cache when planned
    time_s: float | None = None  # until the target's first token
    loaded_tokens: int | None = None  # context tokens the target found, not computed
    planned_path: MovePath = field(init=False)

    def __post_init__(self) -> None:
        self.planned_path = self.path

    def arrive(self, time_s: float, num_cached_tokens: int,
               kv_bytes_per_token: float | None) -> None:
        """The target's first token came `time_s` after the move, having found
        `num_cached_tokens` of the context. Beyond what it was known to cache, they
        were loaded from a KV connector's store where the target has one
        (`kv_bytes_per_token` given): the KV path, whichever was planned (vLLM's
        connector loads a stored prompt it recognises unasked). Otherwise the target
        computed them: token ids."""
        self.time_s, self.loaded_tokens = time_s, num_cached_tokens
        num_loaded = num_cached_tokens - self.cached_tokens
        if kv_bytes_per_token is None or num_loaded <= 0:
            self.path, self.kv_bytes = MovePath.TOKEN_IDS, 0.0
        else:
            self.path, self.kv_bytes = MovePath.KV, num_loaded * kv_bytes_per_token

    def as_dict(self) -> dict:
        return {"target": self.target, "reason": self.reason.value, "path": self.path.value,
                "planned_path": self.planned_path.value,
                "kv_bytes": self.kv_bytes, "estimate_s": round(self.estimate_s, 6),
                "time_s": None if self.time_s is None else round(self.time_s, 6),
                "loaded_tokens": self.loaded_tokens}


@dataclass
class Placement:
    """Where a flight runs: the serving (decode or unified) instances it was sent to, in
    order (the last is the current or next one), and how it got there."""

    instance_ids: list[InstanceId]
    prefill_instance_id: InstanceId | None = None  # P/D: where its prompt was computed
    attempt: int = 0  # engine submissions so far - 1 (each move submits again)
    num_migrations: int = 0
    num_failovers: int = 0
    move_to: InstanceId | None = None  # the asked migration's target, while MOVING
    move_reason: MigrationReason = MigrationReason.OPERATOR
    moves: list[MoveRecord] = field(default_factory=list)  # the last is the latest
    stored_kv: StoredPromptKv | None = None  # its prompt's KV a connector stored
    stored_kv_s: float = 0.0  # when the engine reported it
    started: bool = False  # the current submission has produced a token
    # a request taken over from another router replica (`LiveRouter.reattach`): its
    # output so far that the client has not been sent, whether its current submission
    # still runs (read it, do not start it) and whether it ended unfinished (place it)
    backlog: list[TokenEvent] = field(default_factory=list)
    attached: bool = False
    orphaned: bool = False


@dataclass
class KvDelivery:
    """The prompt's KV from the prefill engine to the decode engine (P/D only)."""

    params: dict | None = None  # the connector's hand-off for the decode submission
    delivered: bool = False  # the next decode submission finds the prompt's KV there
    held: bool = False  # the transport holds KV for it until the decode engine starts
    prefill_end_s: float | None = None
    transfer_s: float | None = None
    loaded_tokens: int = 0  # prompt tokens the decode engine loaded rather than computed


@dataclass
class OutputLog:
    """What the client has been sent, across every engine the flight ran on."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the first engine found in its prefix cache
    # the client's view of the output: stop strings and stop token ids end it here, on
    # whichever engine the tokens came from (None: only the engine ends it)
    text: OutputHook | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    replaying: bool = False  # running again from the start: the tokens sent must come again
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None

    def restart(self, streamed: bool) -> None:
        """Run again from the start: a streamed output must be reproduced (the client
        has it); an unstreamed one starts over unseen."""
        if streamed:
            self.replaying = True
            return
        self.token_ids.clear()
        self.logprobs.clear()
        if self.text is not None:
            self.text.reset()


@dataclass(eq=False)
class Flight:
    """Router-side state of one request from routing to its end."""

    request: GenerationRequest
    route: RouteRequest
    placement: Placement
    kv: KvDelivery | None = None  # None in unified mode
    output: OutputLog = field(default_factory=OutputLog)
    state: FlightState = FlightState.QUEUED

    @classmethod
    def routed(cls, request: GenerationRequest, route: RouteRequest, target: InstanceId,
               prefill: InstanceId | None = None, disaggregated: bool = False,
               text: OutputHook | None = None) -> Flight:
        """A placed request: on its prefill engine first when it has one."""
        return cls(request, route, Placement([target], prefill_instance_id=prefill),
                   KvDelivery() if disaggregated else None, OutputLog(text=text),
                   FlightState.PREFILLING if prefill else FlightState.QUEUED)

    # ---- reading ----------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def instance_id(self) -> InstanceId:
        """The instance it is on: the prefill engine while prefilling, else the last
        serving instance it was sent to."""
        if self.state is FlightState.PREFILLING:
            assert self.placement.prefill_instance_id is not None
            return self.placement.prefill_instance_id
        return self.placement.instance_ids[-1]

    @property
    def is_running(self) -> bool:
        """Whether it holds a batch slot where it is (else it waits there): it produced a
        token on its instance (a flight being moved counts as running until it leaves)."""
        if self.state is FlightState.PREFILLING:
            return bool(self.output.token_ids)
        return self.state in (FlightState.RUNNING, FlightState.MOVING)

    @property
    def engine_request_id(self) -> str:
        """Unique per submission: an engine must never see an id twice."""
        if self.state is FlightState.PREFILLING:
            return f"{self.request_id}{PREFILL_SUFFIX}"
        attempt = self.placement.attempt
        return self.request_id if attempt == 0 else f"{self.request_id}{ATTEMPT_MARK}{attempt}"

    @property
    def resumable(self) -> bool:
        """Whether another engine can continue it by token ids (see `SamplingSpec`)."""
        return self.request.sampling.resumable

    @property
    def loading_move(self) -> MoveRecord | None:
        """The move whose target is still to produce its first token."""
        moves = self.placement.moves
        if not moves or self.placement.started or self.state is not FlightState.QUEUED:
            return None
        return moves[-1]

    def engine_request(self) -> EngineRequest:
        resume = tuple(self.output.token_ids) if self.resumable else ()
        delivered = self.kv is not None and self.kv.delivered
        params = self.kv.params if delivered and self.kv else None
        move = self.loading_move
        if move is not None and move.load_tokens:
            params = {KV_PREFIX_PARAM: move.load_tokens}
        return EngineRequest(
            self.engine_request_id,
            self.request.prompt_token_ids,
            self.request.sampling,
            resume_token_ids=resume,
            kv_transferred=delivered,
            kv_transfer_params=params,
            priority=self.route.priority,
        )

    def prefill_request(self) -> EngineRequest:
        """The prefill stage: the prompt and its first token."""
        sampling = self.request.sampling
        return EngineRequest(self.engine_request_id, self.request.prompt_token_ids,
                             replace(sampling, max_tokens=1,
                                     min_tokens=min(sampling.min_tokens, 1)),
                             priority=self.route.priority)

    # ---- transitions ----------------------------------------------------------------
    def _leave(self, *states: FlightState) -> None:
        if self.state not in states:
            raise InvalidTransition(f"request {self.request_id} is {self.state.value}, "
                                    f"not {' or '.join(s.value for s in states)}")

    def took_tokens(self, now: float) -> None:
        """Its instance produced tokens: a queued flight runs; the first is its TTFT."""
        self._leave(FlightState.PREFILLING, FlightState.QUEUED, FlightState.RUNNING,
                    FlightState.MOVING)
        if self.state is FlightState.QUEUED:
            self.state = FlightState.RUNNING
        self.placement.started = True
        if self.output.first_token_s is None:
            self.output.first_token_s = now

    def finish(self, reason: str, now: float) -> None:
        """The last token came (the engine's, or a stop the router found); an asked move
        is not carried out."""
        self._leave(FlightState.PREFILLING, FlightState.RUNNING, FlightState.MOVING)
        if not self.output.token_ids:
            raise InvalidTransition(f"request {self.request_id} cannot finish before a token")
        self.output.finish_reason, self.output.finish_s = reason, now
        self._end(FlightState.FINISHED)

    def end_prefill(self, now: float) -> None:
        """The prefill engine gave the first token: its KV goes to the decode engine."""
        self._leave(FlightState.PREFILLING)
        assert self.kv is not None
        self.kv.prefill_end_s = now
        self.state = FlightState.HANDING_OFF

    def hand_off(self, params: dict | None, transfer_s: float | None) -> None:
        """The KV reached the decode engine's side: the decode submission loads it."""
        self._leave(FlightState.HANDING_OFF)
        assert self.kv is not None
        self.kv.params, self.kv.transfer_s = params, transfer_s
        self.kv.delivered = self.kv.held = True
        self.placement.started = False  # the decode submission is next
        self.state = FlightState.QUEUED

    def decode_without_kv(self) -> None:
        """The prefill or the transfer failed: the decode engine computes the prompt (and
        what was generated) itself, by token ids."""
        self._leave(FlightState.PREFILLING, FlightState.HANDING_OFF)
        self.placement.started = False  # the decode submission is next
        self.state = FlightState.QUEUED

    def ask_move(self, target: InstanceId, reason: MigrationReason) -> None:
        """A migration to `target` was asked; it is carried out when the old stream ends."""
        self._leave(FlightState.QUEUED, FlightState.RUNNING)
        self.placement.move_to, self.placement.move_reason = target, reason
        self.state = FlightState.MOVING

    def move(self, record: MoveRecord) -> None:
        """The old stream ended: continue on the asked target, by `record`'s path."""
        self._leave(FlightState.MOVING)
        if record.target != self.placement.move_to:
            raise InvalidTransition(f"request {self.request_id} was asked to move to "
                                    f"{self.placement.move_to}, not {record.target}")
        self.placement.move_to = None
        self.placement.num_migrations += 1
        self._resubmit(record)

    def fail_over(self, record: MoveRecord) -> None:
        """Its engine failed: continue on `record.target`, by token ids (or with the
        stored prompt KV) when it can, else from the start."""
        self._leave(FlightState.QUEUED, FlightState.RUNNING)
        self.placement.num_failovers += 1
        if not self.resumable:
            self.output.restart(self.request.streamed)
        self._resubmit(record)

    def _resubmit(self, record: MoveRecord) -> None:
        self.placement.attempt += 1
        self.placement.instance_ids.append(record.target)
        self.placement.moves.append(record)
        self.placement.started = False
        if self.kv is not None:
            self.kv.delivered = False  # the new engine prefills prompt + generated ids
        self.state = FlightState.QUEUED

    def lose(self) -> None:
        """Its engine failed and nothing can continue it."""
        self._leave(*LIVE)
        self._end(FlightState.LOST)

    def cancel(self) -> None:
        """Nobody will read its stream any more."""
        self._leave(*LIVE)
        self._end(FlightState.CANCELLED)

    def _end(self, state: FlightState) -> None:
        self.placement.move_to = None
        self.state = state
