"""Output-length estimates for routing: L_out_hat at arrival and at re-prediction.

Routing code asks one question: "how many tokens will this request produce in
total, given it has produced `num_generated` so far?". Three answers:
- `PredictorLength` wraps any `predictor.Predictor` (MoE, MLP, history, ...);
- `RunningHistoryLength` is the label-free history baseline a router can always
  run: the conditional median of recently finished lengths (Past-Future style),
  and, since it holds the whole distribution, a confident (high-quantile) total;
- `TrueLength`: the true output length (goodserve-exact-lengths, simulator only).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from numba import njit

from app.routing.base import StepListener
from app.routing.quantiles import SortedWindow, kaplan_meier_quantile
from app.routing.view import FinishReport, RouteRequest
from predictor.ranks import quantile_rank

if TYPE_CHECKING:
    from predictor.base import Predictor

DEFAULT_OUTPUT_TOKENS = 256  # before any request has finished
# the running history's confident length is recomputed after this many finishes
CONFIDENT_REFRESH_FINISHES = 10
MIN_CALIBRATION_SAMPLES = 100  # finished requests before a predictor's spread is trusted


def bounded_output(request: RouteRequest, total: float) -> float:
    """A predicted total never exceeds the request's own max_tokens (when it has one)."""
    cap = request.max_output_tokens
    return total if cap is None else min(total, float(cap))


class OutputLengthEstimator(StepListener, ABC):
    """Predicts a request's total output length (tokens, >= num_generated + 1)."""

    needs_true_output_length: ClassVar[bool] = False  # only exact lengths do
    # learns from finished requests alone, no trained model: its guess can make a short
    # request look hopeless, so triage stays off for short contexts
    label_free: ClassVar[bool] = False

    @abstractmethod
    def predict_total(self, request: RouteRequest, num_generated: int = 0) -> float:
        """Expected total output tokens of `request` after `num_generated` tokens."""

    def expected_output(self, request: RouteRequest) -> float:
        """L_out_hat when the request is routed."""
        return self.predict_total(request, request.num_generated_tokens)

    def confident_output(self, request: RouteRequest, quantile: float) -> float | None:
        """A total the request stays within with probability `quantile`, when this
        estimator knows the spread of its errors; None when it does not (then routing
        has only the point estimate)."""
        return None

    def warm(self, quantile: float) -> bool:
        """Whether its lengths at arrival rest on evidence up to `quantile`. Trained
        and exact estimators start warm; a label-free history is cold while its
        finished lengths do not reach that quantile (at start-up, or after a shift to
        longer outputs, the long requests are still running)."""
        return True

    def predict_totals(
        self, requests: Sequence[RouteRequest], num_generated: Sequence[int]
    ) -> list[float]:
        """Batched `predict_total` (the watchdog re-predicts a whole instance at once)."""
        return [self.predict_total(r, n) for r, n in zip(requests, num_generated, strict=True)]

    def conditional_totals(
        self, requests: Sequence[RouteRequest], num_generated: Sequence[int]
    ) -> list[float]:
        """Totals re-estimated without a new prediction: the arrival estimate's
        distribution, given each request has already produced `num_generated` tokens.
        Estimators whose prediction is already that (history, exact) predict again."""
        return self.predict_totals(requests, num_generated)

    def on_progress(self, req_to_num_generated: Mapping[str, int]) -> None:
        """How far running requests have got (the watchdog reports at each check)."""


class TrueLength(OutputLengthEstimator):
    """Oracle: the request's real output length (needs the substrate to reveal it)."""

    needs_true_output_length: ClassVar[bool] = True

    def predict_total(self, request: RouteRequest, num_generated: int = 0) -> float:
        if request.true_output_tokens is None:
            raise ValueError(f"request {request.request_id}: true output length not revealed")
        return float(max(request.true_output_tokens, num_generated + 1))

    def expected_output(self, request: RouteRequest) -> float:
        return self.predict_total(request, request.num_generated_tokens)

    def confident_output(self, request: RouteRequest, quantile: float) -> float | None:
        """Exact: every quantile of a known length is the length."""
        return self.expected_output(request)


class RunningHistoryLength(OutputLengthEstimator):
    """Median of recently finished lengths above `num_generated` (no labels needed).

    The confident (high-quantile) length also counts the running requests, as lengths
    known to exceed what they have generated so far (Kaplan-Meier): finished lengths
    alone are biased short while long generations are still running - the first
    half-minute of a run, or after a shift to longer outputs.
    """

    label_free: ClassVar[bool] = True

    def __init__(self, window_size: int = 2000, default_tokens: int = DEFAULT_OUTPUT_TOKENS):
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.default_tokens = default_tokens
        self._lengths = SortedWindow(window_size)
        self._req_to_num_generated: dict[str, int] = {}  # running, as last reported
        self._num_finished = 0
        # (num_generated, quantile) -> (confident length, whether finished lengths reach
        # it), kept for CONFIDENT_REFRESH_FINISHES
        self._confident: dict[tuple[int, float], tuple[float, bool]] = {}

    def observe_length(self, num_tokens: int) -> None:
        self._lengths.append(num_tokens)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.observe_length(report.num_output_tokens)
        self._req_to_num_generated.pop(report.request.request_id, None)
        self._num_finished += 1
        if self._num_finished % CONFIDENT_REFRESH_FINISHES == 0:
            self._confident.clear()

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self._req_to_num_generated.pop(request.request_id, None)

    def on_progress(self, req_to_num_generated: Mapping[str, int]) -> None:
        self._req_to_num_generated.update(req_to_num_generated)
        excess = len(self._req_to_num_generated) - self._lengths.size
        if excess > 0:  # requests never reported finished or dropped: oldest first
            for request_id in list(self._req_to_num_generated)[:excess]:
                del self._req_to_num_generated[request_id]

    def predict_total(self, request: RouteRequest, num_generated: int = 0) -> float:
        return self.conditional_quantile(num_generated, 0.5)

    def confident_output(self, request: RouteRequest, quantile: float) -> float | None:
        return self._confident_total(request.num_generated_tokens, quantile)[0]

    def warm(self, quantile: float) -> bool:
        return self._confident_total(0, quantile)[1]

    def _confident_total(self, num_generated: int, quantile: float) -> tuple[float, bool]:
        """(the Kaplan-Meier `quantile` of totals above `num_generated`, whether the
        finished lengths reach it); when they do not, the longest length seen, a
        lower bound. Cached until CONFIDENT_REFRESH_FINISHES more requests finish."""
        start = int(np.searchsorted(self._lengths.sorted, num_generated, side="right"))
        if start == len(self._lengths.sorted):  # nothing finished above: no spread to go on
            return self.conditional_quantile(num_generated, quantile), False
        key = (num_generated, quantile)
        if key not in self._confident:
            finished = self._lengths.sorted[start:]
            censored = sorted(n for n in self._req_to_num_generated.values() if n > num_generated)
            total = kaplan_meier_quantile(finished, censored, quantile)
            self._confident[key] = (total, True) if total is not None else (
                float(max(finished[-1], censored[-1] if censored else 0)), False)
        return self._confident[key]

    def conditional_quantile(self, num_generated: int, quantile: float) -> float:
        """The `quantile` of recently finished lengths longer than `num_generated`."""
        if not self._lengths:
            return float(max(self.default_tokens, num_generated + 1))
        total = self._lengths.quantile_above(num_generated, quantile)
        if total is None:  # outlived everything seen: assume it is about to end
            return float(num_generated + 1)
        return float(total)


class PredictorLength(OutputLengthEstimator):
    """Any trained `Predictor` (MoE, MLP, history, ...) behind the routing interface.

    When the substrate attached this predictor's arrival-time output to the request
    (`predicted_output_tokens`, computed in one batch), routing uses it as is.
    """

    def __init__(self, predictor: Predictor, calibration_window: int = 2000) -> None:
        self.predictor = predictor
        # every ratio window's sorted values, one row each (`_ALL_RATIOS`, then a row per
        # power of two), and their counts: what `_conditional_totals` reads, written in
        # place as the windows slide
        self._ratio_table = np.zeros((_MAX_SCALE + 2, calibration_window))
        self._ratio_counts = np.zeros(_MAX_SCALE + 2, dtype=np.int64)
        # true / predicted length of recently finished requests, prediction made at arrival
        self._ratios = SortedWindow(calibration_window, self._ratio_table[_ALL_RATIOS])
        # the same ratios by the arrival prediction's power of two (row 1 + scale): a
        # short prediction errs by other factors than a long one
        self._ratios_by_scale: dict[int, SortedWindow] = {}
        warm_up()

    def confident_output(self, request: RouteRequest, quantile: float) -> float | None:
        """The arrival prediction scaled by the `quantile` of recent true/predicted
        ratios: the predictor's own error spread, learned from finished requests."""
        if request.num_generated_tokens or len(self._ratios) < MIN_CALIBRATION_SAMPLES:
            return None
        return self.expected_output(request) * self._ratios.quantile(quantile)

    def expected_output(self, request: RouteRequest) -> float:
        if request.predicted_output_tokens is not None and request.num_generated_tokens == 0:
            return float(request.predicted_output_tokens)
        return self.predict_total(request, request.num_generated_tokens)

    def predict_total(self, request: RouteRequest, num_generated: int = 0) -> float:
        return self.predict_totals([request], [num_generated])[0]

    def predict_totals(
        self, requests: Sequence[RouteRequest], num_generated: Sequence[int]
    ) -> list[float]:
        from predictor.base import PredictionInput

        items = [
            PredictionInput(prompt=r.prompt or "", num_generated_tokens=n, task=r.task)
            for r, n in zip(requests, num_generated, strict=True)
        ]
        return [float(x) for x in self.predictor.predict(items)]

    def conditional_totals(
        self, requests: Sequence[RouteRequest], num_generated: Sequence[int]
    ) -> list[float]:
        """The arrival prediction p scaled by how far surviving n tokens moves the
        median of the recent true/predicted ratios: p x median(ratios above n / p) /
        median(ratios), so the total is p itself until the request outlives the early
        enders, with no second call to the predictor. The ratios are those of requests
        predicted in the same power of two as p (64-127 tokens, say) once enough have
        finished. Uncalibrated, the arrival prediction (at least n + 1); outliving every
        ratio seen, n + 1 (about to end, as the history says). A request with no arrival
        prediction attached is predicted again. One compiled pass over the requests,
        reading the sorted windows in place (`_conditional_totals`)."""
        arrival = np.array([math.nan if r.predicted_output_tokens is None
                            else r.predicted_output_tokens for r in requests], dtype=np.float64)
        totals, num_missing = _conditional_totals(
            arrival, np.asarray(num_generated, dtype=np.float64), self._ratio_table,
            self._ratio_counts)
        if num_missing:
            missing = np.flatnonzero(np.isnan(arrival))
            totals[missing] = self.predict_totals([requests[i] for i in missing],
                                                  [num_generated[i] for i in missing])
        return totals.tolist()

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.predictor.observe(report.num_output_tokens, report.request.task)
        predicted = report.request.predicted_output_tokens
        if predicted:
            ratio = report.num_output_tokens / predicted
            self._ratios.append(ratio)
            self._ratio_counts[_ALL_RATIOS] = len(self._ratios)
            row = 1 + min(_scale_of(float(predicted)), _MAX_SCALE)
            window = self._ratios_by_scale.get(row)
            if window is None:
                window = self._ratios_by_scale[row] = SortedWindow(
                    self._ratios.size, self._ratio_table[row])
            window.append(ratio)
            self._ratio_counts[row] = len(window)


@njit(cache=True)
def _scale_of(predicted: float) -> int:
    """A prediction's power of two (the bit length of its whole tokens, at least 1)."""
    tokens, scale = max(int(predicted), 1), 0
    while tokens:
        tokens >>= 1
        scale += 1
    return scale


_MAX_SCALE = 64  # powers of two past it share one window row (a prediction never gets there)
_ALL_RATIOS = 0  # the ratio table's row of every ratio


@njit(cache=True)
def _conditional_totals(arrival, generated, table, counts):
    """(`PredictorLength.conditional_totals` for every request with an arrival
    prediction (nan: none, left nan), the number without one), from the ratio windows'
    rows (`table`, each row's first `counts` values sorted): a power of two's window
    once calibrated, else all ratios once calibrated."""
    totals = np.empty(len(arrival))
    num_missing = 0
    for i in range(len(arrival)):
        p, n = arrival[i], generated[i]
        if p != p:
            totals[i] = p
            num_missing += 1
            continue
        window = 1 + min(_scale_of(p), _MAX_SCALE)
        if counts[window] < MIN_CALIBRATION_SAMPLES:
            window = _ALL_RATIOS
        if counts[window] < MIN_CALIBRATION_SAMPLES:
            totals[i] = max(p, n + 1)
            continue
        ratios = table[window, :counts[window]]
        above = np.searchsorted(ratios, n / p, side="right")
        num_above = len(ratios) - above
        if num_above == 0:
            totals[i] = n + 1.0
        else:
            median_above = ratios[above + quantile_rank(0.5, num_above)]
            median = ratios[quantile_rank(0.5, len(ratios))]
            totals[i] = max(p * median_above / median, n + 1.0)
    return totals, num_missing


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the conditional totals' pass before the
    watchdog's first check."""
    one = np.ones(1)
    _conditional_totals(one, one, np.ones((_MAX_SCALE + 2, 1)),
                        np.zeros(_MAX_SCALE + 2, dtype=np.int64))
    _scale_of(1.0)
