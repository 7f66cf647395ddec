"""Keeping a session's KV through its tool wait, in the style of Continuum.

An agent step ends with a tool call; the session's next step comes back after the tool
runs, with the same context and a little more. Left in the free pool, the context is
evicted as soon as other requests need blocks, and the next step recomputes it. Pinned
on its engine, it costs that engine the blocks for the wait. `ContextKeeper` pins it
for the wait it expects when the blocks held over the wait cost less than the compute
they save:

    expected wait x (context tokens / the engine's KV tokens) <= prefill time of the context

(engine-seconds of KV held against engine-seconds of prefill saved; the pin ends at the
expected wait, so a tool that runs longer loses it). The expected wait is a quantile of
the waits seen so far for the session's app (its tool set), none before `min_seen`
waits: nothing is pinned on a guess.

Ray-free and clock-agnostic: the simulator calls it when a step ends and when the next
one arrives.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from app.hardware.specs import InstanceSpec

WAIT_QUANTILE = 0.75  # the wait a pin covers: most tool calls, not the long tail
RECENT_WAITS = 256  # waits remembered per app
MIN_SEEN = 8  # waits seen before an app's steps are pinned


class ContextKeeper:
    """How long a session's context stays pinned on its engine after a step."""

    def __init__(self, quantile: float = WAIT_QUANTILE, min_seen: int = MIN_SEEN,
                 recent: int = RECENT_WAITS) -> None:
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_seen = min_seen
        self.recent = recent
        self._waits: dict[str, deque[float]] = {}
        self.num_pinned = 0  # pins decided
        self.num_declined = 0  # steps whose context was not worth keeping

    def observe_wait(self, app: str, wait_s: float) -> None:
        """A session of `app` came back `wait_s` after its last step ended."""
        self._waits.setdefault(app, deque(maxlen=self.recent)).append(max(wait_s, 0.0))

    def expected_wait_s(self, app: str) -> float | None:
        """The wait a pin covers for `app`; None before `min_seen` waits."""
        waits = self._waits.get(app)
        if waits is None or len(waits) < self.min_seen:
            return None
        return float(np.quantile(np.fromiter(waits, float, len(waits)), self.quantile))

    def keep_until(self, app: str, num_context_tokens: int, spec: InstanceSpec,
                   now: float) -> float | None:
        """Until when to pin a context of `num_context_tokens` on an engine of `spec`
        after a step of `app` ended at `now`; None: let the cache decide."""
        wait_s = self.expected_wait_s(app)
        if wait_s is None or num_context_tokens <= 0:
            return None
        held = wait_s * num_context_tokens / spec.kv_capacity_tokens
        saved = spec.solo_phases_s(num_context_tokens, 1)[0]
        if held > saved:
            self.num_declined += 1
            return None
        self.num_pinned += 1
        return now + wait_s
