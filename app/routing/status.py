"""Black-box instance status: EMA estimates of q_g, p_g and d_g per instance.

GoodServe's latency estimate T(r,g) = q_g + (L_in - H_rg) p_g + L_out d_g needs, for
every instance, the average queueing delay before prefill (q_g), the per-token
prefill time (p_g) and the per-token decode time (d_g). Instances are black boxes:
the estimator learns only from what they report (iteration latencies with their
prefill/decode token counts, queue waits). Until an instance has reported, its
figures come from the hardware catalog (unloaded speeds), so a new instance is
usable at once. Clock-agnostic: `now` is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from app.engines.messages import EngineStatus, PrefillTotals
from app.hardware.specs import InstanceSpec
from app.routing.arrays import COLUMNS, ViewArrays, view_row
from app.routing.base import StepListener
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import StepReport


@dataclass(frozen=True)
class InstanceEstimate:
    """The three figures of the latency estimate for one instance."""

    queue_delay_s: float  # q_g
    prefill_s_per_token: float  # p_g
    decode_s_per_token: float  # d_g (time per output token of a running request)
    num_samples: int = 0  # iterations observed; 0 = catalog prior only


@dataclass
class _Ema:
    """Exponential moving average that starts from its first sample."""

    alpha: float
    value: float | None = None

    def update(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            self.value += self.alpha * (sample - self.value)

    def update_repeated(self, sample: float, count: int) -> None:
        """`count` updates with the same sample, in one step (a polled mean)."""
        if self.value is None:
            self.value = sample
        else:
            self.value += (1.0 - (1.0 - self.alpha) ** count) * (sample - self.value)


DEPARTURE_WINDOW = 32  # recent finishes used for the departure rate
# lists of instances whose estimates are kept between calls: every instance, and the
# subsets that can hold long contexts
KEPT_ESTIMATES = 4


@dataclass
class _Departures:
    """Recent finish times of one instance: its departure rate is the finishes after
    the first over the span from it to `now`, so an instance that stopped finishing
    loses rate (`_Terms.queue_s`)."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=DEPARTURE_WINDOW))
    seen: int = 0  # finished-counter value already taken


@dataclass
class _InstanceState:
    """Per-instance smoothing state (the estimator's only mutable data)."""

    queue_delay: _Ema
    decode_iteration: _Ema
    decode_batch: _Ema  # decoding sequences in the iterations behind decode_iteration
    prefill_step_s: _Ema  # ratio of EMAs: prefill time / prefill tokens
    prefill_step_tokens: _Ema
    num_samples: int = 0
    seen_iterations: int = 0  # counters from polled EngineStatus
    seen_queue_waits: int = 0
    seen_prefill: PrefillTotals | None = None  # None until the first polled report
    departures: _Departures = field(default_factory=_Departures)


def newest_entries(window: tuple[float, ...], counter: int, seen: int) -> tuple[float, ...]:
    """The entries of a bounded recent-window that came after the counter read `seen`."""
    num_new = min(counter - seen, len(window))
    return window[len(window) - num_new :]


def catalog_prior(spec: InstanceSpec) -> InstanceEstimate:
    """Unloaded speeds from the hardware model: what a fresh instance is assumed to do."""
    return InstanceEstimate(
        queue_delay_s=0.0,
        prefill_s_per_token=spec.unloaded_prefill_s_per_token,
        decode_s_per_token=spec.unloaded_decode_s_per_token,
    )


class StatusEstimator(StepListener):
    """EMA estimator of (q_g, p_g, d_g), fed by step reports or polled statuses.

    `alpha` is the EMA smoothing weight of a new sample (0 < alpha <= 1).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._states: dict[InstanceId, _InstanceState] = {}
        self._table = _StateTable()
        self._estimates: list[_Estimates] = []  # newest first

    def _state(self, instance_id: InstanceId) -> _InstanceState:
        """The instance's state, to read or update (its table row is refreshed before
        the next vectorised estimate)."""
        state = self._states.get(instance_id)
        if state is None:
            a = self.alpha
            state = _InstanceState(_Ema(a), _Ema(a), _Ema(a), _Ema(a), _Ema(a))
            self._states[instance_id] = state
        self._table.dirty.add(instance_id)
        return state

    # ---- samples -------------------------------------------------------------
    def observe_iteration(
        self,
        instance_id: InstanceId,
        duration_s: float,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        now: float,
    ) -> None:
        """One engine iteration: decoding requests each waited `duration_s` for a token;
        prefill tokens cost `duration_s` between them (mixed batches included, since
        that is what a new prompt really pays on a busy instance)."""
        if duration_s < 0:
            raise ValueError(f"negative iteration duration {duration_s}")
        state = self._state(instance_id)
        if num_decode_seqs > 0:
            state.decode_iteration.update(duration_s)
            state.decode_batch.update(float(num_decode_seqs))
        if num_prefill_tokens > 0:
            state.prefill_step_s.update(duration_s)
            state.prefill_step_tokens.update(float(num_prefill_tokens))
        state.num_samples += 1

    def observe_queue_wait(self, instance_id: InstanceId, wait_s: float, now: float) -> None:
        self._state(instance_id).queue_delay.update(max(wait_s, 0.0))

    # ---- substrate callbacks -------------------------------------------------
    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self.observe_iteration(
            instance_id, report.duration_s, report.num_prefill_tokens, report.num_decode_seqs, now
        )
        self._take_new_queue_waits(instance_id, report.status, now)
        self._take_new_finishes(instance_id, report.status, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        """A polled report (live router): take only what is newer than the last poll.

        Window iteration latencies update d_g, at the batch size the engine reports
        now; the prefill counters' growth updates p_g (`_take_new_prefill`).
        """
        state = self._state(status.engine_id)
        batch = max(status.num_running, 1)
        durations = status.recent_iteration_s
        for duration in newest_entries(durations, status.num_iterations, state.seen_iterations):
            self.observe_iteration(status.engine_id, duration, 0, batch, now)
        state.seen_iterations = status.num_iterations
        self._take_new_prefill(state, status.prefill)
        self._take_new_queue_waits(status.engine_id, status, now)
        self._take_new_finishes(status.engine_id, status, now)

    @staticmethod
    def _take_new_prefill(state: _InstanceState, totals: PrefillTotals) -> None:
        """The prefill iterations since the last poll, as that many samples of their
        mean duration and mean tokens: the EMAs `observe_iteration` keeps per
        iteration, fed from counters so no iteration between polls is lost.

        The first report only sets the baseline: its totals span the engine's whole
        life (a router replica may join an engine that has run for hours, on other
        work), and a mean over them would stand for the engine's speed until many
        fresh iterations outweighed it."""
        if state.seen_prefill is not None:
            new = totals.since(state.seen_prefill)
            if new.num_iterations > 0 and new.num_tokens > 0:
                count = new.num_iterations
                state.prefill_step_s.update_repeated(new.busy_s / count, count)
                state.prefill_step_tokens.update_repeated(new.num_tokens / count, count)
        state.seen_prefill = totals

    def _take_new_finishes(self, instance_id: InstanceId, status: EngineStatus, now: float):
        departures = self._state(instance_id).departures
        for _ in range(min(status.num_finished - departures.seen, DEPARTURE_WINDOW)):
            departures.times.append(now)
        departures.seen = max(status.num_finished, departures.seen)

    def _take_new_queue_waits(self, instance_id: InstanceId, status: EngineStatus, now: float):
        state = self._state(instance_id)
        waits = status.recent_queue_wait_s
        for wait in newest_entries(waits, status.num_queue_wait_samples, state.seen_queue_waits):
            self.observe_queue_wait(instance_id, wait, now)
        state.seen_queue_waits = max(status.num_queue_wait_samples, state.seen_queue_waits)

    def forget(self, instance_id: InstanceId) -> None:
        """Drop an instance that left the pool (churn); a new one with the id starts fresh."""
        self._states.pop(instance_id, None)
        self._table.dirty.add(instance_id)

    # ---- estimates -----------------------------------------------------------
    def estimate(
        self, view: InstanceView, now: float | None = None, joining: int = 1,
        priority: int | None = None,
    ) -> InstanceEstimate:
        """Current (q_g, p_g, d_g) for a request about to join (`joining` = 1, the
        router) or already there (0, the watchdog); catalog prior for figures not yet
        observed.

        An idle instance runs at its unloaded speed whatever it reported while busy,
        and nobody queues where nothing waits: both cases use the live counts in
        `view`, so stale EMAs from a past burst (or missing reports) do not linger.
        `now` (default: the view's time) dates the departure rate. `priority`: the
        joining request's engine priority; where the engine runs its queue by
        priority, q_g counts only the waiting requests that run before it (None: the
        whole queue).
        """
        state = self._states.get(view.instance_id)
        row = _NO_STATE_ROW if state is None else _state_row(state)
        terms = _Terms.of_row(row, view_row(view), joining)
        ahead = (None if priority is None or view.waiting_priorities is None
                 else view.num_waiting_ahead(priority))
        return InstanceEstimate(terms.queue_s(view.updated_s if now is None else now, ahead),
                                terms.prefill, terms.decode,
                                0 if state is None else state.num_samples)

    def estimate_arrays(self, arrays: ViewArrays, now: float, joining: int = 1,
                        priority: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_g, p_g, d_g) for every instance of `arrays` at once: `estimate` over
        columns, equal to it figure for figure.

        Between two decisions only a few instances report or change their counts, so
        the terms that do not depend on `now` are kept (for the last `KEPT_ESTIMATES`
        lists of instances and `joining` values asked) and recomputed only for the rows
        whose state or columns changed; the queue's Little's-law part, which ages with
        `now`, is recomputed for the rows that have one."""
        dirty = self._table.refresh(self._states)
        for kept in self._estimates:
            kept.stale |= dirty
        cache = next((c for c in self._estimates if c.joining == joining and (
            c.ids is arrays.ids or c.ids == arrays.ids)), None)
        if cache is None:
            cache = _Estimates.of(arrays, self._table.rows(arrays.ids), joining)
            self._estimates = [cache, *self._estimates[:KEPT_ESTIMATES - 1]]
        else:
            cache.update(arrays, self._table)
        ahead = (None if priority is None or arrays.waiting_priorities is None
                 else arrays.num_waiting_ahead(priority))
        return cache.at(now, ahead)


# `_StateTable` columns
_S_KNOWN, _S_QUEUE, _S_DECODE, _S_BATCH, _S_PREFILL_S, _S_PREFILL_TOKENS = range(6)
_S_FINISHES, _S_FIRST_FINISH = 6, 7
_NUM_STATE_COLUMNS = 8


class _StateTable:
    """The estimator's per-instance state as rows of floats, refreshed only for the
    instances whose state changed since the last vectorised estimate. Row 0 stands
    for an instance with no state (catalog prior)."""

    def __init__(self) -> None:
        self.dirty: set[InstanceId] = set()
        self._row: dict[InstanceId, int] = {}
        self._table = np.zeros((1, _NUM_STATE_COLUMNS))

    def refresh(self, states: dict[InstanceId, _InstanceState]) -> set[InstanceId]:
        """Rewrite the rows of the instances whose state changed: those instances."""
        dirty, self.dirty = self.dirty, set()
        for instance_id in dirty:
            row = self._row.get(instance_id)
            if row is None:
                row = self._row[instance_id] = len(self._table)
                self._table = np.vstack([self._table, np.zeros((1, _NUM_STATE_COLUMNS))])
            state = states.get(instance_id)
            self._table[row] = _NO_STATE if state is None else _state_row(state)
        return dirty

    def rows(self, ids: Sequence[InstanceId]) -> np.ndarray:
        """The state rows of `ids`, in order (row 0 for an instance never seen)."""
        return self._table[[self._row.get(i, 0) for i in ids]]

    def row(self, instance_id: InstanceId) -> list[float]:
        return self._table[self._row.get(instance_id, 0)].tolist()


_NO_STATE_ROW = [0.0] * _NUM_STATE_COLUMNS
_NO_STATE = np.array(_NO_STATE_ROW)


def _state_row(state: _InstanceState) -> list[float]:
    """What `StatusEstimator.estimate` reads of a state; nan for an EMA with no sample."""
    def value(ema: _Ema) -> float:
        return math.nan if ema.value is None else ema.value

    times = state.departures.times
    return [1.0, state.queue_delay.value or 0.0, value(state.decode_iteration),
            state.decode_batch.value or 1.0, value(state.prefill_step_s),
            value(state.prefill_step_tokens), len(times), times[0] if times else math.nan]


class _Terms(NamedTuple):
    """One instance's estimate terms that do not age with `now` (q_g's Little's-law
    part does: `queue_s`). A decision recomputes them only for the instances that
    changed, so they are computed a row at a time, with the float operations of the
    columns' `_terms`.

    d_g is the measured decode step time grown by the hardware model's batch line from
    the batch it was measured at to the running batch plus the `joining` requests.
    Requests still waiting are not counted: an engine that leaves requests waiting runs
    a full batch (slots or KV), and the wait is q_g's part (Little's law on the queue);
    counting them made weak instances look slower than they ran under a steady queue
    (docs/goodserve-routing.md, "decode batch growth")."""

    waiting: float
    queue_ema: float  # the observed-wait EMA where requests wait, else 0
    departed: float  # finishes in the window - 1, where Little's law applies, else 0
    first_finish_s: float
    prefill: float  # p_g
    decode: float  # d_g

    @classmethod
    def of_row(cls, state: Sequence[float], view: Sequence[float], joining: int) -> _Terms:
        """From a state row (`_state_row`) and the instance's view columns (`view_row`)."""
        running, waiting = view[_RUNNING], view[_WAITING]
        known = state[_S_KNOWN] > 0 and running + waiting > 0
        queues = known and waiting > 0
        finishes = state[_S_FINISHES]
        prefill_s, prefill_tokens, decode = (state[_S_PREFILL_S], state[_S_PREFILL_TOKENS],
                                             state[_S_DECODE])
        intercept, slope = view[_INTERCEPT], view[_SLOPE]
        growth = max((intercept + slope * min(running + joining, view[_MAX_NUM_SEQS]))
                     / (intercept + slope * state[_S_BATCH]), 1.0)
        return cls(
            waiting, state[_S_QUEUE] if queues else 0.0,
            finishes - 1 if queues and finishes >= 2 else 0.0, state[_S_FIRST_FINISH],
            prefill_s / prefill_tokens if known and prefill_tokens > 0 else view[_PRIOR_P],
            decode * growth if known and decode >= 0 else view[_PRIOR_D])

    def queue_s(self, now: float, num_ahead: float | None = None) -> float:
        """q_g: the observed-wait EMA, raised to Little's law on the current queue
        (waiting / departure rate). Observed waits are only known once requests leave
        the queue, so the EMA lags a growing queue; Little's law sees it at once.

        `num_ahead` (an engine in priority mode): the waiting requests that run before
        the joining one take the queue's place; with none ahead nothing queues before
        it."""
        if num_ahead is None:
            num_ahead = self.waiting
        elif num_ahead <= 0:
            return 0.0
        span = now - self.first_finish_s
        if self.departed > 0 and span > 0:
            rate = self.departed / span
            return max(self.queue_ema, num_ahead / rate)
        return self.queue_ema


_RUNNING, _WAITING, _PRIOR_P, _PRIOR_D, _INTERCEPT, _SLOPE, _MAX_NUM_SEQS = (
    COLUMNS.index(name) for name in (
        "num_running", "num_waiting", "unloaded_prefill_s_per_token",
        "unloaded_decode_s_per_token", "batch_intercept", "batch_slope", "max_num_seqs"))


@dataclass
class _Estimates:
    """`estimate_arrays`' answer for one list of instances, kept between calls: the
    `_Terms` as columns, and the view table they were computed from."""

    ids: tuple[InstanceId, ...]
    joining: int
    table: np.ndarray  # the view columns the terms were computed from
    waiting: np.ndarray
    queue_ema: np.ndarray
    departed: np.ndarray
    first_finish_s: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    queued: np.ndarray  # the rows whose queue ages with `now` (departed > 0)
    stale: set[InstanceId] = field(default_factory=set)  # state changed since computed

    @classmethod
    def of(cls, arrays: ViewArrays, state: np.ndarray, joining: int) -> _Estimates:
        waiting, queue_ema, departed, first_finish_s, prefill, decode = _terms(
            state, arrays.table, joining)
        return cls(arrays.ids, joining, arrays.table, waiting, queue_ema, departed,
                   first_finish_s, prefill, decode, np.flatnonzero(departed > 0))

    def update(self, arrays: ViewArrays, table: _StateTable) -> None:
        """Recompute the rows whose state is stale or whose view columns changed."""
        width = arrays.table.shape[1]
        changed = set((np.flatnonzero(arrays.table != self.table) // width).tolist())
        row_of = arrays.row_of
        changed.update(row_of[i] for i in self.stale if i in row_of)
        self.stale.clear()
        self.table = arrays.table
        if not changed:
            return
        columns = (self.waiting, self.queue_ema, self.departed, self.first_finish_s,
                   self.prefill, self.decode)
        for row in changed:
            terms = _Terms.of_row(table.row(self.ids[row]), self.table[row].tolist(),
                                  self.joining)
            for column, value in zip(columns, terms, strict=True):
                column[row] = value
        self.queued = np.flatnonzero(self.departed > 0)

    def at(self, now: float, num_ahead: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_g, p_g, d_g) at `now` (`_Terms.queue_s` over the rows with a queue; with
        `num_ahead` per row in place of the queue)."""
        queue = self.queue_ema.copy()
        waiting = self.waiting
        if num_ahead is not None:
            queue[num_ahead <= 0] = 0.0
            waiting = num_ahead
        rows = self.queued
        if len(rows):
            span = now - self.first_finish_s[rows]
            rate = np.divide(self.departed[rows], span, out=np.zeros(len(rows)),
                             where=span > 0)
            little = np.divide(waiting[rows], rate, out=np.zeros(len(rows)),
                               where=rate > 0)
            queue[rows] = np.maximum(queue[rows], little)
        return queue, self.prefill.copy(), self.decode.copy()


def _terms(state: np.ndarray, view: np.ndarray, joining: int) -> tuple[np.ndarray, ...]:
    """`_Terms.of_row` over rows: (waiting, queue EMA, departed, first finish, p_g, d_g)."""
    running, waiting = view[:, _RUNNING], view[:, _WAITING]
    known = (state[:, _S_KNOWN] > 0) & (running + waiting > 0)
    queues = known & (waiting > 0)
    finishes = state[:, _S_FINISHES]
    departed = np.where(queues & (finishes >= 2), finishes - 1, 0.0)
    queue_ema = np.where(queues, state[:, _S_QUEUE], 0.0)
    p = np.divide(state[:, _S_PREFILL_S], state[:, _S_PREFILL_TOKENS],
                  out=view[:, _PRIOR_P].copy(),
                  where=known & (state[:, _S_PREFILL_TOKENS] > 0))
    intercept, slope = view[:, _INTERCEPT], view[:, _SLOPE]
    upcoming = np.minimum(running + joining, view[:, _MAX_NUM_SEQS])
    growth = np.maximum((intercept + slope * upcoming)
                        / (intercept + slope * state[:, _S_BATCH]), 1.0)
    d = np.where(known & (state[:, _S_DECODE] >= 0), state[:, _S_DECODE] * growth,
                 view[:, _PRIOR_D])
    return waiting.copy(), queue_ema, departed, state[:, _S_FIRST_FINISH].copy(), p, d
