"""One JSON-lines reader for every data file the project reads (traces, prompts).

Light on purpose (no numpy/sklearn): the simulator's trace loader imports it too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["iter_jsonl_objects"]


def iter_jsonl_objects(
    path: Path, error: type[ValueError] = ValueError
) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(where, line number, object) for every non-blank line of an existing file;
    bad text or a line that is not a JSON object raises `error` naming file:line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text: {exc.reason}") from None
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise error(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, line_number, row
