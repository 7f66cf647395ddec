"""`benchmarks.agentic --capacity`: the rate search on synthetic met shares, what counts
as a miss on tiny simulated runs, and the report on hand-made capacities."""

from __future__ import annotations

from dataclasses import replace

import pytest

import benchmarks.agentic as agentic
from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, run_replay
from app.routing.registry import PolicyKind, RoutingOptions
from benchmarks.agentic import (
    CAPACITY_FIELDS,
    CAPACITY_MAX_RUNS,
    CAPACITY_RESOLUTION,
    CAPACITY_SCALES,
    CAPACITY_SHARE,
    CAPACITY_SHARES,
    MAX_BRACKET_STEPS,
    Capacity,
    MatrixSetup,
    capacity_ratios,
    capacity_searches,
    main,
    met_share,
    pair_standing,
    read_capacities,
    write_capacity_markdown,
)
from benchmarks.matrix_io import append_rows

pytestmark = pytest.mark.scripts


# ---- the search ---------------------------------------------------------------------


def falling_share(rate: float, scale: float) -> float:
    """1 / (1 + (rate / scale)^4): CAPACITY_SHARE at rate scale x (1/9)^(1/4)."""
    return 1 / (1 + (rate / scale) ** 4)


def threshold(scale: float) -> float:
    return scale * (1 / 9) ** 0.25


class Counted:
    """A met share that records the (rate, scale) of every call."""

    def __init__(self, share):
        self.share = share
        self.calls: list[tuple[float, float]] = []

    def __call__(self, rate: float, scale: float) -> float:
        self.calls.append((rate, scale))
        return self.share(rate, scale)


@pytest.mark.parametrize("start", [0.15, 0.5, 1.2, 6.0])
def test_capacity_is_the_highest_rate_that_met_within_the_resolution(start):
    share = Counted(falling_share)
    found = capacity_searches(share, start)
    assert [scale for scale, _ in found] == list(CAPACITY_SCALES)
    for scale, crossing in found:
        assert falling_share(crossing.low, scale) >= CAPACITY_SHARE
        assert falling_share(crossing.high, scale) < CAPACITY_SHARE
        assert crossing.high <= crossing.low * (1 + CAPACITY_RESOLUTION)
        assert threshold(scale) / (1 + CAPACITY_RESOLUTION) <= crossing.low <= threshold(scale)
        assert crossing.runs <= CAPACITY_MAX_RUNS
    assert len(share.calls) == sum(c.runs for _, c in found)


def test_each_looser_scale_starts_at_the_capacity_of_the_scale_before():
    share = Counted(falling_share)
    found = capacity_searches(share, 0.3)
    firsts = [next(rate for rate, s in share.calls if s == scale) for scale in CAPACITY_SCALES]
    assert firsts[1:] == [crossing.low for _, crossing in found[:-1]]
    # a doubling brackets the next crossing, then 5 bisections reach 3%
    assert [c.runs for _, c in found[1:]] == [7, 7]


def test_a_step_in_the_met_share_is_found_from_below():
    found = capacity_searches(lambda rate, scale: 0.95 if rate < 7 * scale else 0.5, 1.0)
    for scale, crossing in found:
        assert 7 * scale / (1 + CAPACITY_RESOLUTION) <= crossing.low < 7 * scale


@pytest.mark.parametrize("max_runs", [1, 3, 6])
def test_the_search_stops_at_the_run_cap(max_runs):
    share = Counted(falling_share)
    found = capacity_searches(share, 0.01, max_runs=max_runs)
    assert all(crossing.runs <= max_runs for _, crossing in found)
    for scale in CAPACITY_SCALES:
        assert len([s for _, s in share.calls if s == scale]) <= max_runs
    _, first = found[0]  # from 0.01, five doublings still meet: no bracket yet
    assert first.high is None and first.low == pytest.approx(0.01 * 2 ** (max_runs - 1))


def test_a_policy_that_never_meets_the_share_has_no_capacity_down_to_the_floor():
    share = Counted(lambda rate, scale: 0.85)
    found = capacity_searches(share, 4.0, min_rate=0.5)
    for _, crossing in found:
        assert crossing.low is None and crossing.high == pytest.approx(0.5)
        assert crossing.runs == 1 + 3  # 4, 2, 1, 0.5
    assert min(rate for rate, _ in share.calls) == pytest.approx(0.5)


def test_a_policy_that_meets_the_share_at_every_rate_tried_has_a_lower_bound():
    found = capacity_searches(lambda rate, scale: 1.0, 0.1)
    for _, crossing in found:
        assert crossing.high is None
        assert crossing.runs == 1 + MAX_BRACKET_STEPS
    # each scale doubles on from the highest rate the one before it met
    assert found[0][1].low == pytest.approx(0.1 * 2 ** MAX_BRACKET_STEPS)
    assert found[-1][1].low == pytest.approx(0.1 * 2 ** (3 * MAX_BRACKET_STEPS))


def test_capacities_are_searched_per_policy_with_one_run_per_rate_and_scale(monkeypatch):
    """policy_capacities runs the one policy at the one scale, and keeps the bracket."""
    ran = []

    def fake_cells(workload, cluster, rate, seed, setup, policies, scales):
        ran.append((policies, scales))
        (scale,) = scales
        return [{"met": round(1000 * falling_share(rate, scale)), "requests": 1000}]

    class FakeWorkload:
        requests = [None] * 1000
        graph = None  # open-loop: the request floor alone

    monkeypatch.setattr(agentic, "run_cells", fake_cells)
    monkeypatch.setattr(agentic, "make_workload", lambda *args: FakeWorkload())
    setup = MatrixSetup(dict.fromkeys(agentic.WORKLOADS, 300.0), agentic.TRACE, ("slo-pack",))
    found = agentic.policy_capacities("chat-agent", "small", 0, "slo-pack", setup)
    assert [c.slo_scale for c in found] == list(CAPACITY_SCALES)
    assert {p for p, _ in ran} == {("slo-pack",)} and len(ran) == sum(c.runs for c in found)
    for c in found:
        assert c.capacity == pytest.approx(threshold(c.slo_scale), rel=CAPACITY_RESOLUTION)
        assert c.capacity < c.lowest_failing_rate and c.duration_s == 300.0
    at_80 = agentic.policy_capacities("chat-agent", "small", 0, "slo-pack", setup, 0.8)
    for c in at_80:  # 1 / (1 + x^4) = 0.8 at x = 0.25^(1/4)
        assert c.share == 0.8
        assert c.capacity == pytest.approx(c.slo_scale * 0.25 ** 0.25, rel=CAPACITY_RESOLUTION)


# ---- what counts as a miss --------------------------------------------------------------


def tiny_coding_setup() -> MatrixSetup:
    return MatrixSetup({**agentic.DURATION_S, "coding-agent": 120.0}, agentic.TRACE, ())


def test_rejected_steps_and_steps_never_sent_count_as_misses():
    """Admission control on an overloaded small cluster rejects steps, which ends their
    sessions; a 30 s drain stops the run before other steps are sent. Every one of them
    is in the denominator of the met share."""
    setup = tiny_coding_setup()
    config = load_cluster_config(agentic.CLUSTERS["small"])
    work = agentic.make_workload("coding-agent", config, 0.3, 0, setup)
    spec = ReplaySpec(config, (PolicyKind.GOODSERVE_ADMISSION,), (1.0,), seed=0,
                      routing=RoutingOptions(0), max_drain_s=30.0)
    (cell,) = run_replay(spec, work)
    reasons = [r.reject_reason or "" for r in cell.records]
    assert any(r.startswith("session ended") for r in reasons)
    assert any(r.startswith("not issued") for r in reasons)
    assert any(r.startswith("no instance can meet") for r in reasons)
    met = sum(r.outcome == "met" for r in cell.records)
    assert 0 < met < len(work.requests) == len(cell.records) == cell.summary["requests"]
    assert met_share(cell.summary) == pytest.approx(met / len(work.requests))


def test_the_searched_met_share_is_over_every_step_of_the_window():
    setup = tiny_coding_setup()
    config = load_cluster_config(agentic.CLUSTERS["small"])
    steps = len(agentic.make_workload("coding-agent", config, 0.3, 0, setup).requests)
    (row,) = agentic.run_cells("coding-agent", "small", 0.3, 0, setup,
                               ("goodserve-admission",), (1.0,))
    assert row["requests"] == steps and met_share(row) == pytest.approx(row["met"] / steps)
    assert met_share(row) < 0.5  # the rejections and the sessions they ended are misses


# ---- the report -------------------------------------------------------------------------


def capacity(policy, value, *, seed=0, scale=2.0, workload="chat-agent", cluster="small",
             failing=None, runs=7):
    failing = value * 1.02 if failing is None else failing
    return Capacity(workload, cluster, 500.0, seed, policy, scale, value,
                    failing if failing else None, runs)


def two_pairs() -> list[Capacity]:
    """chat-agent small: GoodServe 1.2x slo-pack on seed 0, 1.1x preble on seed 1;
    mooncake large: GoodServe 0.9x round-robin on both seeds."""
    return [
        capacity("goodserve", 1.2, seed=0), capacity("slo-pack", 1.0, seed=0),
        capacity("preble", 0.8, seed=0),
        capacity("goodserve", 1.1, seed=1), capacity("slo-pack", 0.5, seed=1),
        capacity("preble", 1.0, seed=1, failing=0),
        *(capacity(p, v, seed=s, workload="mooncake", cluster="large")
          for s in (0, 1) for p, v in (("goodserve", 3.6), ("round-robin", 4.0))),
    ]


def test_ratios_take_each_seeds_best_baseline_slo_pack_included():
    large, small = capacity_ratios(two_pairs())  # workloads in WORKLOADS order
    assert (small.workload, small.cluster, small.seeds) == ("chat-agent", "small", (0, 1))
    assert small.best == ("slo-pack", "preble")
    assert small.vs_best == pytest.approx((1.2, 1.1)) and small.mean == pytest.approx(1.15)
    assert large.vs_best == pytest.approx((0.9, 0.9)) and large.best_named == "round-robin"
    standing = pair_standing([small, large])
    assert [pair for pair, _ in standing] == [("mooncake", "large"), ("chat-agent", "small")]
    assert [value for _, value in standing] == pytest.approx([0.9, 1.15])


def test_a_seed_where_no_baseline_meets_the_share_is_not_divided_by(tmp_path):
    (row,) = capacity_ratios([capacity("goodserve", 0.4), capacity("llumnix", 0.0, failing=0.1)])
    assert row.vs_best == (None,) and row.mean is None
    (row,) = capacity_ratios([capacity("goodserve", 0.0, failing=0.1),
                              capacity("llumnix", 0.0, failing=0.1)])
    assert row.vs_best == (None,)  # neither meets it: no ratio either
    rows = [capacity("goodserve", 0.4, seed=0), capacity("llumnix", 0.0, seed=0, failing=0.1),
            capacity("goodserve", 0.5, seed=1), capacity("llumnix", 0.25, seed=1)]
    (row,) = capacity_ratios(rows)
    assert row.vs_best == (None, 2.0) and row.mean == 2.0  # the seed that has one
    write_capacity_markdown(tmp_path / "capacity.md", rows)
    assert "| chat-agent, small | 90% | 2 | 2.00 | -, 2.00 | llumnix |" in (
        tmp_path / "capacity.md").read_text()


def test_the_80_percent_capacity_is_reported_beside_the_90_percent_one(tmp_path):
    rows = [capacity("goodserve", 0.4), capacity("preble", 0.0, failing=0.1),
            replace(capacity("goodserve", 0.6), share=0.8),
            replace(capacity("preble", 0.3), share=0.8)]
    at_90, at_80 = capacity_ratios(rows)
    assert (at_90.share, at_90.vs_best) == (0.9, (None,))
    assert (at_80.share, at_80.vs_best) == (0.8, (2.0,))
    assert pair_standing([at_90, at_80]) == []  # 90% has no ratio to stand on
    write_capacity_markdown(tmp_path / "capacity.md", rows)
    text = (tmp_path / "capacity.md").read_text()
    assert "| chat-agent, small | 80% | 2 | 2.00 | 2.00 | preble |" in text
    assert "## chat-agent, small cluster, 80% of steps (sessions/s;" in text
    assert read_capacities_roundtrip(tmp_path, rows) == rows


def read_capacities_roundtrip(tmp_path, rows: list[Capacity]) -> list[Capacity]:
    path = tmp_path / "roundtrip.csv"
    append_rows(path, [c.as_row() for c in rows], CAPACITY_FIELDS)
    return read_capacities(path)


def test_rows_written_before_shares_were_recorded_read_as_90_percent(tmp_path):
    old_fields = [f for f in CAPACITY_FIELDS if f != "share"]
    row = {k: v for k, v in capacity("goodserve", 0.4).as_row().items() if k in old_fields}
    append_rows(tmp_path / "capacity.csv", [row], old_fields)
    (found,) = read_capacities(tmp_path / "capacity.csv")
    assert found.share == CAPACITY_SHARE == 0.9


def test_a_seed_without_goodserve_or_a_baseline_is_left_out():
    rows = capacity_ratios([capacity("goodserve", 1.0, seed=0), capacity("preble", 2.0, seed=0),
                            capacity("goodserve", 1.0, seed=1), capacity("preble", 2.0, seed=2)])
    assert [r.seeds for r in rows] == [(0,)]


def test_markdown_gives_the_ratio_per_pair_and_scale_and_the_weakest_and_best_pair(tmp_path):
    path = tmp_path / "capacity.md"
    write_capacity_markdown(path, two_pairs())
    text = path.read_text()
    assert "| chat-agent, small | 90% | 2 | 1.15 [1.10, 1.20] | 1.20, 1.10 | slo-pack |" in text
    assert "| mooncake, large | 90% | 2 | 0.90 [0.90, 0.90] | 0.90, 0.90 | round-robin |" in text
    assert ("Weakest pair: mooncake on large, 0.90; best pair: chat-agent on small, 1.15"
            in text)
    assert ("## chat-agent, small cluster, 90% of steps (sessions/s; seeds 0 1; 500 s windows)"
            in text)
    assert "## mooncake, large cluster, 90% of steps (req/s;" in text
    assert ("| goodserve | 1.15 [1.1, 1.2] | 14 |\n"
            "| preble | >= 0.9 [0.8, 1] | 14 |\n"  # seed 1 met at every rate tried
            "| slo-pack | 0.75 [0.5, 1] | 14 |") in text
    assert "stopped at the run cap" not in text


def test_markdown_counts_the_searches_the_run_cap_left_coarse(tmp_path):
    path = tmp_path / "capacity.md"
    write_capacity_markdown(path, [capacity("goodserve", 1.0, failing=1.5, runs=12),
                                   capacity("preble", 1.0)])
    assert "1 of 2 searches stopped at the run cap with the bracket wider than 3%" in (
        path.read_text())


# ---- command line -----------------------------------------------------------------------


def fake_capacities(workload, cluster, seed, policy, setup, share=CAPACITY_SHARE):
    value = {"goodserve": 1.2, "round-robin": 1.0}[policy] * (2 - share)
    return [Capacity(workload, cluster, setup.duration_s(workload), seed, policy, scale,
                     value * scale, value * scale * 1.02, 7, share)
            for scale in CAPACITY_SCALES]


def test_capacity_searches_every_pair_seed_and_policy_and_resumes(tmp_path, monkeypatch):
    searched = []

    def fake(workload, cluster, seed, policy, setup, share):
        searched.append((workload, cluster, seed, policy, share))
        return fake_capacities(workload, cluster, seed, policy, setup, share)

    monkeypatch.setattr(agentic, "policy_capacities", fake)
    argv = ["--capacity", "--out", str(tmp_path), "--jobs", "1", "--only-workloads",
            "coding-agent,chat-agent", "--only-clusters", "large", "--capacity-seeds", "0,1",
            "--policies", "goodserve,round-robin"]
    assert main(argv) == 0
    searches = 2 * 2 * 2 * len(CAPACITY_SHARES)  # pairs, seeds, policies, shares
    assert len(searched) == searches
    assert ("coding-agent", "large", 1, "round-robin", 0.8) in searched
    assert len(read_capacities(tmp_path / "capacity.csv")) == searches * len(CAPACITY_SCALES)
    text = (tmp_path / "capacity.md").read_text()
    assert "| coding-agent, large | 90% | 1.5 | 1.20 [1.20, 1.20] |" in text
    assert "| coding-agent, large | 80% | 1.5 | 1.20 [1.20, 1.20] |" in text
    assert not (tmp_path / "cells.csv").exists()  # the matrix did not run
    assert main([*argv, "--resume"]) == 0 and len(searched) == searches
    assert main([*argv, "--resume", "--duration", "chat-agent=60"]) == 0
    assert len(searched) == searches * 3 // 2  # chat-agent's rows were at another window
    assert main(argv) == 0 and len(searched) == searches * 5 // 2  # no --resume: anew


def test_capacity_defaults_to_goodserve_and_the_baselines(tmp_path, monkeypatch):
    policies = set()

    def fake(workload, cluster, seed, policy, setup, share):
        policies.add(policy)
        return []

    monkeypatch.setattr(agentic, "policy_capacities", fake)
    assert main(["--capacity", "--out", str(tmp_path), "--jobs", "1", "--only-workloads",
                 "chat-agent", "--only-clusters", "small", "--capacity-seeds", "0"]) == 0
    assert policies == set(agentic.CAPACITY_POLICIES) and "slo-pack" in policies
    assert agentic.EXACT not in policies


def test_capacity_report_only_rewrites_the_markdown_from_the_csv(tmp_path, monkeypatch):
    def no_search(*args):
        raise AssertionError("searched")

    monkeypatch.setattr(agentic, "policy_capacities", no_search)
    setup = MatrixSetup(dict(agentic.DURATION_S), agentic.TRACE, ())
    rows = [c.as_row() for p in ("goodserve", "round-robin")
            for c in fake_capacities("chat-agent", "small", 0, p, setup)]
    append_rows(tmp_path / "capacity.csv", rows, CAPACITY_FIELDS)
    assert main(["--capacity", "--report-only", "--out", str(tmp_path)]) == 0
    assert "| chat-agent, small | 90% | 3 | 1.20 |" in (tmp_path / "capacity.md").read_text()


def test_a_goodserve_arm_is_searched_as_its_own_policy_and_never_as_a_baseline(
        tmp_path, monkeypatch):
    """--keep-session-kv searches GoodServe with the setting changed beside GoodServe;
    the arm runs alone (no policy besides it, no other arm) and is never the best
    baseline."""
    ran = []

    def fake_cells(workload, cluster, rate, seed, setup, policies, scales):
        ran.append((policies, tuple(a.label for a in setup.arms)))
        return [{"met": round(1000 * falling_share(rate, scales[0])), "requests": 1000}]

    class FakeWorkload:
        requests = [None] * 1000
        graph = None  # open-loop: the request floor alone

    monkeypatch.setattr(agentic, "run_cells", fake_cells)
    monkeypatch.setattr(agentic, "make_workload", lambda *args: FakeWorkload())
    kept = agentic.GoodServeArm.kept_session_kv()
    setup = MatrixSetup(dict.fromkeys(agentic.WORKLOADS, 300.0), agentic.TRACE,
                        ("goodserve",), (kept,))
    agentic.policy_capacities("coding-agent", "small", 0, kept.label, setup)
    assert set(ran) == {((), ("goodserve@kept-kv",))}
    ran.clear()
    agentic.policy_capacities("coding-agent", "small", 0, "goodserve", setup)
    assert set(ran) == {(("goodserve",), ())}

    searched = []

    def fake(workload, cluster, seed, policy, setup, share):
        searched.append(policy)
        values = {"goodserve": 1.0, "round-robin": 0.5, kept.label: 2.0}
        return [Capacity(workload, cluster, 300.0, seed, policy, scale, values[policy],
                         values[policy] * 1.02, 7, share) for scale in CAPACITY_SCALES]

    monkeypatch.setattr(agentic, "policy_capacities", fake)
    assert main(["--capacity", "--keep-session-kv", "--out", str(tmp_path), "--jobs", "1",
                 "--only-workloads", "coding-agent", "--only-clusters", "small",
                 "--capacity-seeds", "0", "--policies", "goodserve,round-robin"]) == 0
    assert set(searched) == {"goodserve", "round-robin", kept.label}
    text = (tmp_path / "capacity.md").read_text()
    assert "| coding-agent, small | 90% | 2 | 2.00 | 2.00 | round-robin |" in text
    assert "| goodserve@kept-kv | 2 | 2 | 2 | 21 |" in text


def test_the_search_floor_holds_enough_sessions_as_well_as_enough_requests():
    """research-agent sessions hold ~20 steps: 50 requests would be 2-3 sessions, a window
    that may draw none, so the floor is the rate of MIN_SEARCH_SESSIONS sessions;
    chat-agent's 3-step sessions keep the request floor."""
    setup = MatrixSetup(dict(agentic.DURATION_S), agentic.TRACE, ())
    config = load_cluster_config(agentic.CLUSTERS["small"])
    for workload, sessions_bind in (("research-agent", True), ("chat-agent", False)):
        start, floor = agentic.search_range(workload, "small", 0, setup)
        work = agentic.make_workload(workload, config, start, 0, setup)
        sessions = {r.session_id for r in work.requests}
        by_sessions = start * agentic.MIN_SEARCH_SESSIONS / len(sessions)
        by_requests = start * agentic.MIN_SEARCH_REQUESTS / len(work.requests)
        assert floor == pytest.approx(max(by_sessions, by_requests))
        assert (by_sessions > by_requests) == sessions_bind
