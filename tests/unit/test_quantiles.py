"""Sliding-window quantiles the routing code reads at every decision."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from app.routing.length import RunningHistoryLength
from app.routing.quantiles import SortedWindow
from predictor.history import LengthWindow
from predictor.ranks import quantile_rank

pytestmark = pytest.mark.unit

TEN = [70, 10, 100, 40, 20, 90, 30, 60, 80, 50]  # 10..100, out of order


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sorted_window_gives_the_quantiles_of_its_last_values(seed):
    """Against numpy's inverted-CDF quantile of the last `size` values at every read,
    with repeats and values leaving the window."""
    rng = np.random.default_rng(seed)
    window, last = SortedWindow(50), deque(maxlen=50)
    for value in rng.integers(0, 30, size=400).tolist():
        window.append(value)
        last.append(value)
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert window.quantile(q) == np.quantile(list(last), q, method="inverted_cdf")
    assert len(window) == window.size == 50


@pytest.mark.parametrize(("q", "rank"), [(0.0, 0), (0.25, 2), (0.5, 4), (0.9, 8), (0.95, 9),
                                         (1.0, 9)])
def test_the_rank_is_the_smallest_with_a_fraction_q_at_or_below_it(q, rank):
    assert quantile_rank(q, 10) == rank


def test_a_quantile_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least one value"):
        quantile_rank(0.5, 0)


def windows_of_ten() -> tuple[SortedWindow, RunningHistoryLength, LengthWindow]:
    """The router's window, its length history and the history predictor's window, each
    holding the same ten lengths."""
    window, history = SortedWindow(10), RunningHistoryLength(window_size=10)
    for length in TEN:
        window.append(length)
        history.observe_length(length)
    return window, history, LengthWindow(size=10, lengths=TEN)


@pytest.mark.parametrize(("q", "expected"), [(0.25, 30), (0.5, 50), (0.9, 90), (0.95, 100)])
def test_every_window_ranks_a_quantile_alike(q, expected):
    window, history, predictor_window = windows_of_ten()
    assert window.quantile(q) == expected
    assert history.conditional_quantile(0, q) == expected
    assert predictor_window.predict(np.array([0.0]), q)[0] == expected


@pytest.mark.parametrize(("above", "q", "expected"), [
    (35, 0.5, 70),  # 40..100: the 4th of 7
    (40, 0.5, 70),  # 50..100: the 3rd of 6, the lower of the two middle ones
    (95, 0.1, 100),
])
def test_every_window_ranks_a_conditional_quantile_alike(above, q, expected):
    window, history, predictor_window = windows_of_ten()
    assert window.quantile_above(above, q) == expected
    assert history.conditional_quantile(above, q) == expected
    assert predictor_window.predict(np.array([float(above)]), q)[0] == expected


def test_nothing_above_the_threshold_has_no_quantile():
    window = SortedWindow(3)
    for value in (1.0, 2.0, 3.0):
        window.append(value)
    assert window.quantile_above(3.0, 0.5) is None
