"""The robustness matrix's ratios, tables and resumable cell file (no simulation)."""

from __future__ import annotations

import pytest

from app.routing.registry import PolicyKind
from benchmarks.robustness import (
    BASELINES,
    POLICIES,
    append_cells,
    main,
    matrix,
    missing_runs,
    read_cells,
    without_runs,
)

pytestmark = pytest.mark.scripts


def cells_for(process: str, seed: int, goodserve: float, exact: float,
              best: tuple[str, float]) -> list[dict]:
    rows = []
    for scale in (1.0, 2.0):
        for kind in (PolicyKind.GOODSERVE, PolicyKind.GOODSERVE_EXACT, *BASELINES):
            goodput = {PolicyKind.GOODSERVE.value: goodserve,
                       PolicyKind.GOODSERVE_EXACT.value: exact,
                       best[0]: best[1]}.get(kind.value, 1.0) * scale
            rows.append({"process": process, "rate_rps": 190.0, "seed": seed,
                         "policy": kind.value, "slo_scale": scale, "requests": 100,
                         "met": int(goodput), "goodput_rps": goodput})
    return rows


def test_ratios_use_each_seeds_best_baseline():
    cells = [*cells_for("gamma-cv13", 2, 30.0, 15.0, ("round-robin", 50.0)),
             *cells_for("gamma-cv13", 3, 60.0, 60.0, ("slo-pack", 40.0))]
    rows = matrix(cells)
    assert [(r.process, r.slo_scale) for r in rows] == [("gamma-cv13", 1.0),
                                                        ("gamma-cv13", 2.0)]
    first = rows[0]
    assert first.seeds == (2, 3) and first.best == ("round-robin", "slo-pack")
    assert first.vs_best == pytest.approx((0.6, 1.5))
    assert first.exact_vs_goodserve == pytest.approx((0.5, 1.0))
    assert first.goodserve_rps == pytest.approx(45.0)


def test_cells_resume_and_the_report_is_written(tmp_path):
    path = tmp_path / "cells.csv"
    append_cells(path, cells_for("poisson", 2, 30.0, 30.0, ("preble", 20.0)))
    append_cells(path, cells_for("batch", 2, 10.0, 12.0, ("round-robin", 20.0)))
    cells = read_cells(path)
    assert {(c["process"], c["seed"]) for c in cells} == {("poisson", 2), ("batch", 2)}
    assert main(["--out", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "matrix.md").read_text()
    assert "| poisson | 190 | 1.50 | 1.50 |" in report  # GoodServe / best baseline
    assert "| batch | 190 | 0.50 | 0.50 |" in report
    assert "| batch | 190 | 1.20 | 1.20 |" in report  # exact / GoodServe
    assert (tmp_path / "matrix.png").stat().st_size > 1000
    assert (tmp_path / "matrix.csv").read_text().count("\n") == 5


def test_an_unknown_process_is_one_line(capsys):
    assert main(["--processes", "poisson,nope", "--report-only"]) == 2
    assert "unknown process 'nope'" in capsys.readouterr().out


def test_a_rerun_replaces_only_the_chosen_policies_on_the_chosen_workloads():
    cells = [*cells_for("poisson", 2, 30.0, 30.0, ("preble", 20.0)),
             *cells_for("poisson", 3, 30.0, 30.0, ("preble", 20.0))]
    chosen = [PolicyKind.GOODSERVE, PolicyKind.GOODSERVE_EXACT]
    assert missing_runs(cells, [("poisson", 190.0, 2), ("batch", 190.0, 2)], POLICIES) == [
        (("batch", 190.0, 2), POLICIES)]
    kept = without_runs(cells, [("poisson", 190.0, 2)], chosen)
    assert len(kept) == len(cells) - 4  # two policies x two scales
    assert missing_runs(kept, [("poisson", 190.0, 2), ("poisson", 190.0, 3)], POLICIES) == [
        (("poisson", 190.0, 2), tuple(chosen))]
    assert [r.seeds for r in matrix(kept)] == [(3,), (3,)]  # seed 2 is incomplete meanwhile


def test_an_unknown_policy_is_one_line(capsys):
    assert main(["--policies", "goodserve,nope", "--report-only"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().out
