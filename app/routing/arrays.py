"""A cluster view as columns: what vectorised routing reads instead of per-instance
objects.

`ViewArrays.of(views)` builds the columns from `InstanceView`s (one pass); a substrate
that keeps its views incrementally keeps the columns too (`ViewColumns`: rows are
rewritten only for the instances that changed), so a decision reads arrays without
touching an object per instance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from app.routing.instance_view import InstanceId, InstanceView

# numeric columns, in `ViewColumns.table` order; the unloaded decode time per token is
# both the capability just-enough ranks by and the estimator's catalog prior for d_g
COLUMNS = ("num_running", "num_waiting", "kv_free_tokens", "unloaded_decode_s_per_token",
           "unloaded_prefill_s_per_token", "batch_intercept", "batch_slope", "max_num_seqs",
           "prefill_span_slope", "decode_context_slope")
_COL = {name: i for i, name in enumerate(COLUMNS)}


def view_row(view: InstanceView) -> tuple[float, ...]:
    """One instance's numeric columns (`COLUMNS`); no batch cap reads as inf."""
    spec = view.spec
    intercept, slope = spec.decode_batch_line
    return (view.num_running, view.num_waiting, view.kv_free_tokens,
            spec.unloaded_decode_s_per_token, spec.unloaded_prefill_s_per_token,
            intercept, slope, math.inf if view.max_num_seqs is None else view.max_num_seqs,
            spec.prefill_span_slope, spec.decode_context_slope)


def rank_of(ids: Sequence[InstanceId]) -> np.ndarray:
    """Each id's rank in sorted order: ties broken by id, as `min(..., id)` does."""
    rank = np.empty(len(ids), dtype=np.int64)
    rank[sorted(range(len(ids)), key=ids.__getitem__)] = np.arange(len(ids))
    return rank


@dataclass(frozen=True)
class ViewArrays:
    """The columns of a tuple of instance views, in view order (read-only)."""

    ids: tuple[InstanceId, ...]
    table: np.ndarray  # (instances, len(COLUMNS)) float64
    rank: np.ndarray | None = None  # `rank_of(ids)`, when the builder has it
    positions: Mapping[InstanceId, int] | None = None  # id -> row, when the builder has it
    # each row's `InstanceView.waiting_priorities`; None when every row is None
    waiting_priorities: tuple[tuple[int, ...] | None, ...] | None = None

    @classmethod
    def of(cls, views: Sequence[InstanceView]) -> ViewArrays:
        table = np.array([view_row(v) for v in views], dtype=np.float64).reshape(
            len(views), len(COLUMNS))
        priorities = tuple(v.waiting_priorities for v in views)
        return cls(tuple(v.instance_id for v in views), table,
                   waiting_priorities=None if all(p is None for p in priorities)
                   else priorities)

    def column(self, name: str) -> np.ndarray:
        return self.table[:, _COL[name]]

    def __len__(self) -> int:
        return len(self.ids)

    def num_waiting_ahead(self, priority: int) -> np.ndarray:
        """`InstanceView.num_waiting_ahead` for every row: the whole queue where the
        engine serves in arrival order."""
        waiting = self.column("num_waiting")
        if self.waiting_priorities is None:
            return waiting.copy()
        ordered, known, rows, priorities = self._waiting_order
        ahead = waiting.copy()
        counted = np.bincount(rows[priorities <= priority], minlength=len(self.ids))
        unknown = np.maximum(waiting - known, 0)
        ahead[ordered] = np.minimum(waiting, unknown + counted)[ordered]
        return ahead

    @cached_property
    def _waiting_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`waiting_priorities` flattened: (the rows in priority mode, the priorities
        known per row, each known priority's row, the priorities)."""
        assert self.waiting_priorities is not None
        per_row = self.waiting_priorities
        ordered = np.array([p is not None for p in per_row], dtype=bool)
        known = np.array([len(p) if p is not None else 0 for p in per_row], dtype=np.float64)
        rows = np.repeat(np.arange(len(per_row)), known.astype(np.int64))
        priorities = np.fromiter((x for p in per_row if p is not None for x in p),
                                 dtype=np.int64, count=len(rows))
        return ordered, known, rows, priorities

    @property
    def id_rank(self) -> np.ndarray:
        """The builder's rank when it has one: a plain property, since every snapshot's
        first read of a `cached_property` takes its lock (a few microseconds a
        decision)."""
        return self.rank if self.rank is not None else self._built_rank

    @cached_property
    def _built_rank(self) -> np.ndarray:
        return rank_of(self.ids)

    @property
    def row_of(self) -> Mapping[InstanceId, int]:
        """id -> row: kept by the builder across snapshots of the same instances, so a
        lookup does not index every instance again."""
        return self.positions if self.positions is not None else self._built_rows

    @cached_property
    def _built_rows(self) -> Mapping[InstanceId, int]:
        return {iid: i for i, iid in enumerate(self.ids)}


class ViewColumns:
    """Columns kept in step with a substrate's list of views: `set(i, view)` when view
    i changed, `arrays(rows)` for the views offered to routing. Arrays handed out stay
    as they were (the table is copied on the next write)."""

    def __init__(self) -> None:
        self._ids: list[InstanceId] = []
        self._table = np.zeros((0, len(COLUMNS)))
        self._priorities: list[tuple[int, ...] | None] = []  # waiting_priorities per row
        self._num_ordered = 0  # rows whose waiting_priorities are not None
        self._shared = False
        self._members: tuple[tuple[int, ...] | None, tuple[InstanceId, ...], np.ndarray,
                             dict[InstanceId, int]] | None
        self._members = None  # (rows key, ids, their rank, id -> row) of the last arrays

    def set(self, index: int, view: InstanceView) -> None:
        if self._shared:
            self._table, self._shared = self._table.copy(), False
        if index == len(self._ids):
            self._ids.append(view.instance_id)
            self._table = np.vstack([self._table, np.zeros((1, len(COLUMNS)))])
            self._priorities.append(None)
            self._members = None
        elif self._ids[index] != view.instance_id:
            self._ids[index] = view.instance_id
            self._members = None
        self._table[index] = view_row(view)
        self._num_ordered += ((view.waiting_priorities is not None)
                              - (self._priorities[index] is not None))
        self._priorities[index] = view.waiting_priorities

    def arrays(self, rows: Sequence[int] | None = None) -> ViewArrays:
        """The rows (all when None), in their order."""
        key = None if rows is None else tuple(rows)
        if self._members is None or self._members[0] != key:
            ids = tuple(self._ids) if key is None else tuple(self._ids[i] for i in key)
            self._members = (key, ids, rank_of(ids), {iid: i for i, iid in enumerate(ids)})
        _, ids, rank, positions = self._members
        priorities = None
        if self._num_ordered:
            priorities = tuple(self._priorities if key is None
                               else (self._priorities[i] for i in key))
        if key is None:
            self._shared = True
            return ViewArrays(ids, self._table, rank, positions, priorities)
        return ViewArrays(ids, self._table[list(key)], rank, positions, priorities)
