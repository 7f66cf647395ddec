"""Agent sessions: chains of dependent LLM steps with tool waits between them.

Agentic traffic is closed-loop. A session arrives (Poisson or Gamma); each of its
steps is an LLM call whose prompt is the application's shared prefix (system prompt and
tools), then the session's own history, then what the last tool returned. A step is
issued only when every step it waits for has finished, plus a tool wait (heavy-tailed:
most tools answer in a second, a few take minutes), and, where a session log gives the
step its own arrival, not before that. A step may fan out into parallel calls that a
later step joins. Every step carries its own end-to-end deadline.

The session graph is drawn once, seeded, with every length fixed; only *when* each
step is issued depends on the serving system. `StepReleases` is that dependency
logic, pure and clock-agnostic: the simulator and the live replay client both ask it
which steps become ready when a step ends.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from app.workloads.session_graph import SessionGraph
from app.workloads.workload import (
    Arrivals,
    Count,
    Identifier,
    RateProfile,
    SyntheticArrivals,
    Workload,
    WorkloadRequest,
    jsonl_rows,
    parse_row,
    row_error,
    shaped_arrivals,
)

SESSION_BLOCK_TOKENS = 256  # tokens per prefix-hash block of generated session prompts


# ---- sessions and the workload they make ---------------------------------------


@dataclass(frozen=True)
class AgentStep:
    """One LLM call of a session, with the lengths it will have."""

    step_id: str  # unique within its session
    wait_for: tuple[str, ...]  # steps that must finish first; () = issued at session arrival
    tool_wait_s: float  # after the last of them finishes: tool run time or user think time
    num_prompt_tokens: int  # the whole context: shared prefix + history + appended
    num_appended_tokens: int  # new at the end (tool output, user message)
    num_output_tokens: int
    block_hashes: tuple[int, ...]  # chained prefix hashes of the prompt
    hash_block_size: int = SESSION_BLOCK_TOKENS
    # a session log's own arrival of the step, after its session's: never issued before
    arrival_offset_s: float = 0.0


@dataclass(frozen=True)
class AgentSession:
    """A session's steps in an order where every step follows the ones it waits for."""

    session_id: str
    arrival_s: float
    steps: tuple[AgentStep, ...]
    app: str = "app"
    app_prefix_tokens: int = 0  # the app's shared prefix (system prompt, tools) in tokens

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for step in self.steps:
            missing = [w for w in step.wait_for if w not in seen]
            if missing:
                raise ValueError(f"session {self.session_id}: step {step.step_id} waits for "
                                 f"{missing}, which do not come before it")
            if step.step_id in seen:
                raise ValueError(f"session {self.session_id}: step id {step.step_id} repeats")
            seen.add(step.step_id)
        if not self.steps or self.steps[0].wait_for or self.steps[0].arrival_offset_s:
            raise ValueError(f"session {self.session_id}: the first step must wait for "
                             "nothing and arrive with its session")


def sessions_workload(
    sessions: Sequence[AgentSession], duration_s: float, name: str
) -> Workload:
    """The sessions' steps as one workload (ids '<session>/<step>'), with their graph.

    A step's `arrival_s` is its session's arrival until it is released; requests are
    ordered by session arrival, so the first steps are sorted as the simulator needs. A
    step's own arrival offset goes into the graph as the earliest it may be issued.
    """
    ordered = sorted(sessions, key=lambda s: (s.arrival_s, s.session_id))
    requests: list[WorkloadRequest] = []
    parents: list[tuple[int, ...]] = []
    waits: list[float] = []
    earliest: list[float] = []
    for session in ordered:
        index = {}
        for number, step in enumerate(session.steps):
            index[step.step_id] = len(requests)
            requests.append(WorkloadRequest(
                request_id=f"{session.session_id}/{step.step_id}",
                arrival_s=session.arrival_s,
                num_prompt_tokens=step.num_prompt_tokens,
                num_output_tokens=step.num_output_tokens,
                block_hashes=step.block_hashes,
                hash_block_size=step.hash_block_size,
                task=session.app,
                session_id=session.session_id,
                step_index=number,
                num_appended_tokens=step.num_appended_tokens,
            ))
            parents.append(tuple(index[w] for w in step.wait_for))
            waits.append(step.tool_wait_s)
            earliest.append(session.arrival_s + step.arrival_offset_s)
    if not requests:
        raise ValueError("no sessions")
    graph = SessionGraph(tuple(parents), tuple(waits), tuple(earliest))
    return Workload(tuple(requests), duration_s, name, graph)


# ---- release logic ----------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """Request `index` is issued at `time_s`."""

    time_s: float
    index: int


@dataclass(frozen=True)
class SessionTimeline:
    """When each step of a session workload ends if every step takes its `step_s` and
    nothing queues: issued as `StepReleases` issues it, at the later of its own arrival
    and its last parent's end plus its tool wait (`SessionGraph.release_s`)."""

    end_s: np.ndarray
    wait_s: np.ndarray  # from its last parent's end to its issue (0: a first step)

    @classmethod
    def of(cls, workload: Workload, step_s: Sequence[float] | np.ndarray) -> SessionTimeline:
        graph = workload.graph
        if graph is None:
            raise ValueError("a session timeline needs a workload of agent sessions")
        end_s, wait_s = np.empty(len(workload)), np.zeros(len(workload))
        for i, request in enumerate(workload.requests):  # parents come before children
            parents = graph.parents[i]
            if parents:
                last_end_s = max(end_s[p] for p in parents)
                issue_s = graph.issue_after_s(i, last_end_s)
                wait_s[i] = issue_s - last_end_s
            else:
                issue_s = graph.release_s(i, request.arrival_s)
            end_s[i] = issue_s + step_s[i]
        return cls(end_s, wait_s)



@dataclass
class StepReleases:
    """When each request of a workload is issued: open loop (at its arrival) or, with a
    session graph, closed loop (when its parents ended, plus its tool wait; a step that
    waits for none at its arrival), never before the earliest time the graph gives it.

    A request whose parent was rejected, or never finished, is never issued: the
    session cannot go on without that step's answer. `cancelled` lists them so the
    substrate can count them as not served.
    """

    requests: Sequence[WorkloadRequest]
    graph: SessionGraph | None = None
    _num_waiting_on: list[int] = field(init=False)
    _children: list[list[int]] = field(init=False)
    _roots: list[int] = field(init=False)
    _root_rank: dict[int, int] = field(init=False)
    _released: set[int] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        if self.graph is None:
            self._roots = list(range(len(self.requests)))
            self._children = []
            self._num_waiting_on = []
        else:
            if len(self.graph.parents) != len(self.requests):
                raise ValueError("the session graph does not match the requests")
            self._roots = sorted(self.graph.roots, key=self._root_s)
            self._children = self.graph.children()
            self._num_waiting_on = [len(p) for p in self.graph.parents]
        self._root_rank = {index: rank for rank, index in enumerate(self._roots)}

    @property
    def closed_loop(self) -> bool:
        return self.graph is not None

    def first(self) -> Release | None:
        """The first arrival (the others follow one at a time: `after_arrival`)."""
        return self._root(0)

    def after_arrival(self, index: int) -> Release | None:
        """The next first-step arrival after request `index` arrived, if it was one."""
        self._released.add(index)
        rank = self._root_rank.get(index)
        return None if rank is None else self._root(rank + 1)

    def _root(self, rank: int) -> Release | None:
        if rank >= len(self._roots):
            return None
        index = self._roots[rank]
        return Release(self._root_s(index), index)

    def _root_s(self, index: int) -> float:
        arrival_s = self.requests[index].arrival_s
        return arrival_s if self.graph is None else self.graph.release_s(index, arrival_s)

    def after_end(self, index: int, now: float, finished: bool) -> tuple[list[Release], list[int]]:
        """(requests now ready, requests cancelled) when request `index` ended at `now`;
        `finished`: it produced its whole output (else it was rejected or lost)."""
        if self.graph is None:
            return [], []
        if not finished:
            return [], self._cancel_below(index)
        ready = []
        for child in self._children[index]:
            self._num_waiting_on[child] -= 1
            if self._num_waiting_on[child] == 0 and child not in self._released:
                ready.append(Release(self.graph.issue_after_s(child, now), child))
        return ready, []

    def _cancel_below(self, index: int) -> list[int]:
        cancelled, stack = [], list(self._children[index])
        while stack:
            child = stack.pop()
            if child in self._released:
                continue
            self._released.add(child)
            cancelled.append(child)
            stack.extend(self._children[child])
        return sorted(cancelled)

    def unreleased(self) -> list[int]:
        """Requests never issued (the run stopped first), in index order."""
        return [i for i in range(len(self.requests)) if i not in self._released]

    def issued(self, index: int, now: float) -> WorkloadRequest:
        """Request `index` as issued at `now` (its deadline counts from then)."""
        request = self.requests[index]
        if self.graph is None or request.arrival_s == now:
            return request
        return replace(request, arrival_s=now)


# ---- presets ----------------------------------------------------------------------


class SessionPreset(StrEnum):
    CODING_AGENT = "coding-agent"
    CHAT_AGENT = "chat-agent"
    RESEARCH_AGENT = "research-agent"


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length or time: `median` and sigma of its log."""

    median: float
    sigma: float

    def draw(self, rng: np.random.Generator) -> float:
        return float(self.median * math.exp(self.sigma * rng.standard_normal()))


@dataclass(frozen=True)
class ToolWait:
    """Heavy-tailed tool time: log-normal, except a `long_share` of calls that run
    log-uniformly between `long_min_s` and `long_max_s` (TraceLab: about 4% of tool
    calls exceed a minute and hold 85% of tool time)."""

    short: LogNormal
    long_share: float
    long_min_s: float
    long_max_s: float

    def draw(self, rng: np.random.Generator, num_calls: int = 1) -> float:
        """The wait for `num_calls` tools run at once: the longest of them."""
        waits = []
        for _ in range(max(num_calls, 1)):
            if rng.random() < self.long_share:
                waits.append(math.exp(rng.uniform(math.log(self.long_min_s),
                                                  math.log(self.long_max_s))))
            else:
                waits.append(self.short.draw(rng))
        return max(waits)


@dataclass(frozen=True)
class SessionShape:
    """The distributions a preset draws sessions from; token figures are fractions of
    the served model's context limit where they say so, else tokens."""

    app_prefix_share: float  # shared system prompt + tools, share of the context limit
    first_context_share: LogNormal  # the session's own first context, share of the limit
    appended_tokens: LogNormal  # per step: tool output or user message
    output_tokens: LogNormal
    max_output_tokens: int
    num_steps: LogNormal  # steps per session (rounded up, at least 1)
    max_steps: int
    tool_wait: ToolWait
    tool_calls_per_step: float  # mean tools run at once (1 + Poisson extra)
    fan_out_share: float  # steps that fan out into parallel calls joined by the next step
    max_fan_out: int
    compact_share: float  # context share past which the agent compacts its history
    summary_share: float  # what compaction leaves of the history, share of the limit
    num_apps: int  # applications (each with its own shared prefix)
    # share of the output length's log-variance that is the session's own (its steps are
    # alike: one agent, task and tool set); the rest varies step to step
    session_output_share: float = 0.5
    # steps of each parallel branch (a sub-agent working on its own history before the
    # join); None: every branch is one call
    branch_steps: LogNormal | None = None


PRESETS: dict[SessionPreset, SessionShape] = {
    # TraceLab (Claude Code / Codex): median step 116k-126k cached tokens of a 200k
    # window (~0.6), 875 appended, 214 generated; 9.2 steps per session (p99 137);
    # 10.8 tool calls per 8.8 steps, parallel calls common; 4% of tools over a minute.
    SessionPreset.CODING_AGENT: SessionShape(
        app_prefix_share=0.08, first_context_share=LogNormal(0.3, 0.6),
        appended_tokens=LogNormal(875, 1.2), output_tokens=LogNormal(214, 1.0),
        max_output_tokens=4096, num_steps=LogNormal(4.0, 1.25), max_steps=137,
        tool_wait=ToolWait(LogNormal(1.2, 1.0), 0.04, 60.0, 600.0),
        tool_calls_per_step=1.23, fan_out_share=0.08, max_fan_out=4,
        compact_share=0.9, summary_share=0.15, num_apps=2,
    ),
    # Mooncake conversation trace: mean input 12k (median 6.9k, p99 85k) of a 128k
    # window, output mean 343 (median 350, cap 2000), 36.6% of blocks a prefix seen
    # before; turns separated by user think time, occasional tool calls.
    SessionPreset.CHAT_AGENT: SessionShape(
        app_prefix_share=0.015, first_context_share=LogNormal(0.02, 1.2),
        appended_tokens=LogNormal(600, 1.3), output_tokens=LogNormal(330, 0.7),
        max_output_tokens=2000, num_steps=LogNormal(2.2, 0.9), max_steps=40,
        tool_wait=ToolWait(LogNormal(8.0, 0.9), 0.02, 60.0, 300.0),
        tool_calls_per_step=1.0, fan_out_share=0.0, max_fan_out=1,
        compact_share=0.9, summary_share=0.05, num_apps=4,
    ),
    # An orchestrator that hands parts of its task to parallel sub-agents (Anthropic's
    # multi-agent research system: 3-5 sub-agents at once, each calling tools over
    # several steps; a join step reads what each returned). Every sub-agent starts from
    # the orchestrator's context, so the branches share a long prefix, then each grows
    # its own history with search results until the orchestrator joins them.
    SessionPreset.RESEARCH_AGENT: SessionShape(
        app_prefix_share=0.04, first_context_share=LogNormal(0.03, 0.8),
        appended_tokens=LogNormal(1500, 1.0), output_tokens=LogNormal(300, 0.9),
        max_output_tokens=4096, num_steps=LogNormal(12.0, 0.6), max_steps=80,
        tool_wait=ToolWait(LogNormal(2.0, 0.8), 0.03, 30.0, 300.0),
        tool_calls_per_step=1.5, fan_out_share=0.5, max_fan_out=5,
        compact_share=0.8, summary_share=0.1, num_apps=3,
        branch_steps=LogNormal(3.0, 0.5),
    ),
}


def _block_id(*key: object) -> int:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class _Context:
    """A branch of a session's history while it is drawn: its tokens and block ids."""

    num_tokens: int
    block_hashes: list[int]
    origin: str  # names the blocks this branch adds

    def extend(self, num_tokens: int, block_size: int) -> _Context:
        """This context with `num_tokens` more at the end (its own new blocks)."""
        total = self.num_tokens + num_tokens
        kept = self.block_hashes[: self.num_tokens // block_size]
        new = [_block_id(self.origin, k) for k in range(len(kept), total // block_size)]
        return _Context(total, kept + new, self.origin)


@dataclass
class SessionBuilder:
    """Draws one session of a preset's shape for a model with `context_limit` tokens."""

    shape: SessionShape
    context_limit: int
    rng: np.random.Generator
    block_size: int = SESSION_BLOCK_TOKENS

    def build(self, session_id: str, arrival_s: float) -> AgentSession:
        shape, rng = self.shape, self.rng
        app = int(rng.integers(shape.num_apps))
        prefix_tokens = max(int(shape.app_prefix_share * self.context_limit), self.block_size)
        root = _Context(0, [], f"app{app}").extend(prefix_tokens, self.block_size)
        base = replace(root, origin=session_id)
        first = self._share(shape.first_context_share)
        context = base.extend(first, self.block_size)
        num_steps = min(max(math.ceil(shape.num_steps.draw(rng)), 1), shape.max_steps)
        spread = shape.output_tokens.sigma
        own = shape.session_output_share
        outputs = LogNormal(
            shape.output_tokens.median * math.exp(spread * math.sqrt(own)
                                                  * rng.standard_normal()),
            spread * math.sqrt(1.0 - own))
        steps: list[AgentStep] = []
        waits: tuple[str, ...] = ()
        tool_wait, appended = 0.0, first
        while len(steps) < num_steps or self._joins_sub_agents(waits):
            fan = 1 if self._joins_sub_agents(waits) else self._fan_out(num_steps - len(steps))
            branch_ends = []
            for branch in range(fan):
                extra = appended if branch == 0 else self._tokens(shape.appended_tokens)
                prompt = (context if branch == 0 else
                          replace(context, origin=f"{session_id}/{len(steps)}")
                          .extend(extra, self.block_size))
                branch_ends.append(self._branch(
                    steps, prompt, extra, outputs, waits, tool_wait,
                    self._branch_length(fan), session_id))
            context, appended = self._next_context(base, branch_ends, session_id)
            waits = tuple(b[0] for b in branch_ends)
            tool_wait = self._tool_wait()
        return AgentSession(session_id, arrival_s, tuple(steps), f"app{app}", prefix_tokens)

    def _branch(self, steps: list[AgentStep], prompt: _Context, extra: int,
                outputs: LogNormal, waits: tuple[str, ...], tool_wait: float,
                length: int, session_id: str) -> tuple[str, _Context, int]:
        """Appends a branch of `length` chained calls to `steps`, the first on `prompt`
        after `waits`, each later one on its predecessor's context, output and a tool
        output; returns the last call's id, prompt and output."""
        while True:
            step_id = f"{len(steps)}"
            output = min(max(round(outputs.draw(self.rng)), 1), self.shape.max_output_tokens)
            output = max(min(output, self.context_limit - prompt.num_tokens - 1), 1)
            steps.append(AgentStep(step_id, waits, tool_wait, prompt.num_tokens, extra,
                                   output, tuple(prompt.block_hashes), self.block_size))
            length -= 1
            if length <= 0:
                return step_id, prompt, output
            extra = self._tokens(self.shape.appended_tokens)
            grown = replace(prompt, origin=f"{session_id}/{step_id}+").extend(
                output + extra, self.block_size)
            if grown.num_tokens + self.shape.max_output_tokens > self.context_limit:
                return step_id, prompt, output
            prompt, waits, tool_wait = grown, (step_id,), self._tool_wait()

    def _joins_sub_agents(self, waits: tuple[str, ...]) -> bool:
        """Whether sub-agents just ran in parallel: their orchestrator always reads
        what they returned, in one more step, however many steps the session had."""
        return self.shape.branch_steps is not None and len(waits) > 1

    def _branch_length(self, fan: int) -> int:
        """Calls in one parallel branch: one, unless the shape runs sub-agents."""
        if fan < 2 or self.shape.branch_steps is None:
            return 1
        return max(math.ceil(self.shape.branch_steps.draw(self.rng)), 1)

    def _tool_wait(self) -> float:
        shape = self.shape
        return shape.tool_wait.draw(self.rng, 1 + int(self.rng.poisson(
            max(shape.tool_calls_per_step - 1.0, 0.0))))

    def _next_context(self, base: _Context, branches: list[tuple[str, _Context, int]],
                      session_id: str) -> tuple[_Context, int]:
        """The next step's prompt: the first branch's context and output, the other
        branches' outputs and the tool output appended; compacted past the limit."""
        _, main, output = branches[0]
        joined = sum(b[2] for b in branches[1:])
        appended = self._tokens(self.shape.appended_tokens) + joined
        grown = main.extend(output, self.block_size)
        grown = replace(grown, origin=f"{session_id}/{branches[0][0]}+")
        if grown.num_tokens + appended > self.shape.compact_share * self.context_limit:
            summary = self._share(LogNormal(self.shape.summary_share, 0.2))
            fresh = replace(base, origin=f"{session_id}/{branches[0][0]}#")
            grown = fresh.extend(summary, self.block_size)
            appended = min(appended, self.context_limit // 4)
        return grown.extend(appended, self.block_size), appended

    def _fan_out(self, steps_left: int) -> int:
        if steps_left < 2 or self.rng.random() >= self.shape.fan_out_share:
            return 1
        return int(self.rng.integers(2, min(self.shape.max_fan_out, steps_left) + 1))

    def _tokens(self, dist: LogNormal) -> int:
        return min(max(round(dist.draw(self.rng)), 1), self.context_limit // 4)

    def _share(self, dist: LogNormal) -> int:
        share = min(dist.draw(self.rng), self.shape.compact_share * 0.8)
        return max(round(share * self.context_limit), 1)


def preset_sessions(preset: SessionPreset | str, arrival_s: Sequence[float],
                    context_limit: int, seed: int = 0) -> list[AgentSession]:
    """Sessions of `preset` starting at `arrival_s` (ids s0, s1, ...), drawn in order
    from `seed` + 1, for a model with `context_limit` tokens (prompt + output)."""
    preset = SessionPreset(preset)
    if context_limit < 4 * SESSION_BLOCK_TOKENS:
        raise ValueError(f"context limit {context_limit} is too small for agent sessions")
    builder = SessionBuilder(PRESETS[preset], context_limit, np.random.default_rng(seed + 1))
    return [builder.build(f"s{i}", t) for i, t in enumerate(arrival_s)]


def preset_workload(
    preset: SessionPreset | str,
    arrivals: SyntheticArrivals,
    context_limit: int,
    seed: int = 0,
) -> Workload:
    """Sessions of `preset` arriving by `arrivals` (rate in sessions/s), for a model with
    `context_limit` tokens (prompt + output), as a closed-loop workload."""
    preset = SessionPreset(preset)
    if arrivals.kind not in (Arrivals.POISSON, Arrivals.GAMMA):
        raise ValueError(f"sessions arrive by poisson or gamma, not {arrivals.kind.value}")
    times = arrivals.times(seed)
    if not times:
        raise ValueError(f"no sessions arrive: rate {arrivals.rate}/s over "
                         f"{arrivals.duration_s} s")
    sessions = preset_sessions(preset, times, context_limit, seed)
    return sessions_workload(sessions, arrivals.duration_s, f"{preset.value}-{arrivals.label}")


def shaped_preset_workload(preset: SessionPreset | str, profile: RateProfile,
                           context_limit: int, seed: int = 0) -> Workload:
    """Sessions of `preset` whose starts follow `profile` (rates in sessions/s): the
    profile's native process warped to it (`shaped_arrivals`); each session's steps stay
    closed-loop after its start."""
    preset = SessionPreset(preset)
    starts = [t for t, _ in shaped_arrivals(profile, seed)]
    sessions = preset_sessions(preset, starts, context_limit, seed)
    return sessions_workload(sessions, profile.duration_s,
                             f"{preset.value}-{profile.shape.value}")


def shaped_file_workload(path: str | Path, profile: RateProfile, seed: int = 0) -> Workload:
    """A session log whose session starts are time-warped to follow `profile` (sessions/s),
    as `shaped_trace_workload` warps a trace: each session keeps its place in the log's
    sequence; the log repeats when the profile expects more sessions than it holds (the
    k-th repeat's ids end in '~k'; it shares the first pass's prefix blocks)."""
    sessions = sorted(load_session_trace(path), key=lambda s: (s.arrival_s, s.session_id))
    own = [s.arrival_s for s in sessions] if len(sessions) > 1 else None
    drawn = []
    for t, i in shaped_arrivals(profile, seed, own):
        session, repeat = sessions[i % len(sessions)], i // len(sessions)
        name = session.session_id if repeat == 0 else f"{session.session_id}~{repeat}"
        drawn.append(replace(session, session_id=name, arrival_s=t))
    return sessions_workload(drawn, profile.duration_s, f"{Path(path).name}-{profile.shape.value}")


# ---- session trace files -----------------------------------------------------------


class SessionLine(BaseModel):
    """One line of a session log, one step (`load_session_trace` gives the meaning).

    Unknown keys are errors: a misspelt optional field would silently change the replay."""

    model_config = ConfigDict(strict=True, extra="forbid")

    session_id: Identifier
    step_id: Identifier | None = None  # default: its position in the session
    parent: Identifier | list[Identifier] | None = None
    input_tokens: Count
    appended_tokens: Annotated[int, Field(ge=0)] | None = None
    output_tokens: Count
    tool_wait_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    arrival_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    app: Identifier | None = None
    app_prefix_tokens: int = Field(0, ge=0)

    @field_validator("appended_tokens")
    @classmethod
    def _within_input(cls, appended: int | None, info: ValidationInfo) -> int | None:
        limit = info.data.get("input_tokens")
        if appended is not None and limit is not None and appended > limit:
            raise PydanticCustomError("appended_tokens_too_many",
                                      "Input should be at most input_tokens ({limit})",
                                      {"limit": limit})
        return appended

    @field_validator("app_prefix_tokens")
    @classmethod
    def _with_app(cls, num_tokens: int, info: ValidationInfo) -> int:
        if num_tokens and info.data.get("app") is None:  # else silently no shared prefix
            raise PydanticCustomError("app_missing", "Input should come with an 'app'")
        return num_tokens

    @property
    def parents(self) -> tuple[str, ...]:
        if self.parent is None:
            return ()
        return (self.parent,) if isinstance(self.parent, str) else tuple(self.parent)


def load_session_trace(path: str | Path, block_size: int = SESSION_BLOCK_TOKENS
                       ) -> list[AgentSession]:
    """Sessions from a JSONL agent log, one step per line:

    - `session_id`; `step_id` (default: its position in the session); `parent` (a step
      id, a list of them, or null: steps it waits for);
    - `input_tokens` (the whole prompt), `output_tokens`;
    - `appended_tokens`: new at the prompt's end; the rest is shared with its first
      parent's prompt and output. Default: what its input adds to that context, all of
      its input for a step without a parent;
    - `tool_wait_ms` (default 0): from the end of its last parent to when it may be sent;
    - `arrival_ms` (ms from the log's start): on a session's first line, the session's
      start (default 0); on a later line, the earliest the step may be sent, not before
      its session's start. A step is sent at the later of its own arrival and its last
      parent's end plus its tool wait: a log's arrivals are what the user or the
      clock did, the waits what the serving system makes it wait for. Rescaling the
      session rate moves a session's start; its steps keep their offsets from it;
    - `app`, `app_prefix_tokens` (on a session's first line; later lines may repeat
      them): every step of the session's prompts starts with the app's shared prefix,
      whatever it shares with its parent (a step whose history was compacted keeps it).

    Ids are strings or integers; counts are integers; times are numbers. Steps come in
    any order after the ones they wait for. Errors name the file, line and field.
    """
    path = Path(path)
    grouped: dict[str, list[tuple[str, SessionLine]]] = {}
    for where, row in jsonl_rows(path):
        line = parse_row(SessionLine, row, where)
        grouped.setdefault(line.session_id, []).append((where, line))
    if not grouped:
        raise ValueError(f"{path}: no sessions in file")
    return [_file_session(sid, lines, block_size) for sid, lines in grouped.items()]


def _file_session(session_id: str, lines: list[tuple[str, SessionLine]],
                  block_size: int) -> AgentSession:
    first = lines[0][1]
    arrival_s = (first.arrival_ms or 0.0) / 1000
    app = _AppPrefix(first.app, first.app_prefix_tokens, block_size)
    contexts: dict[str, tuple[_Context, int]] = {}  # step id -> (prompt, output)
    steps: list[AgentStep] = []
    for where, line in lines:
        app.check_repeated(line, where)
        step_id = line.step_id if line.step_id is not None else str(len(steps))
        unknown = [p for p in line.parents if p not in contexts]
        if unknown:
            raise row_error(where, "parent", f"{unknown[0]!r} is not an earlier step of "
                                             f"session {session_id!r}")
        offset_s = 0.0
        if line.arrival_ms is not None and steps:
            offset_s = line.arrival_ms / 1000 - arrival_s
            if offset_s < 0:
                raise row_error(where, "arrival_ms", "before its session's start "
                                                     f"({arrival_s * 1000:g} ms)")
        parent = contexts[line.parents[0]] if line.parents else None
        prompt, appended = _step_prompt(line, parent, app, f"{session_id}/{step_id}")
        contexts[step_id] = (prompt, line.output_tokens)
        steps.append(AgentStep(
            step_id, line.parents, line.tool_wait_ms / 1000, line.input_tokens, appended,
            line.output_tokens, tuple(prompt.block_hashes[: line.input_tokens // block_size]),
            block_size, offset_s))
    return AgentSession(session_id, arrival_s, tuple(steps), app.name or "app",
                        app.num_tokens)


@dataclass(frozen=True)
class _AppPrefix:
    """A session's application and the prefix every prompt of it starts with."""

    name: str | None
    num_tokens: int
    block_size: int

    def context(self, num_prompt_tokens: int) -> _Context:
        """The prefix, cut to a prompt of `num_prompt_tokens` (none without an app)."""
        if self.name is None:
            return _Context(0, [], "")
        tokens = min(self.num_tokens, num_prompt_tokens)
        return _Context(0, [], f"app:{self.name}").extend(tokens, self.block_size)

    def check_repeated(self, line: SessionLine, where: str) -> None:
        """A later line may repeat its session's app and prefix, not give others."""
        for name, value in (("app", self.name), ("app_prefix_tokens", self.num_tokens)):
            if name in line.model_fields_set and getattr(line, name) != value:
                raise row_error(where, name, f"differs from its session's first line "
                                             f"({value!r})")


def _step_prompt(line: SessionLine, parent: tuple[_Context, int] | None, app: _AppPrefix,
                 origin: str) -> tuple[_Context, int]:
    """A step's prompt and its appended tokens: the app prefix, then what it shares with
    its first parent's prompt and output, then its own new tokens (named by `origin`)."""
    num_tokens = line.input_tokens
    prefix = app.context(num_tokens)
    base = prefix
    if parent is not None:
        parent_prompt, parent_output = parent
        history = parent_prompt.extend(parent_output, app.block_size)
        if line.appended_tokens is not None:
            shared = num_tokens - line.appended_tokens
        elif num_tokens >= history.num_tokens:  # it extends its parent's context
            shared = history.num_tokens
        else:  # its history was rewritten (compacted): only the app prefix is known
            shared = prefix.num_tokens
        keep = min(shared, history.num_tokens)
        if keep > prefix.num_tokens:
            base = _Context(keep, history.block_hashes[: keep // app.block_size], origin)
    if line.appended_tokens is not None:
        appended = line.appended_tokens
    elif parent is None:  # all of a first prompt is new to its session
        appended = num_tokens
    else:
        appended = num_tokens - base.num_tokens
    prompt = replace(base, origin=origin)
    if num_tokens > base.num_tokens:
        prompt = prompt.extend(num_tokens - base.num_tokens, app.block_size)
    return prompt, appended


def iter_session_rows(sessions: Sequence[AgentSession]) -> Iterator[dict[str, Any]]:
    """The sessions as rows of the JSONL format `load_session_trace` reads, with every
    field it reads: a log written and loaded back gives the same sessions."""
    for session in sessions:
        for number, step in enumerate(session.steps):
            row: dict[str, Any] = {
                "session_id": session.session_id, "step_id": step.step_id,
                "parent": list(step.wait_for) or None, "input_tokens": step.num_prompt_tokens,
                "appended_tokens": step.num_appended_tokens,
                "output_tokens": step.num_output_tokens,
                "tool_wait_ms": _ms(step.tool_wait_s),
            }
            if number == 0:
                row |= {"arrival_ms": _ms(session.arrival_s), "app": session.app,
                        "app_prefix_tokens": session.app_prefix_tokens}
            elif step.arrival_offset_s:
                row["arrival_ms"] = _ms(session.arrival_s + step.arrival_offset_s)
            yield row


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def file_workload(path: str | Path, *, rate: float | None = None,
                  duration_s: float | None = None) -> Workload:
    """A session trace as a closed-loop workload; `rate` (sessions/s) rescales the
    session arrivals, `duration_s` keeps sessions arriving within it."""
    sessions = sorted(load_session_trace(path), key=lambda s: s.arrival_s)
    start = sessions[0].arrival_s
    span = sessions[-1].arrival_s - start
    factor = 1.0
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if len(sessions) < 2 or span <= 0:
            raise ValueError("rescaling needs sessions starting at different times")
        factor = (len(sessions) - 1) / span / rate
    sessions = [replace(s, arrival_s=(s.arrival_s - start) * factor) for s in sessions]
    if duration_s is not None:
        sessions = [s for s in sessions if s.arrival_s < duration_s]
    if not sessions:
        raise ValueError("the window selects no sessions")
    window = duration_s if duration_s is not None else max(sessions[-1].arrival_s, 1e-9)
    return sessions_workload(sessions, window, Path(path).name)
