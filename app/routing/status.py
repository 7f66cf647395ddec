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

import functools
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

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

    def update(self, samples: Iterable[float]) -> None:
        """One step per sample, in order (a run of iterations in one call)."""
        value, alpha = self.value, self.alpha
        for sample in samples:
            value = sample if value is None else value + alpha * (sample - value)
        self.value = value

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
    loses rate (`_queue_s`)."""

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
        warm_up()
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
    def observe_iterations(
        self,
        instance_id: InstanceId,
        durations_s: Sequence[float],
        num_prefill_tokens: int,
        num_decode_seqs: int,
    ) -> None:
        """Engine iterations of one batch shape, in order, each an EMA sample as if
        reported alone: decoding requests each waited an iteration's duration for a
        token; prefill tokens cost it between them (mixed batches included, since that
        is what a new prompt really pays on a busy instance)."""
        if min(durations_s) < 0:
            raise ValueError(f"negative iteration duration {min(durations_s)}")
        state = self._state(instance_id)
        count = len(durations_s)
        if num_decode_seqs > 0:
            state.decode_iteration.update(durations_s)
            state.decode_batch.update(itertools.repeat(float(num_decode_seqs), count))
        if num_prefill_tokens > 0:
            state.prefill_step_s.update(durations_s)
            state.prefill_step_tokens.update(itertools.repeat(float(num_prefill_tokens), count))
        state.num_samples += count

    def observe_queue_wait(self, instance_id: InstanceId, wait_s: float, now: float) -> None:
        self._state(instance_id).queue_delay.update((max(wait_s, 0.0),))

    # ---- substrate callbacks -------------------------------------------------
    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        """The report's iterations; requests that started or finished in them did so
        by the end of the first (`StepReport`), where departures are dated."""
        self.observe_iterations(instance_id, report.durations_s, report.num_prefill_tokens,
                                report.num_decode_seqs)
        self._take_new_queue_waits(instance_id, report.status, report.first_end_s)
        self._take_new_finishes(instance_id, report.status, report.first_end_s)

    def on_status(self, status: EngineStatus, now: float) -> None:
        """A polled report (live router): take only what is newer than the last poll.

        Window iteration latencies update d_g, at the batch size the engine reports
        now; the prefill counters' growth updates p_g (`_take_new_prefill`).
        """
        state = self._state(status.engine_id)
        batch = max(status.num_running, 1)
        durations = status.recent_iteration_s
        new = newest_entries(durations, status.num_iterations, state.seen_iterations)
        if new:
            self.observe_iterations(status.engine_id, new, 0, batch)
        state.seen_iterations = status.num_iterations
        self._take_new_prefill(state, status.prefill)
        self._take_new_queue_waits(status.engine_id, status, now)
        self._take_new_finishes(status.engine_id, status, now)

    @staticmethod
    def _take_new_prefill(state: _InstanceState, totals: PrefillTotals) -> None:
        """The prefill iterations since the last poll, as that many samples of their
        mean duration and mean tokens: the EMAs `observe_iterations` keeps per
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

    def _take_new_queue_waits(self, instance_id: InstanceId, status: EngineStatus,
                              now: float) -> None:
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
        row = _NO_STATE if state is None else np.array(_state_row(state))
        ahead = (WHOLE_QUEUES if priority is None or view.waiting_priorities is None
                 else np.array([float(view.num_waiting_ahead(priority))]))
        queue, prefill, decode = _estimate_row(
            row, np.array(view_row(view)), joining,
            view.updated_s if now is None else now, ahead)
        return InstanceEstimate(queue, prefill, decode, 0 if state is None else state.num_samples)

    def estimate_arrays(self, arrays: ViewArrays, now: float, joining: int = 1,
                        priority: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_g, p_g, d_g) for every instance of `arrays` at once: `estimate` over
        columns, equal to it figure for figure (`terms` and `queues_at`)."""
        terms = self.terms(arrays, joining)
        queue = queues_at(terms, num_ahead_of(arrays, priority), now)
        return queue, terms[:, TERM_PREFILL].copy(), terms[:, TERM_DECODE].copy()

    def terms(self, arrays: ViewArrays, joining: int = 1) -> np.ndarray:
        """The estimate terms that do not age with `now` for every instance of
        `arrays` (rows of `_row_terms`; read-only, valid until the next call).

        Between two decisions only a few instances report or change their counts, so
        the terms are kept (for the last `KEPT_ESTIMATES` lists of instances and
        `joining` values asked) and recomputed only for the rows whose state or columns
        changed; the queue's Little's-law part, which ages with `now`, is computed from
        them when read (`queues_at`, or a compiled caller's own pass)."""
        self._table.refresh(self._states)
        cache = next((c for c in self._estimates if c.joining == joining and (
            c.ids is arrays.ids or c.ids == arrays.ids)), None)
        if cache is None:
            cache = _Estimates.of(arrays, self._table, joining)
            self._estimates = [cache, *self._estimates[:KEPT_ESTIMATES - 1]]
        else:
            cache.update(arrays, self._table)
        return cache.terms


# `_StateTable` columns
_S_KNOWN, _S_QUEUE, _S_DECODE, _S_BATCH, _S_PREFILL_S, _S_PREFILL_TOKENS = range(6)
_S_FINISHES, _S_FIRST_FINISH = 6, 7
_NUM_STATE_COLUMNS = 8


class _StateTable:
    """The estimator's per-instance state as rows of floats, refreshed only for the
    instances whose state changed since the last vectorised estimate, each rewrite
    counted in the row's version (kept estimates recompute the rows whose version
    moved). Row 0 stands for an instance with no state (catalog prior)."""

    def __init__(self) -> None:
        self.dirty: set[InstanceId] = set()
        self._row: dict[InstanceId, int] = {}
        self.ids: list[InstanceId] = []  # in row order, from row 1
        self._table = np.zeros((1, _NUM_STATE_COLUMNS))
        self._versions = np.zeros(1, dtype=np.int64)

    def refresh(self, states: dict[InstanceId, _InstanceState]) -> None:
        """Rewrite the rows of the instances whose state changed."""
        if not self.dirty:
            return
        dirty, self.dirty = self.dirty, set()
        for instance_id in dirty:
            row = self._row.get(instance_id)
            if row is None:
                row = self._row[instance_id] = len(self._table)
                self.ids.append(instance_id)
                self._table = np.vstack([self._table, np.zeros((1, _NUM_STATE_COLUMNS))])
                self._versions = np.append(self._versions, 0)
            state = states.get(instance_id)
            self._table[row] = _NO_STATE if state is None else _state_row(state)
            self._versions[row] += 1

    @property
    def table(self) -> np.ndarray:
        return self._table

    @property
    def versions(self) -> np.ndarray:
        """Per row, how often it was rewritten."""
        return self._versions

    def row_index(self, instance_id: InstanceId) -> int:
        """The instance's row (0 for an instance never seen)."""
        return self._row.get(instance_id, 0)

    def rows_of(self, ids: Sequence[InstanceId]) -> np.ndarray:
        """The rows of `ids`, in order."""
        return np.array([self._row.get(i, 0) for i in ids], dtype=np.int64)


_NO_STATE = np.zeros(_NUM_STATE_COLUMNS)


def _state_row(state: _InstanceState) -> list[float]:
    """What `StatusEstimator.estimate` reads of a state; nan for an EMA with no sample."""
    def value(ema: _Ema) -> float:
        return math.nan if ema.value is None else ema.value

    times = state.departures.times
    return [1.0, state.queue_delay.value or 0.0, value(state.decode_iteration),
            state.decode_batch.value or 1.0, value(state.prefill_step_s),
            value(state.prefill_step_tokens), len(times), times[0] if times else math.nan]


# `_row_terms` columns, as `StatusEstimator.terms` gives them
TERM_WAITING, TERM_QUEUE_EMA, TERM_DEPARTED, TERM_FIRST_FINISH, TERM_PREFILL, TERM_DECODE = (
    range(6))
_NUM_TERMS = 6
WHOLE_QUEUES = np.empty(0)  # `num_ahead_of`: each instance's whole queue


@njit(cache=True)
def _row_terms(state: np.ndarray, view: np.ndarray, joining: int
               ) -> tuple[float, float, float, float, float, float]:
    """One instance's estimate terms that do not age with `now` (q_g's Little's-law
    part does: `_queue_s`): (waiting, the observed-wait EMA where requests wait, the
    finishes in the window less one where Little's law applies, the first finish's
    time, p_g, d_g), from a state row (`_state_row`) and its view columns (`view_row`).

    d_g is the measured decode step time grown by the hardware model's batch line from
    the batch it was measured at to the running batch plus the `joining` requests.
    Requests still waiting are not counted: an engine that leaves requests waiting runs
    a full batch (slots or KV), and the wait is q_g's part (Little's law on the queue);
    counting them made weak instances look slower than they ran under a steady queue
    (docs/goodserve-routing.md, "decode batch growth")."""
    running, waiting = view[_RUNNING], view[_WAITING]
    known = state[_S_KNOWN] > 0 and running + waiting > 0
    queues = known and waiting > 0
    finishes = state[_S_FINISHES]
    prefill_s, prefill_tokens, decode = (state[_S_PREFILL_S], state[_S_PREFILL_TOKENS],
                                         state[_S_DECODE])
    intercept, slope = view[_INTERCEPT], view[_SLOPE]
    growth = max((intercept + slope * min(running + joining, view[_MAX_NUM_SEQS]))
                 / (intercept + slope * state[_S_BATCH]), 1.0)
    return (waiting, state[_S_QUEUE] if queues else 0.0,
            finishes - 1 if queues and finishes >= 2 else 0.0, state[_S_FIRST_FINISH],
            prefill_s / prefill_tokens if known and prefill_tokens > 0 else view[_PRIOR_P],
            decode * growth if known and decode >= 0 else view[_PRIOR_D])


@njit(cache=True)
def _write_terms(terms: np.ndarray, row: int, state: np.ndarray, view: np.ndarray,
                 joining: int) -> None:
    """`terms[row]` = `_row_terms` of the state row and view columns."""
    (terms[row, 0], terms[row, 1], terms[row, 2], terms[row, 3], terms[row, 4],
     terms[row, 5]) = _row_terms(state, view, joining)


@njit(cache=True)
def _queue_s(queue_ema: float, num_ahead: float, departed: float, first_finish_s: float,
             now: float) -> float:
    """q_g: the observed-wait EMA, raised to Little's law on the `num_ahead` requests
    that run before the joining one (waiting / departure rate). Observed waits are
    only known once requests leave the queue, so the EMA lags a growing queue;
    Little's law sees it at once. With none ahead (an engine in priority mode) nothing
    queues before it."""
    if num_ahead <= 0:
        return 0.0
    span = now - first_finish_s
    if departed > 0 and span > 0:
        return max(queue_ema, num_ahead / (departed / span))
    return queue_ema


@njit(cache=True)
def _refresh_terms(states: np.ndarray, versions: np.ndarray, state_rows: np.ndarray,
                   seen_versions: np.ndarray, view: np.ndarray, seen_view: np.ndarray,
                   joining: int, terms: np.ndarray) -> None:
    """Recompute `terms`' rows (`_row_terms`, one row per instance) whose state row's
    version differs from `seen_versions` or whose view columns differ from
    `seen_view`; both take the new ones."""
    for row in range(view.shape[0]):
        state_row = state_rows[row]
        changed = versions[state_row] != seen_versions[row]
        if not changed:
            for column in range(view.shape[1]):
                if view[row, column] != seen_view[row, column]:
                    changed = True
                    break
        if changed:
            seen_versions[row] = versions[state_row]
            seen_view[row] = view[row]
            _write_terms(terms, row, states[state_row], view[row], joining)


@njit(cache=True)
def queue_of_row(terms: np.ndarray, num_ahead: np.ndarray, row: int, now: float) -> float:
    """q_g of `terms`' row at `now` (`_queue_s`); `num_ahead` empty: the whole queue."""
    ahead = terms[row, TERM_WAITING] if len(num_ahead) == 0 else num_ahead[row]
    return _queue_s(terms[row, TERM_QUEUE_EMA], ahead, terms[row, TERM_DEPARTED],
                    terms[row, TERM_FIRST_FINISH], now)


@njit(cache=True)
def _estimate_row(state: np.ndarray, view: np.ndarray, joining: int, now: float,
                  num_ahead: np.ndarray) -> tuple[float, float, float]:
    """(q_g, p_g, d_g) of one instance (`num_ahead` as `queue_of_row` reads it)."""
    terms = np.empty((1, _NUM_TERMS))
    _write_terms(terms, 0, state, view, joining)
    return queue_of_row(terms, num_ahead, 0, now), terms[0, TERM_PREFILL], terms[0, TERM_DECODE]


@njit(cache=True)
def queues_at(terms: np.ndarray, num_ahead: np.ndarray, now: float) -> np.ndarray:
    """q_g of every row of `terms` at `now` (`queue_of_row`)."""
    queue = np.empty(terms.shape[0])
    for row in range(terms.shape[0]):
        queue[row] = queue_of_row(terms, num_ahead, row, now)
    return queue


def num_ahead_of(arrays: ViewArrays, priority: int | None) -> np.ndarray:
    """The waiting requests ahead of a joining request of `priority` on each instance
    of `arrays`, for `queues_at`: empty where each instance's whole queue is."""
    if priority is None or arrays.waiting_priorities is None:
        return WHOLE_QUEUES
    return arrays.num_waiting_ahead(priority)


_RUNNING, _WAITING, _PRIOR_P, _PRIOR_D, _INTERCEPT, _SLOPE, _MAX_NUM_SEQS = (
    COLUMNS.index(name) for name in (
        "num_running", "num_waiting", "unloaded_prefill_s_per_token",
        "unloaded_decode_s_per_token", "batch_intercept", "batch_slope", "max_num_seqs"))


@dataclass
class _Estimates:
    """`estimate_arrays`' answer for one list of instances, kept between calls: the
    terms of `_row_terms` per row, the state rows they read (and those rows' versions)
    and the view table they were computed from."""

    ids: tuple[InstanceId, ...]
    joining: int
    state_rows: np.ndarray  # each instance's `_StateTable` row
    seen_versions: np.ndarray  # the state rows' versions the terms were computed from
    seen_view: np.ndarray  # the view columns the terms were computed from
    terms: np.ndarray  # (instances, _NUM_TERMS)
    num_mapped: int = 0  # `_StateTable.ids` already looked up in `state_rows`

    @classmethod
    def of(cls, arrays: ViewArrays, table: _StateTable, joining: int) -> _Estimates:
        kept = cls(arrays.ids, joining, table.rows_of(arrays.ids),
                   np.full(len(arrays), -1, dtype=np.int64),
                   np.full_like(arrays.table, np.nan), np.empty((len(arrays), _NUM_TERMS)),
                   len(table.ids))
        kept.update(arrays, table)
        return kept

    def update(self, arrays: ViewArrays, table: _StateTable) -> None:
        """Recompute the rows whose state or view columns changed (instances that got
        a state row since the last call first take theirs)."""
        if self.num_mapped < len(table.ids):
            row_of = arrays.row_of
            for instance_id in table.ids[self.num_mapped:]:
                row = row_of.get(instance_id)
                if row is not None:
                    self.state_rows[row] = table.row_index(instance_id)
            self.num_mapped = len(table.ids)
        _refresh_terms(table.table, table.versions, self.state_rows, self.seen_versions,
                       arrays.table, self.seen_view, self.joining, self.terms)


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the estimator's passes before the
    first estimate is asked for."""
    states, view = np.zeros((1, _NUM_STATE_COLUMNS)), np.ones((1, len(COLUMNS)))
    for num_ahead in (WHOLE_QUEUES, np.ones(1)):
        _estimate_row(states[0], view[0], 1, 0.0, num_ahead)
    terms, rows = np.empty((1, _NUM_TERMS)), np.zeros(1, dtype=np.int64)
    _refresh_terms(states, rows, rows, rows - 1, view, view.copy(), 1, terms)
    queues_at(terms, WHOLE_QUEUES, 0.0)
