"""Sliding-window quantiles the routing code reads at every decision."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from app.routing.quantiles import SortedWindow, nearest_rank_quantile

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sorted_window_gives_the_nearest_rank_quantiles_of_its_last_values(seed):
    """Against sorting the last `size` values at every read, with repeats and values
    leaving the window."""
    rng = np.random.default_rng(seed)
    window, last = SortedWindow(50), deque(maxlen=50)
    for value in rng.integers(0, 30, size=400).tolist():
        window.append(value)
        last.append(value)
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert window.quantile(q) == nearest_rank_quantile(last, q)
    assert len(window) == window.size == 50
