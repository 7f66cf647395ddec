"""What the controller observes over an interval, and how it predicts the next one.

The routers report each arrival (prompt length) and each completion (output length,
deadline met or not); the controller closes the window every interval into one
`IntervalStats`. Plain bookkeeping: `now` is an argument, no clock is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.planning.pools import Observation


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

    @property
    def rate_rps(self) -> float:
        return self.arrivals / (self.end_s - self.start_s)

    @property
    def slo_attainment(self) -> float:
        """Share of the interval's completions that met their deadline (1 if none)."""
        return self.met / self.finished if self.finished else 1.0

    def observation(self, rate_rps: float) -> Observation:
        """SARA's observe stage at a predicted rate."""
        return Observation(rate_rps, self.mean_input_len, self.cv_input_len, self.mean_output_len)


@dataclass
class LoadReport:
    """Arrival and completion tallies: what one router adds up between two reports to
    the controller, and what the controller's window sums over every router."""

    arrivals: int = 0
    input_sum: float = 0.0
    input_sq: float = 0.0
    finished: int = 0
    met: int = 0
    output_sum: float = 0.0

    def arrival(self, num_prompt_tokens: int) -> None:
        self.arrivals += 1
        self.input_sum += num_prompt_tokens
        self.input_sq += float(num_prompt_tokens) ** 2

    def completion(self, num_output_tokens: int, met_deadline: bool) -> None:
        self.finished += 1
        self.met += int(met_deadline)
        self.output_sum += num_output_tokens

    def merge(self, other: LoadReport) -> None:
        for name in ("arrivals", "input_sum", "input_sq", "finished", "met", "output_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def is_empty(self) -> bool:
        return not (self.arrivals or self.finished)


class LoadWindow:
    """Accumulates router reports between two interval boundaries.

    Input length moments carry over from earlier windows when a window saw no arrival
    (an idle interval does not erase what is known about the traffic). The mean output
    length is weighted by completions over recent windows, each window's weight decaying
    by `output_memory`: the completions of one window are biased towards long requests
    when the load falls (the short ones have finished), and once arrivals stop the last
    stragglers alone would make every engine look many times slower than it is."""

    def __init__(self, start_s: float, default_input_len: float = 512.0,
                 default_output_len: float = 256.0, output_memory: float = 0.5) -> None:
        if not 0 <= output_memory < 1:
            raise ValueError(f"output_memory must be in [0, 1), got {output_memory}")
        self._start_s = start_s
        self._tally = LoadReport()
        self._last_input = (default_input_len, 1.0)
        self._last_output = default_output_len
        self._output_memory = output_memory
        self._output_sums = (0.0, 0.0)  # decayed (output tokens, completions)

    def arrival(self, num_prompt_tokens: int) -> None:
        self._tally.arrival(num_prompt_tokens)

    def finished(self, num_output_tokens: int, met_deadline: bool) -> None:
        self._tally.completion(num_output_tokens, met_deadline)

    def merge(self, report: LoadReport) -> None:
        """Add a router's tallies since its last report."""
        self._tally.merge(report)

    def close(self, now: float) -> IntervalStats:
        """The window [start, now) as stats; a new window starts at `now`."""
        if not now > self._start_s:
            raise ValueError(f"window end {now} must be after its start {self._start_s}")
        t = self._tally
        if t.arrivals:
            mean = t.input_sum / t.arrivals
            variance = max(t.input_sq / t.arrivals - mean * mean, 0.0)
            self._last_input = (max(mean, 1.0), max(math.sqrt(variance) / max(mean, 1.0), 0.05))
        if t.finished:
            tokens, count = (x * self._output_memory for x in self._output_sums)
            self._output_sums = (tokens + t.output_sum, count + t.finished)
            self._last_output = max(self._output_sums[0] / self._output_sums[1], 1.0)
        stats = IntervalStats(self._start_s, now, t.arrivals, t.finished, t.met,
                              *self._last_input, self._last_output)
        self._start_s = now
        self._tally = LoadReport()
        return stats


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
