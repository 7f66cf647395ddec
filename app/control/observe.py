"""What the controller observes over an interval, and how it predicts the next one.

The routers report each arrival (prompt length, and for an agent step the tokens its
cached context does not cover) and each completion (output length, deadline met or
not); the controller closes the window every interval into one `IntervalStats`. Agent
sessions are reported step by step too (`SessionEvent`s into `SessionTracker`): which
sessions are open, the context they hold between steps, and the steps they are still
expected to send. Plain bookkeeping: `now` is an argument, no clock is read.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from app.planning.pools import Observation

SESSION_IDLE_TIMEOUT_S = 900.0  # an open session silent this long counts as finished
SESSION_MEMORY = 2000  # finished sessions and step gaps the estimates remember


@dataclass(frozen=True)
class IntervalStats:
    """One closed observation window."""

    start_s: float
    end_s: float
    arrivals: int
    finished: int
    met: int
    mean_input_len: float
    cv_input_len: float
    mean_output_len: float
    # agent steps: prompt tokens their cached context does not cover (None: none reported)
    mean_uncached_len: float | None = None
    cv_uncached_len: float | None = None
    session_starts: int = 0  # agent sessions whose first step arrived in the window
    open_sessions: int = 0  # sessions started and not finished at the window's end
    committed_rps: float | None = None  # steps/s the open sessions will still send
    held_kv_tokens: float | None = None  # context held in tool waits (time mean, tokens)

    @property
    def rate_rps(self) -> float:
        return self.arrivals / (self.end_s - self.start_s)

    @property
    def session_start_rps(self) -> float:
        return self.session_starts / (self.end_s - self.start_s)

    @property
    def slo_attainment(self) -> float:
        """Share of the interval's completions that met their deadline (1 if none)."""
        return self.met / self.finished if self.finished else 1.0

    def observation(self, rate_rps: float) -> Observation:
        """SARA's observe stage at a predicted rate. The context sessions hold between
        steps grows with the load (Little's law): it is scaled by the predicted over the
        observed rate, never below what was held."""
        held = self.held_kv_tokens
        if held is not None and self.rate_rps > 0:
            held *= max(rate_rps / self.rate_rps, 1.0)
        return Observation(rate_rps, self.mean_input_len, self.cv_input_len,
                           self.mean_output_len, self.mean_uncached_len, self.cv_uncached_len,
                           held_kv_tokens=held)


class SessionEventKind(IntEnum):
    """An agent step's events, in the order a step has them (ties in time sort so)."""

    ISSUED = 0  # the step arrived (a session's first: the session starts)
    DONE = 1  # the step ended
    ANSWERED = 2  # its reply was read and is the session's final answer (no tool call)


@dataclass(frozen=True)
class SessionEvent:
    """One agent step's arrival or end, as the router that served it saw it."""

    session_id: str
    kind: SessionEventKind
    time_s: float  # the router's clock (wall time, as the controller's)
    context_tokens: int = 0  # DONE: the step's prompt + output
    ends_session: bool = False  # DONE: its answer ends the session

    @property
    def sort_key(self) -> tuple[float, int]:
        """The order the controller's window takes events in: by time, a step's arrival
        before its end."""
        return self.time_s, self.kind


@dataclass
class LoadReport:
    """Arrival and completion tallies, with the agent steps' events: what one router
    adds up between two reports to the controller, and what the controller's window
    sums over every router."""

    arrivals: int = 0
    input_sum: float = 0.0
    input_sq: float = 0.0
    finished: int = 0
    met: int = 0
    output_sum: float = 0.0
    uncached: int = 0  # arrivals that reported their uncached tokens (agent steps)
    uncached_sum: float = 0.0
    uncached_sq: float = 0.0
    # agent steps' arrivals and ends, in the order recorded (not necessarily by time)
    session_events: list[SessionEvent] = field(default_factory=list)

    def arrival(self, num_prompt_tokens: int, num_uncached_tokens: int | None = None) -> None:
        self.arrivals += 1
        self.input_sum += num_prompt_tokens
        self.input_sq += float(num_prompt_tokens) ** 2
        if num_uncached_tokens is not None:
            self.uncached += 1
            self.uncached_sum += num_uncached_tokens
            self.uncached_sq += float(num_uncached_tokens) ** 2

    def completion(self, num_output_tokens: int, met_deadline: bool) -> None:
        self.finished += 1
        self.met += int(met_deadline)
        self.output_sum += num_output_tokens

    def step_issued(self, session_id: str, now: float) -> None:
        """A step of agent session `session_id` arrived (recorded with its arrival)."""
        self.session_events.append(SessionEvent(session_id, SessionEventKind.ISSUED, now))

    def step_done(self, session_id: str, now: float, context_tokens: int,
                  ends_session: bool) -> None:
        """A step of `session_id` ended with `context_tokens` of context (prompt +
        output); `ends_session`: its answer ends the session."""
        self.session_events.append(SessionEvent(session_id, SessionEventKind.DONE, now,
                                                context_tokens, ends_session))

    def session_answered(self, session_id: str, now: float) -> None:
        """The reply a step of `session_id` ended with is the session's final answer
        (an agent's reply without a tool call), as the API layer reads it after the
        step's end."""
        self.session_events.append(SessionEvent(session_id, SessionEventKind.ANSWERED, now))

    def merge(self, other: LoadReport) -> None:
        for name in ("arrivals", "input_sum", "input_sq", "finished", "met", "output_sum",
                     "uncached", "uncached_sum", "uncached_sq"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.session_events.extend(other.session_events)

    @property
    def is_empty(self) -> bool:
        return not (self.arrivals or self.finished or self.session_events)


def _moments(count: int, total: float, squares: float) -> tuple[float, float]:
    """(mean, CV) from a count, a sum and a sum of squares (mean >= 1, CV >= 0.05)."""
    mean = total / count
    variance = max(squares / count - mean * mean, 0.0)
    return max(mean, 1.0), max(math.sqrt(variance) / max(mean, 1.0), 0.05)


class LoadWindow:
    """Accumulates router reports between two interval boundaries.

    Length moments carry over from earlier windows when a window saw no arrival
    (an idle interval does not erase what is known about the traffic). The mean output
    length is weighted by completions over recent windows, each window's weight decaying
    by `output_memory`: the completions of one window are biased towards long requests
    when the load falls (the short ones have finished), and once arrivals stop the last
    stragglers alone would make every engine look many times slower than it is.
    Agent sessions go to `sessions`, whose estimates look `commit_horizon_s` ahead: the
    sim shell calls it as steps happen; the session events of merged router reports wait
    for the window's close and go in then, every router's sorted together by
    `SessionEvent.sort_key` (a router reports every second, the window closes every
    interval, so the steps of one session served by different routers keep their order).
    Events stamped after the close wait for the next window; an end whose arrival the
    tracker never saw (a report lost, or a controller restarted since) is left out."""

    def __init__(self, start_s: float, default_input_len: float = 512.0,
                 default_output_len: float = 256.0, output_memory: float = 0.5,
                 commit_horizon_s: float = 30.0) -> None:
        if not 0 <= output_memory < 1:
            raise ValueError(f"output_memory must be in [0, 1), got {output_memory}")
        self._start_s = start_s
        self._tally = LoadReport()
        self._last_input = (default_input_len, 1.0)
        self._last_uncached: tuple[float, float] | None = None
        self._last_output = default_output_len
        self._output_memory = output_memory
        self._output_sums = (0.0, 0.0)  # decayed (output tokens, completions)
        self.sessions = SessionTracker(start_s, commit_horizon_s)

    def arrival(self, num_prompt_tokens: int, num_uncached_tokens: int | None = None) -> None:
        self._tally.arrival(num_prompt_tokens, num_uncached_tokens)

    def finished(self, num_output_tokens: int, met_deadline: bool) -> None:
        self._tally.completion(num_output_tokens, met_deadline)

    def merge(self, report: LoadReport) -> None:
        """Add a router's tallies and session events since its last report."""
        self._tally.merge(report)

    def _feed_sessions(self, events: list[SessionEvent], now: float) -> list[SessionEvent]:
        """Into `sessions`, in time order, the events up to `now`; those after it."""
        later = []
        for event in sorted(events, key=lambda e: e.sort_key):
            if event.time_s > now:
                later.append(event)
            elif event.kind is SessionEventKind.ISSUED:
                self.sessions.step_issued(event.session_id, event.time_s)
            elif event.kind is SessionEventKind.ANSWERED:
                self.sessions.session_answered(event.session_id, event.time_s)
            elif self.sessions.num_in_flight(event.session_id):
                self.sessions.step_done(event.session_id, event.time_s,
                                        event.context_tokens, event.ends_session)
        return later

    def close(self, now: float) -> IntervalStats:
        """The window [start, now) as stats; a new window starts at `now`."""
        if not now > self._start_s:
            raise ValueError(f"window end {now} must be after its start {self._start_s}")
        t = self._tally
        later = self._feed_sessions(t.session_events, now)
        if t.arrivals:
            self._last_input = _moments(t.arrivals, t.input_sum, t.input_sq)
        if t.uncached:
            self._last_uncached = _moments(t.uncached, t.uncached_sum, t.uncached_sq)
        if t.finished:
            tokens, count = (x * self._output_memory for x in self._output_sums)
            self._output_sums = (tokens + t.output_sum, count + t.finished)
            self._last_output = max(self._output_sums[0] / self._output_sums[1], 1.0)
        uncached = self._last_uncached or (None, None)
        sessions = self.sessions.close(now)
        stats = IntervalStats(self._start_s, now, t.arrivals, t.finished, t.met,
                              *self._last_input, self._last_output, *uncached,
                              sessions.starts, sessions.open, sessions.committed_rps,
                              sessions.held_kv_tokens)
        self._start_s = now
        self._tally = LoadReport(session_events=later)
        return stats


@dataclass(frozen=True)
class SessionStats:
    """What `SessionTracker.close` reports for one window."""

    starts: int  # sessions whose first step arrived in the window
    open: int  # sessions open at its end
    committed_rps: float | None  # steps/s the open sessions will send over the horizon
    held_kv_tokens: float | None  # time mean of the context held in tool waits; None: no session


@dataclass
class _OpenSession:
    last_event_s: float  # its last step's arrival or end
    num_steps: int = 0  # steps issued so far
    in_flight: int = 0  # issued and not finished
    context_tokens: int = 0  # the last finished step's prompt + output

    @property
    def in_tool_wait(self) -> bool:
        return self.in_flight == 0


class SessionTracker:
    """Agent sessions as the routers see them: each step's arrival and its end, with the
    session's context (prompt + output) and whether the answer ends the session (an
    agent's final answer carries no tool call; in the simulator, a step no other step
    waits for). A session silent for `idle_timeout_s` in a tool wait counts as finished.

    Two estimates for the controller, from what a live router could know:
    - **held context**: the time mean, over the window, of the context tokens of the
      sessions in a tool wait (between a step's end and the next one's arrival), total
      over the pool: KV those sessions keep on the engines;
    - **committed steps**: an open session that has issued k steps will issue
      r(k) = E[n - k | n >= k] more (at least one while it waits on a tool), n ranging
      over the step counts of the last `memory` finished sessions. An open session sends
      its later steps at the pace p = later steps issued / open session-seconds (Little's
      law over recent windows, each older window's weight times `pace_memory`: queueing
      and tool waits slow it as they slow the sessions), so over the horizon H it sends
      min(r(k), p H). The committed rate is the sum over the open sessions, over H.
      Finished sessions are biased towards short ones while long ones are still open,
      so early in a run r(k) errs low (towards what the arrivals alone say).
    Reports come in time order; one stamped earlier than the last counts at the last."""

    def __init__(self, start_s: float, horizon_s: float,
                 idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S,
                 memory: int = SESSION_MEMORY, pace_memory: float = 0.5) -> None:
        if not horizon_s > 0 or not idle_timeout_s > 0:
            raise ValueError("the horizon and the idle time-out must be > 0 s")
        if not 0 <= pace_memory < 1:
            raise ValueError(f"pace_memory must be in [0, 1), got {pace_memory}")
        self.horizon_s = horizon_s
        self.idle_timeout_s = idle_timeout_s
        self.pace_memory = pace_memory
        self._open: dict[str, _OpenSession] = {}
        self._totals: deque[int] = deque(maxlen=memory)  # steps of finished sessions
        self._starts = 0
        self._held = 0  # context tokens of the sessions in a tool wait, now
        self._held_area = 0.0  # integral of _held over the window
        self._later = 0  # steps after a session's first, issued in the window
        self._open_area = 0.0  # integral of the number of open sessions over the window
        self._pace_sums = (0.0, 0.0)  # decayed (later steps, open session-seconds) before
        self._start_s = self._last_s = start_s
        self._seen = False

    def step_issued(self, session_id: str, now: float) -> None:
        """A step of `session_id` arrived (its first: the session starts)."""
        self._advance(now)
        session = self._open.get(session_id)
        if session is None:
            session = self._open[session_id] = _OpenSession(now)
            self._starts += 1
            self._seen = True
        elif session.in_tool_wait:
            self._held -= session.context_tokens
        self._later += session.num_steps > 0
        session.last_event_s = now
        session.num_steps += 1
        session.in_flight += 1

    def step_done(self, session_id: str, now: float, context_tokens: int,
                  ends_session: bool) -> None:
        """A step of `session_id` finished with `context_tokens` of context (prompt +
        output); `ends_session`: its answer ends the session."""
        session = self._open.get(session_id)
        if session is None or session.in_flight == 0:
            raise ValueError(f"session {session_id!r} has no step in flight")
        self._advance(now)
        session.in_flight -= 1
        session.last_event_s = now
        session.context_tokens = context_tokens
        if not session.in_tool_wait:
            return  # a parallel call of the same step is still running
        if ends_session:
            self._end(session_id)
        else:
            self._held += context_tokens

    def session_answered(self, session_id: str, now: float) -> None:
        """`session_id` got its final answer after its step ended: in its tool wait
        with no step running, it ends and its context is no longer held (otherwise a
        later step or the idle time-out decides)."""
        session = self._open.get(session_id)
        if session is None or not session.in_tool_wait:
            return
        self._advance(now)
        self._end_waiting(session_id)

    def num_in_flight(self, session_id: str) -> int:
        """Steps of `session_id` issued and not ended (0 for a session not open)."""
        session = self._open.get(session_id)
        return 0 if session is None else session.in_flight

    def _end(self, session_id: str) -> None:
        self._totals.append(self._open.pop(session_id).num_steps)

    def _end_waiting(self, session_id: str) -> None:
        """End a session in its tool wait: the context it held is held no more."""
        self._held -= self._open[session_id].context_tokens
        self._end(session_id)

    def _advance(self, now: float) -> None:
        now = max(now, self._last_s)
        self._held_area += self._held * (now - self._last_s)
        self._open_area += len(self._open) * (now - self._last_s)
        self._last_s = now

    def close(self, now: float) -> SessionStats:
        """The window ending at `now`; the next starts there."""
        self._advance(now)
        span = now - self._start_s
        held = self._held_area / span if self._seen and span > 0 else None
        for session_id, session in list(self._open.items()):
            if session.in_tool_wait and now - session.last_event_s >= self.idle_timeout_s:
                self._end_waiting(session_id)
        stats = SessionStats(self._starts, len(self._open), self.committed_rps(), held)
        later, area = (x * self.pace_memory for x in self._pace_sums)
        self._pace_sums = (later + self._later, area + self._open_area)
        self._starts, self._later, self._held_area, self._open_area = 0, 0, 0.0, 0.0
        self._start_s = now
        return stats

    def pace_per_s(self) -> float:
        """Later steps an open session sends per second (recent windows and this one)."""
        later = self._pace_sums[0] + self._later
        area = self._pace_sums[1] + self._open_area
        return later / area if area > 0 else 0.0

    def committed_rps(self) -> float | None:
        """Steps/s the open sessions will send over the horizon; None before any session
        finished (nothing to estimate the steps left from)."""
        if not self._totals:
            return None
        totals = np.sort(np.fromiter(self._totals, dtype=float))
        suffix = np.concatenate((np.cumsum(totals[::-1])[::-1], [0.0]))
        per_session = self.pace_per_s() * self.horizon_s
        steps = 0.0
        for session in self._open.values():
            k = session.num_steps
            i = int(np.searchsorted(totals, k, side="left"))
            left = suffix[i] / (len(totals) - i) - k if i < len(totals) else 0.0
            if session.in_tool_wait:
                left = max(left, 1.0)
            steps += min(left, per_session)
        return steps / self.horizon_s


class RatePredictor:
    """Holt's linear smoothing of interval rates: level + trend, one interval ahead.

    Dynamo's planner predicts with ARIMA-style models; a level and a trend is the
    smallest model that anticipates a ramp instead of trailing it by an interval."""

    def __init__(self, level_weight: float = 0.5, trend_weight: float = 0.3) -> None:
        for name, value in (("level_weight", level_weight), ("trend_weight", trend_weight)):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        self.level_weight, self.trend_weight = level_weight, trend_weight
        self._level: float | None = None
        self._trend = 0.0

    def update(self, rate_rps: float) -> float:
        """Record an observed rate; return the forecast for the next interval (>= 0)."""
        if self._level is None:
            self._level = rate_rps
        else:
            previous = self._level
            self._level = (self.level_weight * rate_rps
                           + (1 - self.level_weight) * (previous + self._trend))
            self._trend = (self.trend_weight * (self._level - previous)
                           + (1 - self.trend_weight) * self._trend)
        return max(self._level + self._trend, 0.0)
