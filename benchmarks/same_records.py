"""Are two replays the same request by request? (A refactor must not change a decision.)

Compares the `requests.parquet` of two `goodserve replay` outputs, matching records by
(policy, SLO scale, request id), field by field (NaN equals NaN). Prints the records
compared and, per field, how many differ; exits 0 when none does, 1 otherwise.
Usage: python -m benchmarks.same_records BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.cli import run_command

KEY = ("policy", "slo_scale", "request_id")


def read_records(directory: Path) -> dict[tuple, dict[str, Any]]:
    """The replay's records by (policy, SLO scale, request id)."""
    import pyarrow.parquet as pq

    path = directory / "requests.parquet"
    if not path.is_file():
        raise typer.BadParameter(f"{path} does not exist (not a `goodserve replay` output?)")
    return {tuple(r[k] for k in KEY): r for r in pq.read_table(path).to_pylist()}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(before: dict[tuple, dict], after: dict[tuple, dict]) -> Counter:
    """Per field, the records that differ; `records` counts records present on one side."""
    counts: Counter = Counter()
    counts["records"] = len(before.keys() ^ after.keys())
    for key in before.keys() & after.keys():
        x, y = before[key], after[key]
        for field in x.keys() | y.keys():
            if not same(x.get(field), y.get(field)):
                counts[field] += 1
    return +counts


def same_records(
    before: Annotated[Path, typer.Argument(help="replay output directory")],
    after: Annotated[Path, typer.Argument(help="replay output directory")],
) -> int:
    """Compare two replays request by request."""
    a, b = read_records(before), read_records(after)
    diff = differences(a, b)
    print(f"{len(a)} / {len(b)} records (policy x SLO scale x request)")
    if not diff:
        print("identical, field by field")
        return 0
    for field, count in diff.most_common():
        print(f"{field}: {count} differ")
    return 1


def main(argv: list[str] | None = None) -> int:
    return run_command(same_records, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
