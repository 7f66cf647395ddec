"""The engines' latest reports, published once for every router replica.

With N router replicas each polling every engine, an engine answers N status calls per
poll period. The board inverts that: one poller (the controller actor) takes each
engine's report once per period and publishes it here; replicas long-poll the board for
what changed since the version they hold. An engine that did not answer is published
as None (the replicas take it out of rotation until it reports again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from app.engine_types import EngineStatus

StatusChanges = Mapping[str, EngineStatus | None]  # engine id -> its report, None: unreachable


class StatusBoard:
    """Versioned latest report per engine; `changes(version)` answers a replica's poll."""

    def __init__(self) -> None:
        self.version = 0
        self._entries: dict[str, tuple[int, EngineStatus | None]] = {}
        self._changed: asyncio.Event | None = None
        self.followers: dict[str, tuple[int, float]] = {}  # replica -> (version held, when)

    def publish(self, engine_id: str, status: EngineStatus | None) -> None:
        self.version += 1
        self._entries[engine_id] = (self.version, status)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def forget(self, engine_id: str) -> None:
        """An engine that left: no more reports of it."""
        self._entries.pop(engine_id, None)

    def changes(self, version: int) -> tuple[int, dict[str, EngineStatus | None]]:
        """The board's version and every report published after `version`."""
        return self.version, {eid: status for eid, (v, status) in self._entries.items()
                              if v > version}

    async def wait_changes(self, version: int, wait_s: float, follower: str | None = None
                           ) -> tuple[int, dict[str, EngineStatus | None]]:
        """`changes(version)`, waiting up to `wait_s` for a report newer than `version`;
        `follower` names the replica asking (the version it then holds is kept for
        operators: replicas whose versions agree route on the same reports)."""
        deadline = time.monotonic() + wait_s
        while self.version <= version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        answer = self.changes(version)
        if follower is not None:
            self.followers[follower] = (answer[0], time.monotonic())
        return answer
