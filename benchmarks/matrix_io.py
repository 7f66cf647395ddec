"""Cells of a benchmark matrix as CSV rows, appended as units finish (so a matrix
interrupted midway resumes from what it wrote)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


def read_rows(path: Path, *, numeric: Sequence[str] = (),
              integer: Sequence[str] = ()) -> list[dict]:
    """The rows of `path` (none when it does not exist), with the named columns
    parsed as floats or ints."""
    if not path.exists():
        return []
    with path.open() as f:
        return [{**row, **{k: float(row[k]) for k in numeric},
                 **{k: int(row[k]) for k in integer}} for row in csv.DictReader(f)]


def append_rows(path: Path, rows: Sequence[dict], fieldnames: Sequence[str]) -> None:
    """Append `rows`, with a header when the file is new."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fieldnames))
        if new:
            writer.writeheader()
        writer.writerows(rows)
