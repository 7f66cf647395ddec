"""Output lengths of agent steps from their session's earlier steps (no text needed).

Agent traffic replayed from traces carries lengths only, no prompt for a trained
predictor. But the steps of one session are alike (one agent, one task, one set of
tools) while sessions differ by an order of magnitude, so a session's finished steps
say more about its next one than any global history. `SessionHistoryLength` models

    log(output) = prior(tier) + u(session) + noise

- prior: the global history's median (`RunningHistoryLength`, label-free), moved by
  how the mean log-length of the request's coarse feature tier (step index x appended
  length x context length) differs from all, shrunk toward zero while the tier is thin;
- u: the session's mean residual, shrunk toward zero by empirical Bayes with weight
  n / (n + within / between), both variances measured online: sessions that turn out
  not to be alike are ignored, and a first step or a lone request gets the prior alone;
- the spread: recent errors log(true / predicted at arrival). Their quantiles, among
  totals above the output generated so far, give the point estimate (median) and the
  confident total once there are MIN_CALIBRATION_SAMPLES of them. Before that, the
  global history's lengths rescaled to the request's median give the point estimate,
  and its Kaplan-Meier quantile the confident total.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from app.routing.length import (
    DEFAULT_OUTPUT_TOKENS,
    MIN_CALIBRATION_SAMPLES,
    OutputLengthEstimator,
    RunningHistoryLength,
)
from app.routing.quantiles import SortedWindow
from app.routing.view import FinishReport, RouteRequest

TIER_PRIOR_COUNT = 20  # finishes at which a tier's own mean weighs as much as the global one
# within / between variance before MIN_CALIBRATION_SAMPLES steps followed earlier ones of
# their session: a session's first finished step weighs as much as the prior
DEFAULT_SESSION_PRIOR_COUNT = 1.0
MAX_SESSION_PRIOR_COUNT = 1000.0  # sessions measured not alike: their steps barely count

FeatureTier = tuple[int, int, int]  # (step index, appended length, context length) tiers


def feature_tier(request: RouteRequest) -> FeatureTier:
    """Coarse bucket of what is known about a step without text: its step index
    (0, 1, 2-3, 4+), and its appended and context lengths in factors of 8. A lone
    request appends its whole prompt."""
    appended = request.num_appended_tokens
    if appended is None:
        appended = request.num_prompt_tokens
    return (
        min(request.step_index.bit_length(), 3),
        min(appended.bit_length() // 3, 5),
        min(request.num_prompt_tokens.bit_length() // 3, 5),
    )


@dataclass
class RunningMean:
    """Mean of the last ~`window` values: exact until then, exponentially weighted after."""

    window: int
    count: int = 0
    mean: float = 0.0

    @property
    def weight(self) -> int:
        return min(self.count, self.window)

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += (value - self.mean) / self.weight


class SessionHistoryLength(OutputLengthEstimator):
    """A step's output length from its session's finished steps, its lengths and step
    index; the global label-free history for first steps and lone requests.

    The prediction made at arrival is the first `expected_output` of a request; it is
    remembered until the request finishes (its error is learned) or is dropped.
    """

    label_free: ClassVar[bool] = True

    def __init__(
        self,
        window_size: int = 2000,
        max_num_sessions: int = 10_000,
        max_outputs_per_session: int = 32,
        default_tokens: int = DEFAULT_OUTPUT_TOKENS,
    ) -> None:
        for name, value in (("window_size", window_size), ("max_num_sessions", max_num_sessions),
                            ("max_outputs_per_session", max_outputs_per_session)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.window_size = window_size
        self.max_num_sessions = max_num_sessions
        self.max_outputs_per_session = max_outputs_per_session
        self._history = RunningHistoryLength(window_size, default_tokens)
        self._log_all = RunningMean(window_size)  # log output length, every finish
        self._tier_to_log: dict[FeatureTier, RunningMean] = {}  # tier -> its log lengths
        # session id -> residuals (log length - prior) of its last finished steps,
        # least recently finished session first
        self._session_to_residuals: OrderedDict[str, deque[float]] = OrderedDict()
        self._residual_square = RunningMean(window_size)  # within + between variance
        # (residual - its session's mean so far)^2, scaled to be unbiased: within variance
        self._within_square = RunningMean(window_size)
        self._errors = SortedWindow(window_size)  # log(true / predicted at arrival)
        self._req_to_arrival_log: dict[str, float] = {}  # log length predicted at arrival

    # ---- predictions --------------------------------------------------------------

    def expected_output(self, request: RouteRequest) -> float:
        if request.num_generated_tokens == 0 and request.request_id not in self._req_to_arrival_log:
            self._remember_arrival(request)
        return self.predict_total(request, request.num_generated_tokens)

    def predict_total(self, request: RouteRequest, num_generated: int = 0) -> float:
        total = self._quantile_total(request, num_generated, 0.5)
        if total is None:  # uncalibrated: the global history's shape, at this request's median
            scale = math.exp(self._log_offset(request))
            # lengths are whole tokens: above num_generated / scale iff above its floor
            total = scale * self._history.conditional_quantile(int(num_generated / scale), 0.5)
        return max(total, num_generated + 1.0)

    def confident_output(self, request: RouteRequest, quantile: float) -> float | None:
        """The `quantile` of the calibrated totals; until calibrated, the global
        history's Kaplan-Meier quantile (which counts the requests still running)."""
        total = self._quantile_total(request, request.num_generated_tokens, quantile)
        return self._history.confident_output(request, quantile) if total is None else total

    def warm(self, quantile: float) -> bool:
        """As the global history: every estimate here rests on the same finished lengths,
        which are biased short while the long requests are still running."""
        return self._history.warm(quantile)

    def _quantile_total(
        self, request: RouteRequest, num_generated: int, quantile: float
    ) -> float | None:
        """The `quantile` of totals exp(log median + e) over recent errors e, among those
        above `num_generated` (as `RunningHistoryLength.conditional_quantile`); None
        until there are MIN_CALIBRATION_SAMPLES errors."""
        if len(self._errors) < MIN_CALIBRATION_SAMPLES:
            return None
        log_median = self._log_median(request)
        # errors at or below this one give totals the request has already reached
        outlived = math.log(num_generated) - log_median if num_generated > 0 else -math.inf
        error = self._errors.quantile_above(outlived, quantile)
        if error is None:  # outlived every error seen: assume it is about to end
            return float(num_generated + 1)
        return max(math.exp(log_median + error), num_generated + 1.0)

    def _log_median(self, request: RouteRequest) -> float:
        global_median = self._history.conditional_quantile(0, 0.5)
        return math.log(global_median) + self._log_offset(request)

    def _log_offset(self, request: RouteRequest) -> float:
        """How much longer (log) than the global median: its tier, then its session."""
        return self._tier_offset(request) + self._session_offset(request.session_id)

    def _tier_offset(self, request: RouteRequest) -> float:
        """How the request's tier differs from all by mean log-length, shrunk toward
        zero while the tier is thin."""
        tier = self._tier_to_log.get(feature_tier(request))
        if tier is None:
            return 0.0
        shrink = tier.weight / (tier.weight + TIER_PRIOR_COUNT)
        return shrink * (tier.mean - self._log_all.mean)

    def _session_offset(self, session_id: str | None) -> float:
        """Empirical Bayes: the session's summed residuals over (count + within/between)."""
        residuals = self._session_to_residuals.get(session_id) if session_id is not None else None
        if not residuals:
            return 0.0
        return sum(residuals) / (len(residuals) + self._session_prior_count())

    def _session_prior_count(self) -> float:
        """within / between variance of the residuals: how many of its own steps a
        session needs before they weigh as much as the prior."""
        if self._within_square.count < MIN_CALIBRATION_SAMPLES:
            return DEFAULT_SESSION_PRIOR_COUNT
        within = self._within_square.mean
        between = self._residual_square.mean - within
        return within / max(between, within / MAX_SESSION_PRIOR_COUNT, 1e-12)

    # ---- feedback -----------------------------------------------------------------

    def _remember_arrival(self, request: RouteRequest) -> None:
        self._req_to_arrival_log[request.request_id] = self._log_median(request)
        if len(self._req_to_arrival_log) > self.window_size:  # never finished nor dropped
            del self._req_to_arrival_log[next(iter(self._req_to_arrival_log))]

    def on_finish(self, report: FinishReport, now: float) -> None:
        request = report.request
        log_total = math.log(max(report.num_output_tokens, 1))
        arrival_log = self._req_to_arrival_log.pop(request.request_id, None)
        if arrival_log is not None:
            self._errors.append(log_total - arrival_log)
        global_median = self._history.conditional_quantile(0, 0.5)  # before this finish
        residual = log_total - math.log(global_median) - self._tier_offset(request)
        self._residual_square.add(residual * residual)
        if request.session_id is not None:
            self._learn_session(request.session_id, residual)
        self._log_all.add(log_total)
        tier = feature_tier(request)
        self._tier_to_log.setdefault(tier, RunningMean(self.window_size)).add(log_total)
        self._history.on_finish(report, now)

    def _learn_session(self, session_id: str, residual: float) -> None:
        """Adds a finished step's residual to its session (now the most recent one),
        evicting the least recently finished session past `max_num_sessions`."""
        residuals = self._session_to_residuals.get(session_id)
        if residuals is None:
            residuals = deque(maxlen=self.max_outputs_per_session)
            self._session_to_residuals[session_id] = residuals
        elif residuals:
            n = len(residuals)
            deviation = residual - sum(residuals) / n
            self._within_square.add(deviation * deviation * n / (n + 1))
        residuals.append(residual)
        self._session_to_residuals.move_to_end(session_id)
        if len(self._session_to_residuals) > self.max_num_sessions:
            self._session_to_residuals.popitem(last=False)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self._req_to_arrival_log.pop(request.request_id, None)
        self._history.on_drop(request, now)

    def on_progress(self, req_to_num_generated: Mapping[str, int]) -> None:
        self._history.on_progress(req_to_num_generated)
