"""History baselines (Past-Future style): no text, only recently observed lengths.

A request that has produced k tokens is predicted to reach the median of the recent
lengths that exceeded k. The router feeds finished lengths back through `observe`.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import numpy as np

from predictor.base import PredictionInput, Predictor, validate_training_data
from predictor.ranks import quantile_rank

__all__ = ["HistoryPredictor", "LengthWindow", "TaskHistoryPredictor"]

WINDOW_FILE = "windows.json"


class LengthWindow:
    """The last `size` observed lengths, with conditional quantiles above k."""

    def __init__(self, size: int, lengths: Sequence[int] = ()) -> None:
        self._lengths: deque[int] = deque(lengths, maxlen=size)
        self._sorted: np.ndarray | None = None  # cache, rebuilt after an observe

    def __len__(self) -> int:
        return len(self._lengths)

    def observe(self, length: int) -> None:
        self._lengths.append(int(length))
        self._sorted = None

    def to_list(self) -> list[int]:
        return list(self._lengths)

    def predict(self, num_generated: np.ndarray, quantile: float) -> np.ndarray:
        """`quantile` of the lengths > k for each k; 2k (Lindy) when none is longer."""
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._lengths, dtype=np.float64))
        ordered = self._sorted
        start = np.searchsorted(ordered, num_generated, side="right")
        count = len(ordered) - start
        ranks = [quantile_rank(quantile, max(n, 1)) for n in count.tolist()]
        pick = start + np.array(ranks, dtype=np.int64)
        longer = ordered[np.minimum(pick, len(ordered) - 1)] if len(ordered) else 0.0
        return np.where(count > 0, longer, 2.0 * num_generated)


class HistoryPredictor(Predictor):
    """One global window of recent lengths; ignores the prompt."""

    kind = "history"

    def __init__(self, window_size: int = 2000, quantile: float = 0.5) -> None:
        self.window_size = window_size
        self.quantile = quantile

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        """Seed the window with the training lengths, most recent last."""
        lengths = validate_training_data(inputs, output_lengths)
        self._lock = threading.Lock()
        self.window_ = LengthWindow(self.window_size, lengths.tolist())
        return self

    def observe(self, output_length: int, task: str | None = None) -> None:
        super().observe(output_length, task)
        with self._lock:
            self.window_.observe(output_length)

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        num_generated = np.array([inp.num_generated_tokens for inp in inputs], dtype=np.float64)
        with self._lock:
            return self.window_.predict(num_generated, self.quantile)

    def _save_state(self, directory: Path) -> None:
        with self._lock:
            (directory / WINDOW_FILE).write_text(json.dumps({"global": self.window_.to_list()}))

    def _load_state(self, directory: Path) -> None:
        saved = json.loads((directory / WINDOW_FILE).read_text())
        self._lock = threading.Lock()
        self.window_ = LengthWindow(self.window_size, saved["global"])


class TaskHistoryPredictor(Predictor):
    """One window per declared task; the global window for unknown or rare tasks."""

    kind = "history_task"

    def __init__(
        self, window_size: int = 2000, quantile: float = 0.5, min_task_samples: int = 20
    ) -> None:
        self.window_size = window_size
        self.quantile = quantile
        self.min_task_samples = min_task_samples

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        lengths = validate_training_data(inputs, output_lengths)
        self._lock = threading.Lock()
        self.global_window_ = LengthWindow(self.window_size, lengths.tolist())
        self.task_windows_: dict[str, LengthWindow] = {}
        for inp, length in zip(inputs, lengths.tolist(), strict=True):
            if inp.task is not None:
                self._task_window(inp.task).observe(length)
        return self

    def _task_window(self, task: str) -> LengthWindow:
        if task not in self.task_windows_:
            self.task_windows_[task] = LengthWindow(self.window_size)
        return self.task_windows_[task]

    def observe(self, output_length: int, task: str | None = None) -> None:
        super().observe(output_length, task)
        with self._lock:
            self.global_window_.observe(output_length)
            if task is not None:
                self._task_window(task).observe(output_length)

    def _window_for(self, task: str | None) -> LengthWindow:
        window = self.task_windows_.get(task) if task is not None else None
        if window is None or len(window) < self.min_task_samples:
            return self.global_window_
        return window

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        out = np.empty(len(inputs), dtype=np.float64)
        num_generated = np.array([inp.num_generated_tokens for inp in inputs], dtype=np.float64)
        rows_by_task: dict[str | None, list[int]] = defaultdict(list)
        for row, inp in enumerate(inputs):
            rows_by_task[inp.task].append(row)
        with self._lock:
            for task, rows in rows_by_task.items():
                out[rows] = self._window_for(task).predict(num_generated[rows], self.quantile)
        return out

    def _save_state(self, directory: Path) -> None:
        with self._lock:
            windows = {task: w.to_list() for task, w in self.task_windows_.items()}
            state = {"global": self.global_window_.to_list(), "tasks": windows}
        (directory / WINDOW_FILE).write_text(json.dumps(state))

    def _load_state(self, directory: Path) -> None:
        saved = json.loads((directory / WINDOW_FILE).read_text())
        self._lock = threading.Lock()
        self.global_window_ = LengthWindow(self.window_size, saved["global"])
        self.task_windows_ = {
            task: LengthWindow(self.window_size, lengths)
            for task, lengths in saved["tasks"].items()
        }
