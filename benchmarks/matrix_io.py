"""Cells of a benchmark matrix as CSV rows, appended as units finish (so a matrix
interrupted midway resumes from what it wrote), and the arithmetic and drawing the
matrix reports share."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


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


def ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (both fail alike) and a / 0 = inf."""
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


def mean_range_text(values: Sequence[float]) -> str:
    """"mean [min, max]", or the mean alone for one value."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} [{min(values):.2f}, {max(values):.2f}]"


def draw_ratio_grid(ax: Any, grid: np.ndarray, columns: Sequence[str],
                    rows: Sequence[str]) -> Any:
    """`grid` (ratios, NaN where empty) as a log2 heat map from 0.5x to 2x on `ax`,
    each cell annotated with its value; returns the image for a colour bar."""
    import numpy as np

    image = ax.imshow(np.log2(grid), cmap="RdYlGn", vmin=-1, vmax=1, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)), list(columns))
    ax.set_yticks(range(len(rows)), list(rows))
    return image


def save_compact_png(fig: Any, path: Path, dpi: int = 72) -> None:
    """`fig` as a PNG of at most 256 colours: line plots lose nothing visible, and the
    file is a third of matplotlib's true-colour one (results/ has a size budget)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)
