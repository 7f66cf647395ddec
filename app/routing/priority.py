"""The priority the router gives a request's engine, and what runs before it there.

An engine in priority mode (vLLM's `scheduling_policy="priority"`) admits waiting
requests by (priority, arrival), lower first, and preempts the running request of the
largest (priority, arrival) when KV runs out. The router sets each request's priority
once, when it routes it; every engine it is sent to (a move, a fail-over, the decode
stage after a prefill) gets the same value.

Plain Python, Ray-free: the simulator and the live router call the same rule.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from enum import StrEnum

# a request without a deadline: after every request that has one (within vLLM's int64)
NO_DEADLINE_PRIORITY = 2**62


class PriorityRule(StrEnum):
    """How the router turns a request into its engine priority."""

    NONE = "none"  # 0 for every request: a priority engine then runs them by arrival
    DEADLINE = "deadline"  # earliest deadline first: its deadline in ms since the epoch

    def priority(self, deadline_s: float) -> int:
        """The engine priority of a request with this absolute deadline (seconds on the
        router's clock: wall time live, virtual time from 0 in the simulator)."""
        if self is PriorityRule.NONE:
            return 0
        if not math.isfinite(deadline_s):
            return NO_DEADLINE_PRIORITY
        return min(math.floor(deadline_s * 1000), NO_DEADLINE_PRIORITY - 1)


def num_waiting_ahead(num_waiting: int, waiting_priorities: Sequence[int] | None,
                      priority: int) -> int:
    """How many of an engine's waiting requests run before a new one of `priority`:
    every one when the engine serves in arrival order (`waiting_priorities` None);
    in priority mode those of a smaller or equal priority (equal ones arrived first).
    `waiting_priorities` is sorted; waiting requests beyond it (the router does not
    know their priority) count as ahead, and the answer never exceeds `num_waiting`."""
    if waiting_priorities is None:
        return num_waiting
    unknown = max(num_waiting - len(waiting_priorities), 0)
    return min(num_waiting, unknown + bisect_right(waiting_priorities, priority))
