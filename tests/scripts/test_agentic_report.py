"""The agentic matrix's arithmetic: calibration, ratios over seeds, resumption (no
simulation: the unit runner is replaced by hand-made rows)."""

from __future__ import annotations

import pytest

import benchmarks.agentic as agentic
from app.routing.move_path import MoveRule
from app.routing.registry import PolicyKind
from benchmarks.agentic import (
    BASELINES,
    CANDIDATE_BASELINES,
    CELL_FIELDS,
    LOAD_FACTORS,
    TARGET_MET_SHARE,
    Calibration,
    GoodServeArm,
    MatrixSetup,
    NoCrossing,
    Unit,
    aggregate,
    best_baseline,
    calibrate,
    main,
    pending_units,
    plan_units,
    read_cells,
    stale_cells,
    write_markdown,
)
from benchmarks.matrix_io import append_rows

pytestmark = pytest.mark.scripts


def cell(policy, met, *, seed=0, factor=1.0, scale=2.0, workload="coding-agent",
         requests=100, rate=0.1):
    return {"workload": workload, "cluster": "small", "load_factor": factor, "rate": rate,
            "seed": seed, "policy": policy, "slo_scale": scale, "requests": requests,
            "met": met, "goodput_rps": met / 300}


# ---- calibration --------------------------------------------------------------------


def falling_share(rate):
    """1 / (1 + (rate / 2)^4): 0.8 at rate 2 x 0.25^(1/4) = 1.4142."""
    return 1 / (1 + (rate / 2) ** 4)


@pytest.mark.parametrize("start", [0.01, 0.3, 1.4, 1.5, 50.0, 300.0])
def test_calibration_finds_where_the_met_share_crosses_the_target(start):
    calls = []

    def share(rate):
        calls.append(rate)
        return falling_share(rate)

    found = calibrate(share, start)  # the default 6 bisections of a factor-2 bracket
    assert found == pytest.approx(2 * 0.25 ** 0.25, rel=0.006)
    assert falling_share(found) == pytest.approx(TARGET_MET_SHARE, abs=0.01)
    assert len(calls) <= 1 + 8 + 6


def test_calibration_on_a_step_lands_inside_the_step():
    """A met share that drops from 0.9 to 0.5 at rate 7: the answer brackets 7 tightly."""
    found = calibrate(lambda rate: 0.9 if rate < 7 else 0.5, 1.0)
    assert 7 / 1.02 < found < 7 * 1.02


def test_calibration_stops_at_the_lightest_measurable_rate():
    seen = []

    def share(rate):
        seen.append(rate)
        return 0.5

    with pytest.raises(NoCrossing) as raised:
        calibrate(share, 4.0, min_rate=1.0)
    assert raised.value.always_below
    assert min(seen) == pytest.approx(1.0)
    seen.clear()
    with pytest.raises(NoCrossing):
        calibrate(share, 0.1, min_rate=1.0)  # a start under the floor starts at the floor
    assert seen == [1.0]


def test_calibration_from_under_the_floor_still_finds_the_crossing():
    assert calibrate(falling_share, 0.1, min_rate=1.0) == pytest.approx(1.4142, rel=0.006)


def test_calibration_says_when_the_target_is_met_at_every_rate():
    with pytest.raises(NoCrossing) as raised:
        calibrate(lambda rate: 1.0, 1.0)
    assert not raised.value.always_below


def test_calibration_falls_back_to_every_baseline_only_when_the_cheap_ones_never_reach_it(
        monkeypatch):
    """Cheap baselines stay at 50%; another baseline meets 90% below rate 3."""
    def fake_cells(workload, cluster, rate, seed, setup, names, scales):
        share = 0.9 if ("slo-pack" in names and rate < 3) else 0.5
        return [{"met": int(share * 1000), "requests": 1000}]

    class FakeWorkload:
        requests = [None] * 1000
        graph = None  # open-loop: the request floor alone

    monkeypatch.setattr(agentic, "run_cells", fake_cells)
    monkeypatch.setattr(agentic, "make_workload", lambda *args: FakeWorkload())
    setup = MatrixSetup(dict.fromkeys(agentic.WORKLOADS, 300.0), agentic.TRACE, ("goodserve",))
    found = agentic.calibrate_pair("chat-agent", "small", setup, 100, ("round-robin",))
    assert found.policies == BASELINES and found.rate == pytest.approx(3, rel=0.02)


# ---- aggregation ----------------------------------------------------------------------


def test_ratios_take_each_seeds_best_baseline():
    cells = [
        cell("goodserve", 60, seed=0), cell("round-robin", 50, seed=0),
        cell("prefix-cache", 40, seed=0), cell("goodserve-exact-lengths", 90, seed=0),
        cell("goodserve", 80, seed=1), cell("round-robin", 50, seed=1),
        cell("prefix-cache", 100, seed=1), cell("goodserve-exact-lengths", 80, seed=1),
        cell("goodserve", 70, seed=2), cell("round-robin", 20, seed=2),
        cell("prefix-cache", 40, seed=2), cell("goodserve-exact-lengths", 70, seed=2),
    ]
    (row,) = aggregate(cells)
    assert row.seeds == (0, 1, 2)
    # 60 / 50 (round-robin), 80 / 100 (prefix-cache), 70 / 40 (prefix-cache)
    assert row.best == ("round-robin", "prefix-cache", "prefix-cache")
    assert row.best_named == "prefix-cache"
    assert row.vs_best == pytest.approx((1.2, 0.8, 1.75))
    assert row.best_met == (50, 100, 40)
    assert row.noise == pytest.approx((100 - 40) / (190 / 3))
    assert row.exact_vs_goodserve == pytest.approx((1.5, 1.0, 1.0))
    assert row.goodserve_share == pytest.approx((0.6, 0.8, 0.7))
    assert row.goodserve_goodput == pytest.approx((60 / 300, 80 / 300, 70 / 300))
    assert row.best_goodput == pytest.approx((50 / 300, 100 / 300, 40 / 300))


def test_goodserve_and_its_exact_variant_are_never_the_best_baseline():
    met = {"goodserve": 99, "goodserve-exact-lengths": 100, "slo-pack": 10, "dynamo-kv": 30}
    assert best_baseline(met) == "dynamo-kv"
    assert best_baseline({"goodserve": 1}) is None
    # a tie goes to the earlier baseline of CANDIDATE_BASELINES
    assert best_baseline({"preble": 5, "round-robin": 5}) == "round-robin"
    assert set(BASELINES) <= set(CANDIDATE_BASELINES)


def test_a_seed_without_goodserve_or_a_baseline_is_left_out():
    cells = [cell("goodserve", 60, seed=0), cell("llumnix", 30, seed=0),
             cell("goodserve", 10, seed=1), cell("round-robin", 50, seed=2)]
    (row,) = aggregate(cells)
    assert row.seeds == (0,) and row.vs_best == (2.0,) and row.noise is None


def test_zero_met_ratios():
    cells = [cell("goodserve", 0), cell("round-robin", 0), cell("goodserve", 5, scale=1.0),
             cell("round-robin", 0, scale=1.0)]
    rows = aggregate(cells)
    assert [(r.slo_scale, r.vs_best) for r in rows] == [(1.0, (float("inf"),)), (2.0, (1.0,))]


def test_collapse_is_met_at_one_and_a_half_times_the_load_over_met_at_the_load():
    cells = [cell("goodserve", 100, factor=1.0), cell("goodserve", 85, factor=1.5),
             cell("goodserve", 90, factor=1.0, seed=1), cell("goodserve", 90, factor=1.5, seed=1),
             cell("goodserve", 40, factor=0.5), cell("goodserve", 60, factor=1.5, seed=2)]
    cells += [cell("round-robin", 1, factor=c["load_factor"], seed=c["seed"]) for c in cells]
    rows = {r.load_factor: r for r in aggregate(cells)}
    assert rows[1.5].collapse == pytest.approx((0.85, 1.0))  # seed 2 has no 1.0x run
    assert rows[1.0].collapse == () and rows[0.5].collapse == ()


def test_markdown_names_the_best_baseline_the_noise_and_the_calibration(tmp_path):
    cells = [cell("goodserve", 60), cell("round-robin", 50), cell("goodserve", 66, seed=1),
             cell("round-robin", 60, seed=1), cell("goodserve", 30, factor=1.5),
             cell("round-robin", 30, factor=1.5)]
    path = tmp_path / "matrix.md"
    calibrations = [Calibration("coding-agent", "small", 300.0, 100, 0.1, ("round-robin",)),
                    Calibration("mooncake", "small", 300.0, 100, None, BASELINES, "too slow")]
    write_markdown(path, aggregate(cells), calibrations)
    text = path.read_text()
    # goodput: (60 + 66) / 2 / 300 and (50 + 60) / 2 / 300 steps met per second
    assert ("| 1x | 2 | 63% | 1.15 [1.10, 1.20] | round-robin | 0.18 | - | 0.21 / 0.183 |"
            in text)
    assert "| 1.5x | 2 | 30% | 1.00 | round-robin | - | - | 0.1 / 0.1 |" in text
    assert "GoodServe met at 1.5x load / at 1x: scale 2: 0.50" in text
    assert "coding-agent on small: 0.1 sessions/s" in text
    assert "mooncake on small: skipped: too slow" in text


def test_goodserve_arms_are_compared_with_goodserve_and_never_a_baseline(tmp_path):
    cells = [cell("goodserve", 60), cell("round-robin", 50), cell("goodserve@token-ids", 50),
             cell("goodserve@kv", 75), cell("goodserve", 66, seed=1),
             cell("round-robin", 60, seed=1), cell("goodserve@token-ids", 60, seed=1),
             cell("goodserve@kept-kv", 200, seed=1)]
    (row,) = aggregate(cells)
    assert row.best == ("round-robin", "round-robin")
    by_arm = dict(row.vs_arms)
    assert by_arm["token-ids"] == pytest.approx((1.2, 1.1))
    assert by_arm["kv"] == pytest.approx((0.8,)) and by_arm["kept-kv"] == pytest.approx((0.33,))
    assert set(by_arm) == {"token-ids", "kv", "kept-kv"}
    path = tmp_path / "matrix.md"
    write_markdown(path, [row], [])
    text = path.read_text()
    assert "| load | scale | / token-ids | / kv | / kept-kv |" in text
    assert "| 1x | 2 | 1.15 [1.10, 1.20] | 0.80 | 0.33 |" in text


def test_arms_run_goodserve_again_with_one_setting_changed(monkeypatch):
    ran = []

    def fake_replay(spec, workload):
        ran.append((spec.cluster.move_path, spec.cluster.keep_session_kv, spec.policies))
        return []

    monkeypatch.setattr(agentic, "run_replay", fake_replay)
    monkeypatch.setattr(agentic, "make_workload", lambda *args: None)
    arms = (GoodServeArm.forced_moves(MoveRule.TOKEN_IDS), GoodServeArm.forced_moves(MoveRule.KV),
            GoodServeArm.kept_session_kv())
    setup = MatrixSetup(dict(agentic.DURATION_S), agentic.TRACE, ("goodserve", "round-robin"),
                        arms)
    agentic.run_cells("chat-agent", "small", 0.1, 0, setup, setup.policies, (2.0,))
    goodserve = (PolicyKind.GOODSERVE,)
    assert ran == [(MoveRule.CHEAPER, False, (PolicyKind.GOODSERVE, PolicyKind.ROUND_ROBIN)),
                   (MoveRule.TOKEN_IDS, False, goodserve), (MoveRule.KV, False, goodserve),
                   (MoveRule.CHEAPER, True, goodserve)]


# ---- units and resumption ----------------------------------------------------------------


def test_units_cover_every_load_and_seed_of_the_calibrated_pairs():
    calibrations = [Calibration("chat-agent", "small", 300.0, 100, 2.0, ()),
                    Calibration("chat-agent", "large", 300.0, 100, 8.0, ()),
                    Calibration("mooncake", "small", 300.0, 100, None, (), "no")]
    units = plan_units(calibrations, {"small": [0, 1], "large": [0]})
    assert len(units) == len(LOAD_FACTORS) * 3
    assert {u.rate for u in units if u.cluster == "large"} == {8.0 * f for f in LOAD_FACTORS}
    assert all(u.workload == "chat-agent" for u in units)


def test_resume_skips_units_done_at_their_rate_and_reruns_those_of_an_earlier_rate():
    units = [Unit("coding-agent", "small", f, 0.2 * f, 0) for f in LOAD_FACTORS]
    cells = [cell("goodserve", 1, factor=0.5, rate=0.1),  # done
             cell("goodserve", 1, factor=0.8, rate=0.5),  # an earlier L*
             cell("goodserve", 1, factor=1.0, rate=0.2, seed=1)]  # another seed
    assert [u.load_factor for u in pending_units(units, cells)] == list(LOAD_FACTORS[1:])
    assert stale_cells(units, cells) == [cells[1]]


def test_main_resumes_only_the_missing_units(tmp_path, monkeypatch):
    """--resume keeps calibration.csv and cells.csv and runs what they lack."""
    calibration = Calibration("coding-agent", "small", 30.0, 100, 0.2,
                              agentic.CALIBRATION_POLICIES["coding-agent"])
    append_rows(tmp_path / "calibration.csv", [calibration.as_row()],
                agentic.CALIBRATION_FIELDS)
    done = [cell(p, 5, factor=0.5, rate=0.1) for p in ("goodserve", "round-robin")]
    append_rows(tmp_path / "cells.csv", done, CELL_FIELDS)
    ran = []

    def fake_unit(unit, setup):
        ran.append(unit.load_factor)
        return [{**cell(p, 7, factor=unit.load_factor, rate=unit.rate, seed=unit.seed),
                 "slo_scale": s} for p in setup.policies for s in agentic.SCALES]

    def no_calibration(*args):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(agentic, "run_unit", fake_unit)
    monkeypatch.setattr(agentic, "calibrate_pair", no_calibration)
    args = ["--out", str(tmp_path), "--resume", "--jobs", "1", "--duration", "30",
            "--only-workloads", "coding-agent", "--only-clusters", "small", "--seeds", "0",
            "--policies", "goodserve,round-robin"]
    assert main(args) == 0
    left = len(LOAD_FACTORS) - 1
    assert sorted(ran) == list(LOAD_FACTORS[1:])
    assert len(read_cells(tmp_path / "cells.csv")) == 2 + left * 2 * 4
    assert main(args) == 0 and len(ran) == left  # nothing left to run
    assert "| 1.5x | 3 |" in (tmp_path / "matrix.md").read_text()
    assert (tmp_path / "matrix.png").stat().st_size > 1000


def test_without_resume_the_matrix_starts_over(tmp_path, monkeypatch):
    append_rows(tmp_path / "cells.csv", [cell("goodserve", 1)], CELL_FIELDS)
    calibrated = []

    def fake_calibration(workload, cluster, setup, seed, policies):
        calibrated.append((workload, cluster, seed))
        return Calibration(workload, cluster, setup.duration_s(workload), seed, None, policies,
                           "no")

    monkeypatch.setattr(agentic, "calibrate_pair", fake_calibration)
    assert main(["--out", str(tmp_path), "--jobs", "1", "--only-workloads", "chat-agent",
                 "--only-clusters", "large"]) == 0
    assert calibrated == [("chat-agent", "large", 100)]
    assert read_cells(tmp_path / "cells.csv") == []


def test_each_workload_has_its_own_window_unless_one_is_given():
    assert agentic._durations("") == agentic.DURATION_S
    assert agentic.DURATION_S["coding-agent"] > agentic.DURATION_S["chat-agent"]
    assert set(agentic._durations("30").values()) == {30.0}
    assert agentic._durations("coding-agent=900") == {**agentic.DURATION_S, "coding-agent": 900.0}


def test_a_calibration_at_another_window_is_run_again(tmp_path, monkeypatch):
    """L* found with one window is not reused for a workload whose window changed."""
    old = Calibration("coding-agent", "small", 500.0, 100, 0.2,
                      agentic.CALIBRATION_POLICIES["coding-agent"])
    append_rows(tmp_path / "calibration.csv", [old.as_row()], agentic.CALIBRATION_FIELDS)
    calibrated = []

    def fake_calibration(workload, cluster, setup, seed, policies):
        calibrated.append(setup.duration_s(workload))
        return Calibration(workload, cluster, setup.duration_s(workload), seed, None, policies,
                           "no")

    monkeypatch.setattr(agentic, "calibrate_pair", fake_calibration)
    monkeypatch.setattr(agentic, "run_unit", lambda unit, setup: [])
    argv = ["--out", str(tmp_path), "--resume", "--jobs", "1", "--only-workloads",
            "coding-agent", "--only-clusters", "small", "--seeds", "0"]
    assert main([*argv, "--duration", "500"]) == 0 and calibrated == []
    assert main(argv) == 0 and calibrated == [agentic.DURATION_S["coding-agent"]]


@pytest.mark.parametrize("argv", [["--policies", "goodserve,nope"],
                                  ["--only-workloads", "poisson"],
                                  ["--seeds", "0,100"],
                                  ["--duration", "coding=10"],
                                  ["--duration", "coding-agent=-1"],
                                  ["--duration", "600,coding-agent=10"],
                                  ["--move-paths", "cheaper"]])
def test_bad_arguments_are_refused(tmp_path, argv):
    assert main(["--out", str(tmp_path), *argv]) == 2


def test_mooncake_is_skipped_with_the_reason_when_the_trace_is_absent(tmp_path, monkeypatch,
                                                                      capsys):
    def no_calibration(workload, *args):
        raise AssertionError(f"calibrated {workload}")

    monkeypatch.setattr(agentic, "calibrate_pair", no_calibration)
    assert main(["--out", str(tmp_path), "--jobs", "1", "--only-workloads", "mooncake",
                 "--trace", str(tmp_path / "absent.jsonl")]) == 0
    assert "skipping mooncake: the trace" in capsys.readouterr().out


def test_coding_agent_is_calibrated_on_its_own_baselines_and_others_reuse_theirs(tmp_path,
                                                                                monkeypatch):
    """Each workload's L* is bisected on its own calibration baselines; a kept row of
    other baselines is not reused for it."""
    setup = MatrixSetup(dict(agentic.DURATION_S), agentic.TRACE, ("goodserve",))
    kept = [Calibration("chat-agent", "small", agentic.DURATION_S["chat-agent"], 100, 0.4,
                        agentic.CALIBRATION_POLICIES["chat-agent"]),
            Calibration("coding-agent", "small", agentic.DURATION_S["coding-agent"], 100,
                        0.1, agentic.CHEAP_CALIBRATION)]
    append_rows(tmp_path / "calibration.csv", [c.as_row() for c in kept],
                agentic.CALIBRATION_FIELDS)
    asked = []

    def fake_calibration(workload, cluster, setup, seed, policies):
        asked.append((workload, policies))
        return Calibration(workload, cluster, setup.duration_s(workload), seed, 0.01, policies)

    monkeypatch.setattr(agentic, "calibrate_pair", fake_calibration)
    found = agentic.reference_rates(tmp_path, [("chat-agent", "small"), ("coding-agent", "small")],
                                    setup, 100, dict(agentic.CALIBRATION_POLICIES), 1)
    assert asked == [("coding-agent", ("preble", "llumnix"))]
    assert [c.rate for c in found] == [0.4, 0.01]


def test_the_attainment_plot_draws_every_policy_against_load(tmp_path, monkeypatch):
    """One line per policy in each (pair, scale) panel, over the loads it ran at, with
    the mean over seeds: GoodServe's 60% and 66% at 1x make a mean of 63%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [cell("goodserve", 60), cell("goodserve", 66, seed=1),
             cell("goodserve", 40, factor=2.0), cell("round-robin", 50),
             cell("round-robin", 20, factor=2.0), cell("goodserve-exact-lengths", 70)]
    drawn = []
    savefig = plt.Figure.savefig

    def record(fig, path, **kwargs):
        drawn.append({line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                      for ax in fig.axes for line in ax.get_lines()
                      if not line.get_label().startswith("_")})
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    agentic.write_attainment_plot(tmp_path / "attainment.png", cells)
    (lines,) = drawn
    assert lines["GoodServe"] == ([1.0, 2.0], [pytest.approx(0.63), pytest.approx(0.4)])
    assert lines["round-robin"] == ([1.0, 2.0], [pytest.approx(0.5), pytest.approx(0.2)])
    assert lines["exact lengths"] == ([1.0], [pytest.approx(0.7)])
    assert (tmp_path / "attainment.png").stat().st_size > 1000
