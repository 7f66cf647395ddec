"""Each instance's slot in a table kept per instance, for the list of instances a
decision reads: the list is the same tuple from one decision to the next, so the slots
are looked up once per list, not once per decision."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class SlotsOfLastList:
    """The slots of the last list of ids asked; `forget` when an id's slot may have
    changed meaning."""

    __slots__ = ("_ids", "_slots")

    def __init__(self) -> None:
        self._ids: tuple[str, ...] | None = None
        self._slots = np.zeros(0, dtype=np.int64)

    def of(self, ids: Sequence[str], slot_of: Callable[[str], int]) -> np.ndarray:
        """Each id's `slot_of`, kept until a different list is asked."""
        if self._ids is not ids and self._ids != ids:
            self._slots = np.array([slot_of(i) for i in ids], dtype=np.int64)
            self._ids = tuple(ids)
        return self._slots

    def forget(self) -> None:
        self._ids = None
