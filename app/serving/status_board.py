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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.engines.messages import EngineStatus
from app.routing.budgets import smallest_stalls
from app.routing.finish_log import FinishLog
from app.routing.view import FinishReport

StatusChanges = Mapping[str, EngineStatus | None]  # engine id -> its report, None: unreachable


TOLD_FRESH_S = 3.0  # a replica's told slack counts this long (it tells every poll)
GONE_S = 60.0  # a replica silent this long has left (downscaled, killed): off the board


@dataclass(frozen=True)
class BoardAnswer:
    """What a replica's poll of the board brings back."""

    version: int  # the board's version: the replica holds every report up to it
    changes: StatusChanges  # the reports published after the version it asked with
    others_stalls: dict[str, float]  # per engine, the other replicas' smallest slack
    finish_cursor: int  # where its next poll reads the others' finishes from
    others_finished: list[FinishReport]  # the finishes the others told since its cursor


class StatusBoard:
    """Versioned latest report per engine; `changes(version)` answers a replica's poll.

    Replicas also tell the board, with each poll, the smallest slack their requests
    have on each engine (GoodServe's do-no-harm budgets); each is answered with the
    others' (`others_stalls`), so no replica stalls another's admitted requests. What
    a replica told counts for `TOLD_FRESH_S`: a replica that stopped asking is gone.
    They tell the requests they saw finish too, and each takes the others' since its
    cursor (`others_finished`), so every replica's length estimator learns from every
    finish (`finish_log`).
    """

    def __init__(self) -> None:
        self.version = 0
        self._entries: dict[str, tuple[int, EngineStatus | None]] = {}
        self._changed: asyncio.Event | None = None
        self.followers: dict[str, tuple[int, float]] = {}  # replica -> (version held, when)
        self._told: dict[str, tuple[dict[str, float], float]] = {}  # replica -> stalls, when
        self.finishes = FinishLog()

    def tell(self, replica: str, stalls: Mapping[str, float],
             finished: Sequence[FinishReport] = ()) -> None:
        """`replica`'s smallest slack per engine, and the requests it saw finish."""
        self._told[replica] = (dict(stalls), time.monotonic())
        self.finishes.tell(replica, finished)

    def others_finished(self, cursor: int, replica: str) -> tuple[int, list[FinishReport]]:
        """(the replica's next cursor, the finishes the others told after `cursor`)."""
        return self.finishes.since(cursor, replica)

    @property
    def tellers(self) -> list[str]:
        """The replicas that told their slack lately."""
        fresh_from = time.monotonic() - TOLD_FRESH_S
        return sorted(name for name, (_, at) in self._told.items() if at >= fresh_from)

    def others_stalls(self, replica: str | None) -> dict[str, float]:
        """Per engine, the smallest slack the other fresh replicas told."""
        fresh_from = time.monotonic() - TOLD_FRESH_S
        return smallest_stalls(stalls for name, (stalls, at) in self._told.items()
                               if name != replica and at >= fresh_from)

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
        now = time.monotonic()
        if follower is not None:
            self.followers[follower] = (answer[0], now)
        self._drop_gone(now)
        return answer

    def _drop_gone(self, now: float) -> None:
        """Forget the replicas silent for `GONE_S` (autoscaling adds and removes them)."""
        gone_before = now - GONE_S
        for replica in [r for r, (_, at) in self.followers.items() if at < gone_before]:
            del self.followers[replica]
        for replica in [r for r, (_, at) in self._told.items() if at < gone_before]:
            del self._told[replica]
