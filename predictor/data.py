"""Reading prompt/output-length JSONL files and splitting them by prompt.

Any JSONL with `prompt` and `output_tokens` works; `task` and `prompt_id` are optional.
Bad rows raise `DataError` naming the file and line, so the CLI can print one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import PredictionInput
from predictor.jsonl import iter_jsonl_objects

__all__ = ["DataError", "LengthRecord", "load_records", "split_by_prompt_id"]


class DataError(ValueError):
    """A data file that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class LengthRecord:
    """One answered prompt: its text, metadata and the true output length."""

    prompt: str
    output_tokens: int
    task: str | None
    prompt_id: str  # rows with the same id are the same prompt (never split them)
    line_number: int

    def to_input(self) -> PredictionInput:
        return PredictionInput(prompt=self.prompt, task=self.task)


def _parse_row(row: dict[str, Any], where: str, line_number: int) -> LengthRecord:
    for field in ("prompt", "output_tokens"):
        if field not in row:
            raise DataError(f"{where}: missing field '{field}'")
    prompt, output_tokens = row["prompt"], row["output_tokens"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: 'prompt' must be a non-empty string")
    if isinstance(output_tokens, bool) or not isinstance(output_tokens, int):
        raise DataError(f"{where}: 'output_tokens' must be an integer, got {output_tokens!r}")
    if output_tokens < 1:
        raise DataError(f"{where}: 'output_tokens' must be >= 1, got {output_tokens}")
    task = row.get("task")
    if task is not None and not isinstance(task, str):
        raise DataError(f"{where}: 'task' must be a string or null, got {task!r}")
    prompt_id = row.get("prompt_id")
    if prompt_id is not None and not isinstance(prompt_id, str | int):
        raise DataError(f"{where}: 'prompt_id' must be a string or integer, got {prompt_id!r}")
    # Without an id, identical prompt text is the same prompt.
    group = str(prompt_id) if prompt_id is not None else f"text:{prompt}"
    return LengthRecord(prompt, output_tokens, task or None, group, line_number)


def load_records(path: str | Path) -> list[LengthRecord]:
    """Every non-blank line of a JSONL file as a validated record."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = [
        _parse_row(row, where, line_number)
        for where, line_number, row in iter_jsonl_objects(path, DataError)
    ]
    if not records:
        raise DataError(f"{path}: no records")
    return records


def split_by_prompt_id(
    records: Sequence[LengthRecord], test_fraction: float = 0.2, seed: int = 0
) -> tuple[list[LengthRecord], list[LengthRecord]]:
    """(train, test) with every prompt entirely on one side."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    groups = sorted({r.prompt_id for r in records})
    if len(groups) < 2:
        raise ValueError("need at least 2 distinct prompts to split")
    order = np.random.default_rng(seed).permutation(len(groups))
    num_test = min(max(1, round(test_fraction * len(groups))), len(groups) - 1)
    test_groups = {groups[i] for i in order[:num_test]}
    train = [r for r in records if r.prompt_id not in test_groups]
    test = [r for r in records if r.prompt_id in test_groups]
    return train, test
