"""Speed beside a reference checkout: `goodserve overhead --reference` end to end against
HEAD, and `benchmarks.sim_speed --reference` (its report on hand-made runs, and a small
part run in this checkout and beside it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.experiments.reference import REPO, Checkout, PairedRun
from benchmarks.sim_speed import comparison_report, count_differences, main, report_lines

pytestmark = pytest.mark.scripts


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True,
                          text=True, check=True).stdout


def test_overhead_beside_head_reports_both_sides_and_their_ratios(tmp_path):
    """Both checkouts measure in processes of their own; the worktree HEAD was checked
    out in is gone afterwards."""
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "overhead", "--instances", "8", "--rps", "200",
         "--duration", "0.5", "--warmup", "0.2", "--reference", "HEAD", "--seeds", "0",
         "--out", str(tmp_path), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["reference"]["version"].startswith("HEAD (")
    assert Path(report["current"]["root"]) == REPO
    (seed,) = report["seeds"]
    assert seed["seed"] == 0 and seed["order"] == ["reference", "current"]
    for figure in ("decisions_per_s", "p50_ms", "p99_ms", "cpu_ms_per_decision",
                   "breakdown.choose"):
        assert seed["reference"][figure] > 0 and seed["current"][figure] > 0
        assert seed["ratio"][figure] == pytest.approx(
            seed["current"][figure] / seed["reference"][figure])
        assert set(report["summary"][figure]) == {"reference", "current", "ratio"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "current-seed0.json", "reference-seed0.json", "summary.json"]
    assert json.loads((tmp_path / "reference-seed0.json").read_text())["instances"] == 8
    checkout = report["reference"]["root"]  # this run's worktree, whatever others run
    assert "goodserve-reference-" in checkout
    assert not Path(checkout).exists() and checkout not in worktrees()


def part(wall: float, cpu: float, **counts: int) -> list[dict]:
    return [{"part": "capacity", "wall_s": wall, "cpu_s": cpu, "counts": counts}]


def test_the_sim_speed_report_checks_the_counts_and_gives_ratios():
    assert count_differences({"a@1": 3, "b@1": 4}, {"a@1": 3, "b@1": 5, "c@1": 1}) == [
        "b@1: 4 -> 5", "c@1: - -> 1"]
    runs = [PairedRun(("capacity", 0), ("reference", "current"), part(10.0, 8.0, g=5),
                      part(5.0, 6.0, g=5)),
            PairedRun(("capacity", 1), ("current", "reference"), part(10.0, 8.0, g=5),
                      part(20.0, 8.0, g=6))]
    report = comparison_report(Checkout("reference", Path("/r"), "HEAD (abc)"),
                               Checkout("current", Path("/c"), "abc"), [], runs)
    capacity = report["parts"]["capacity"]
    assert [r["ratio"] for r in capacity["runs"]] == [{"wall_s": 0.5, "cpu_s": 0.75},
                                                      {"wall_s": 2.0, "cpu_s": 1.0}]
    assert capacity["runs"][1]["count_differences"] == ["g: 5 -> 6"]
    assert not capacity["same_counts"]
    assert capacity["summary"]["wall_s"]["ratio"] == {"min": 0.5, "median": 1.25, "max": 2.0}
    text = "\n".join(report_lines(report))
    assert "capacity run 1 (current first):" in text and "counts: 1 differ: g: 5 -> 6" in text
    assert "counts: the same (1)" in text and "capacity over 2 runs:" in text


def test_sim_speed_rejects_an_unknown_part_or_a_bad_reference(capsys):
    assert main(["--parts", "capacity,nope"]) == 2
    assert "unknown part 'nope'" in capsys.readouterr().err
    assert main(["--parts", "capacity", "--reference", "no-such-ref-anywhere"]) == 2
    assert "neither a directory nor a commit" in capsys.readouterr().err


def test_small_sim_speed_parts_beside_this_checkout(capsys):
    """The capacity runs and a generated session log's replay (every policy, llm-d among
    them), in this checkout named as a directory and in itself: the counts agree."""
    assert main(["--parts", "capacity,sessions", "--capacity-rates", "1",
                 "--capacity-duration", "10", "--sessions-seconds", "5",
                 "--sessions-scales", "2", "--reference", str(REPO), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["parts"]) == ["capacity", "sessions"]
    for found in report["parts"].values():
        assert found["same_counts"]
        (run,) = found["runs"]
        assert run["reference"]["wall_s"] > 0 and run["ratio"]["cpu_s"] > 0
    assert list(report["parts"]["capacity"]["runs"][0]["current"]["counts"]) == ["goodserve@1"]
    assert "llm-d@2" in report["parts"]["sessions"]["runs"][0]["current"]["counts"]
