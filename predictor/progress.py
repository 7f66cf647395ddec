"""Progress reporting that suits where it is written: a tqdm bar on a terminal, plain
lines in a file or CI log (a bar there leaves thousands of carriage-return frames).

In `predictor` (which imports nothing of `app`) so the training loop, the experiments
and the benchmark scripts can all share it without an import cycle.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Generic, Self, TextIO, TypeVar

from tqdm import tqdm

__all__ = ["Progress"]

T = TypeVar("T")

LINES = 10  # log lines over a known total: one per 10%
INTERVAL_S = 30.0  # and at least one per half minute of a slow loop


def _is_tty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress(Generic[T]):
    """A count towards `total` of `unit`s: a bar updating in place when `file` is a
    terminal; otherwise a complete line each 1/`lines` of the total (or each `interval_s`
    seconds, which also covers an unknown total) and one at the end, never a '\\r'.

    Iterate it to count the items of `iterable`, or call `update` (as a context manager);
    with `enabled` false it only passes the items through.
    """

    def __init__(
        self,
        iterable: Iterable[T] | None = None,
        *,
        desc: str,
        total: int | None = None,
        unit: str = "it",
        enabled: bool = True,
        leave: bool = True,
        lines: int = LINES,
        interval_s: float = INTERVAL_S,
        file: TextIO | None = None,
    ) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable = iterable
        self.desc, self.total, self.unit = desc, total, unit
        self.file = sys.stderr if file is None else file
        self.enabled = enabled
        self.n = 0
        self._lines, self._interval_s = max(1, lines), interval_s
        self._postfix = ""
        self._start = self._last_time = time.monotonic()
        self._last_n = 0
        self._next_n = self._threshold(1)
        self._closed = not enabled
        self._bar = (
            tqdm(total=total, desc=desc, unit=unit, file=self.file, leave=leave)
            if enabled and _is_tty(self.file) else None
        )

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("Progress without an iterable counts by update(), not iteration")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count `n` more; on a log, write a line when a step of the total or the
        interval has passed since the last one."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif not self._closed:
            now = time.monotonic()
            if self.n >= self._next_n or now - self._last_time >= self._interval_s:
                self._write(now)

    def set_postfix(self, **values: object) -> None:
        """Extra `key=value` fields (a loss, say) shown with the count from now on."""
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix)

    def close(self) -> None:
        """Finish the bar, or write the final count unless the last line already had it."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.n != self._last_n or self.n == 0:
            self._write(time.monotonic())

    def _threshold(self, step: int) -> float:
        """The count at which the `step`-th line of a known total is due."""
        return math.inf if self.total is None else math.ceil(self.total * step / self._lines)

    def _write(self, now: float) -> None:
        elapsed = now - self._start
        count = f"{self.n}" if self.total is None else f"{self.n}/{self.total}"
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n // self.total}%)"
        parts.append(f"{elapsed:.1f}s")
        if elapsed > 0 and self.n:
            parts.append(f"{self.n / elapsed:.1f} {self.unit}/s")
        if self._postfix:
            parts.append(self._postfix)
        self.file.write(", ".join(parts) + "\n")
        self.file.flush()
        self._last_n, self._last_time = self.n, now
        if self.total:
            self._next_n = self._threshold(self.n * self._lines // self.total + 1)
