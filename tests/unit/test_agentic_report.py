"""The agentic matrix's arithmetic: calibration, ratios over seeds, resumption."""

from __future__ import annotations

import pytest

from benchmarks.agentic import (
    TARGET_MET_SHARE,
    Unreachable,
    aggregate,
    calibrate,
    collapse_ratios,
    done_units,
    write_markdown,
)

pytestmark = pytest.mark.unit


def cell(policy, met, *, seed=0, factor=1.0, scale=2.0, workload="coding-agent"):
    return {"workload": workload, "cluster": "small", "load_factor": factor, "rate": 0.1,
            "seed": seed, "policy": policy, "slo_scale": scale, "requests": 100, "met": met,
            "goodput_rps": met / 600}


@pytest.mark.parametrize("start", [0.1, 1.4, 50.0])
def test_calibration_finds_where_the_met_share_crosses_the_target(start):
    """share = 1 / (1 + (rate / 2)^4) is 0.8 at rate 2 x 0.25^(1/4) = 1.414."""
    calls = []

    def share(rate):
        calls.append(rate)
        return 1 / (1 + (rate / 2) ** 4)

    found = calibrate(share, start, steps=8)
    assert found == pytest.approx(2 * 0.25 ** 0.25, rel=0.01)
    assert share(found) == pytest.approx(TARGET_MET_SHARE, abs=0.01)
    assert len(calls) < 20


def test_ratios_take_each_seeds_best_baseline():
    cells = [
        cell("goodserve", 60, seed=0), cell("round-robin", 50, seed=0),
        cell("prefix-cache", 40, seed=0), cell("goodserve-exact-lengths", 90, seed=0),
        cell("goodserve", 80, seed=1), cell("round-robin", 50, seed=1),
        cell("prefix-cache", 100, seed=1), cell("goodserve-exact-lengths", 80, seed=1),
    ]
    (row,) = aggregate(cells)
    # seed 0: 60 / 50 = 1.2 (round-robin); seed 1: 80 / 100 = 0.8 (prefix-cache)
    assert row["ratio_mean"] == pytest.approx(1.0)
    assert (row["ratio_min"], row["ratio_max"]) == pytest.approx((0.8, 1.2))
    assert row["best_baseline_met"] == pytest.approx(75.0)
    assert row["best_baseline_spread"] == pytest.approx(50 / 75)
    # exact / GoodServe: 90 / 60 = 1.5 and 80 / 80 = 1.0
    assert row["exact_mean"] == pytest.approx(1.25)
    assert row["best_baseline"] in {"round-robin", "prefix-cache"}


def test_collapse_is_met_at_one_and_a_half_times_the_load_over_met_at_the_load():
    cells = [cell("goodserve", 100, factor=1.0), cell("goodserve", 85, factor=1.5),
             cell("goodserve", 90, factor=1.0, seed=1), cell("goodserve", 90, factor=1.5,
                                                             seed=1)]
    assert collapse_ratios(cells) == {("coding-agent", "small", 2.0): pytest.approx(0.925)}


def test_resume_skips_the_units_already_written(tmp_path):
    cells = [cell("goodserve", 1, seed=2, factor=0.8), cell("round-robin", 1, seed=2,
                                                            factor=0.8)]
    assert done_units(cells) == {("coding-agent", "small", 0.8, 2)}


def test_markdown_names_the_best_baseline_and_the_noise(tmp_path):
    cells = [cell("goodserve", 60), cell("round-robin", 50)]
    path = tmp_path / "matrix.md"
    write_markdown(path, aggregate(cells), {}, {("coding-agent", "small"): 0.1})
    text = path.read_text()
    assert "| 1x | 2 | 1.20 | round-robin | 0.00 | - |" in text
    assert "coding-agent on small: 0.1 sessions/s" in text


def test_calibration_says_when_the_target_is_out_of_reach():
    with pytest.raises(Unreachable):
        calibrate(lambda rate: 0.5, 1.0)
