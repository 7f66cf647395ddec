"""`benchmarks.same_records` tells identical replays from ones that differ in one field."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.same_records import main

pytestmark = pytest.mark.scripts


def write(directory, rows):
    directory.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), directory / "requests.parquet")


def record(request_id, finish_s, **extra):
    return {"policy": "goodserve", "slo_scale": 2.0, "request_id": request_id,
            "finish_s": finish_s, "ttft_s": math.nan, **extra}


def test_identical_replays_pass_in_any_order(tmp_path, capsys):
    write(tmp_path / "a", [record("r1", 1.0), record("r2", 2.0)])
    write(tmp_path / "b", [record("r2", 2.0), record("r1", 1.0)])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "identical" in capsys.readouterr().out


def test_one_changed_field_or_missing_record_fails(tmp_path, capsys):
    write(tmp_path / "a", [record("r1", 1.0), record("r2", 2.0)])
    write(tmp_path / "b", [record("r1", 1.5)])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "finish_s: 1 differ" in out and "records: 1 differ" in out


def test_missing_output_is_a_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path), str(tmp_path)]) == 2
    assert "requests.parquet" in capsys.readouterr().err
