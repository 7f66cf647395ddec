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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from app.engine_types import EngineStatus, PrefillTotals
from app.hardware import InstanceSpec
from app.routing.arrays import ViewArrays
from app.routing.base import StepListener
from app.routing.view import InstanceId, InstanceView, StepReport


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


@dataclass
class _Departures:
    """Recent finish times of one instance -> its departure rate (requests/s)."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=DEPARTURE_WINDOW))
    seen: int = 0  # finished-counter value already taken

    def rate_per_s(self, now: float) -> float | None:
        """Finishes per second over the window up to `now` (None until two finishes);
        measured to `now`, so an instance that stopped finishing loses rate."""
        if len(self.times) < 2:
            return None
        span = now - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else None


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
        self, view: InstanceView, now: float | None = None, joining: int = 1
    ) -> InstanceEstimate:
        """Current (q_g, p_g, d_g) for a request about to join (`joining` = 1, the
        router) or already there (0, the watchdog); catalog prior for figures not yet
        observed.

        An idle instance runs at its unloaded speed whatever it reported while busy,
        and nobody queues where nothing waits: both cases use the live counts in
        `view`, so stale EMAs from a past burst (or missing reports) do not linger.
        `now` (default: the view's time) dates the departure rate.
        """
        prior = catalog_prior(view.spec)
        state = self._states.get(view.instance_id)
        if state is None:
            return prior
        if view.num_outstanding == 0:
            return InstanceEstimate(
                0.0, prior.prefill_s_per_token, prior.decode_s_per_token, state.num_samples
            )
        decode = state.decode_iteration.value
        prefill_s, prefill_tokens = state.prefill_step_s.value, state.prefill_step_tokens.value
        return InstanceEstimate(
            queue_delay_s=self._queue_delay_s(state, view, now),
            prefill_s_per_token=(
                prior.prefill_s_per_token if prefill_s is None else prefill_s / prefill_tokens
            ),
            decode_s_per_token=(
                prior.decode_s_per_token if decode is None
                else decode * self._batch_growth(state, view, joining)
            ),
            num_samples=state.num_samples,
        )

    def estimate_arrays(self, arrays: ViewArrays, now: float,
                        joining: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_g, p_g, d_g) for every instance of `arrays` at once: `estimate` over
        columns, equal to it figure for figure."""
        self._table.refresh(self._states)
        state = self._table.rows(arrays.ids)
        running, waiting = arrays.column("num_running"), arrays.column("num_waiting")
        known = (state[:, _S_KNOWN] > 0) & (running + waiting > 0)
        # Little's law where requests wait: waiting / departure rate (0 without a rate)
        finishes = state[:, _S_FINISHES]
        span = now - state[:, _S_FIRST_FINISH]  # nan without a finish
        rate = np.divide(finishes - 1, span, out=np.zeros(len(span)),
                         where=(finishes >= 2) & (span > 0))
        little = np.divide(waiting, rate, out=np.zeros(len(rate)), where=rate > 0)
        queue = np.where(known & (waiting > 0), np.maximum(state[:, _S_QUEUE], little), 0.0)
        p = np.divide(state[:, _S_PREFILL_S], state[:, _S_PREFILL_TOKENS],
                      out=arrays.column("unloaded_prefill_s_per_token").copy(),
                      where=known & (state[:, _S_PREFILL_TOKENS] > 0))
        upcoming = np.minimum(running + joining, arrays.column("max_num_seqs"))
        intercept, slope = arrays.column("batch_intercept"), arrays.column("batch_slope")
        growth = np.maximum((intercept + slope * upcoming)
                            / (intercept + slope * state[:, _S_BATCH]), 1.0)
        d = np.where(known & (state[:, _S_DECODE] >= 0), state[:, _S_DECODE] * growth,
                     arrays.column("unloaded_decode_s_per_token"))
        return queue, p, d

    @staticmethod
    def _batch_growth(state: _InstanceState, view: InstanceView, joining: int) -> float:
        """How much slower a step will be with the running batch (+ the `joining`
        requests) than at the batch size the EMA was measured at.

        The measured speed is the truth at the measured load; the hardware model only
        supplies the shape of speed vs batch size. Requests still waiting are not
        counted: an engine that leaves requests waiting runs a full batch (slots or
        KV), and the wait is q_g's part of T (Little's law on the queue). Counting
        them as well made weak instances look slower than they ran under a steady
        queue (docs/goodserve-routing.md, "decode batch growth").
        """
        measured = state.decode_batch.value or 1.0
        upcoming = view.num_running + joining
        if view.max_num_seqs is not None:  # the rest wait; q_g covers them
            upcoming = min(upcoming, view.max_num_seqs)
        intercept, slope = view.spec.decode_batch_line
        return max((intercept + slope * upcoming) / (intercept + slope * measured), 1.0)

    @staticmethod
    def _queue_delay_s(state: _InstanceState, view: InstanceView, now: float | None) -> float:
        """q_g: the EMA of observed waits, raised to Little's law on the current queue.

        Observed waits are only known once requests leave the queue, so the EMA lags a
        growing queue; `num_waiting / departure rate` sees it at once.
        """
        if view.num_waiting == 0:
            return 0.0
        ema = state.queue_delay.value or 0.0
        rate = state.departures.rate_per_s(view.updated_s if now is None else now)
        little = view.num_waiting / rate if rate else 0.0
        return max(ema, little)


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
        self._lookup: tuple[tuple[InstanceId, ...], np.ndarray] = ((), np.zeros(0, np.int64))

    def refresh(self, states: dict[InstanceId, _InstanceState]) -> None:
        for instance_id in self.dirty:
            row = self._row.get(instance_id)
            if row is None:
                row = self._row[instance_id] = len(self._table)
                self._table = np.vstack([self._table, np.zeros((1, _NUM_STATE_COLUMNS))])
                self._lookup = ((), self._lookup[1])
            state = states.get(instance_id)
            self._table[row] = _NO_STATE if state is None else _state_row(state)
        self.dirty.clear()

    def rows(self, ids: Sequence[InstanceId]) -> np.ndarray:
        """The state rows of `ids`, in order (row 0 for an instance never seen)."""
        if self._lookup[0] != ids:  # tuples compare by identity first: cheap when unchanged
            self._lookup = (tuple(ids), np.array([self._row.get(i, 0) for i in ids],
                                                 dtype=np.int64))
        return self._table[self._lookup[1]]


_NO_STATE = np.zeros(_NUM_STATE_COLUMNS)


def _state_row(state: _InstanceState) -> np.ndarray:
    """What `StatusEstimator.estimate` reads of a state; nan for an EMA with no sample."""
    def value(ema: _Ema) -> float:
        return np.nan if ema.value is None else ema.value

    times = state.departures.times
    return np.array([1.0, state.queue_delay.value or 0.0, value(state.decode_iteration),
                     state.decode_batch.value or 1.0, value(state.prefill_step_s),
                     value(state.prefill_step_tokens), len(times),
                     times[0] if times else np.nan])
