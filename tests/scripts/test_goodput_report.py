"""The multi-seed report: means, ranges and per-seed ratios come out of the cells."""

from __future__ import annotations

import json

import pytest

from app.experiments.replay import RunOutcome
from benchmarks.goodput_experiments import SCALES, SEED_POLICIES, main, seeds_report

pytestmark = pytest.mark.scripts


def test_seeds_report_ratios_use_the_best_baseline_of_each_seed_and_scale():
    cells = []
    for seed in (0, 1):
        for kind in SEED_POLICIES:
            goodput = {"goodserve": 120.0 + seed * 10, "slo-pack": 100.0,
                       "preble": 90.0 + seed * 30, "goodserve-exact-lengths": 150.0,
                       "goodserve-no-migration": 110.0}.get(kind.value, 50.0)
            for scale in SCALES:
                cells.append(RunOutcome(f"{kind.value} seed={seed}", scale,
                                        {"goodput_rps": goodput}, ()))
    report = seeds_report(cells, [0, 1])
    assert "| goodserve | 125.0 [120.0, 130.0]" in report
    assert "| 0 | 1.20 (slo-pack)" in report  # 120 / 100
    assert "| 1 | 1.08 (preble)" in report  # 130 / 120
    assert "| 0 | 1.09 |" in report and "| 1 | 0.87 |" in report  # vs no-migration, exact lengths


def test_placement_rows_count_first_placements_and_met_by_output_tercile():
    from app.experiments.replay import placement_rows
    from app.sim.records import RequestOutcome, RequestRecord

    def record(rid: str, output: int, instances: list[str], met: bool) -> RequestRecord:
        outcome = RequestOutcome.MET if met else RequestOutcome.VIOLATED
        return RequestRecord(rid, 0.0, 1.0, 1.0, 10, output, instance_ids=instances,
                             outcome=outcome)

    records = (
        record("a", 10, ["h800-0"], True), record("b", 20, ["h800-0"], True),
        record("c", 100, ["a40-0", "h800-0"], True),  # migrated: counts where it started
        record("d", 200, ["a40-0"], False), record("e", 900, ["h800-0"], False),
        record("f", 1000, [], False),  # rejected: never placed
    )
    rows = placement_rows([RunOutcome("goodserve", 1.0, {}, records)])
    table = {(r["instance"], r["output_band"]): (r["placed"], r["met"]) for r in rows}
    assert {r["band_cuts"] for r in rows} == {"100/900"}
    assert table == {("h800-0", "short"): (2, 2), ("a40-0", "mid"): (2, 1),
                     ("h800-0", "long"): (1, 0), ("-", "long"): (1, 0)}


@pytest.mark.parametrize("flag, value", [
    ("--stall-factor", "-1"), ("--headroom", "-0.5"), ("--confidence-quantile", "0.3"),
    ("--reservation-quantile", "2"),
])
def test_bad_knobs_get_a_one_line_error_before_any_work(flag, value, capsys):
    assert main([flag, value, "--trace", "/nonexistent"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # knob_options' line, on stderr
    assert line.startswith(f"error: {flag}: Input should be")


def test_seeds_runs_pool_from_their_summary_files(tmp_path, capsys):
    from app.experiments.replay import write_summary_csv

    for seed in (3, 7):
        cells = [RunOutcome(f"{kind.value} seed={seed}", scale,
                            {"policy": f"{kind.value} seed={seed}", "slo_scale": scale,
                             "goodput_rps": 100.0 + seed if kind.value == "goodserve" else 50.0},
                            ()) for kind in SEED_POLICIES for scale in SCALES]
        write_summary_csv(tmp_path / f"s{seed}.csv", cells)
    paths = [str(tmp_path / "s3.csv"), str(tmp_path / "s7.csv")]
    assert main(["--pool", *paths, "--out", str(tmp_path / "pooled")]) == 0
    pooled = (tmp_path / "pooled" / "seeds.md").read_text()
    assert pooled.startswith("Seeds 3,7\n")
    assert "| goodserve | 105.0 [103.0, 107.0]" in pooled
    assert "| 7 | 2.14 (" in pooled  # 107 / 50
    assert main(["--pool", paths[0], paths[0], "--out", str(tmp_path / "twice")]) == 2
    assert main(["--pool", str(tmp_path / "none.csv")]) == 2
    # a rerun of goodserve on seed 7 replaces its cells, nothing else
    rerun = [RunOutcome("goodserve seed=7", scale, {"policy": "goodserve seed=7",
                        "slo_scale": scale, "goodput_rps": 120.0}, ()) for scale in SCALES]
    write_summary_csv(tmp_path / "rerun.csv", rerun)
    overridden = tmp_path / "overridden"
    assert main(["--pool", *paths, "--override", str(tmp_path / "rerun.csv"),
                 "--out", str(overridden)]) == 0
    text = (overridden / "seeds.md").read_text()
    assert "| goodserve | 111.5 [103.0, 120.0]" in text and "rerun.csv" in text
    assert "| 7 | 2.40 (" in text  # 120 / 50
    stray = [RunOutcome("goodserve seed=9", 1.0, {"policy": "goodserve seed=9",
                        "slo_scale": 1.0, "goodput_rps": 1.0}, ())]
    write_summary_csv(tmp_path / "stray.csv", stray)
    assert main(["--pool", *paths, "--override", str(tmp_path / "stray.csv")]) == 2
    assert main(["--override", str(tmp_path / "rerun.csv")]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if "error" in line]
    assert len(errors) == 4 and all(line.startswith("error: ") for line in errors)
    assert "goodserve seed=9 at scale 1" in errors[2] and "--pool" in errors[3]


def test_held_out_split_is_renamed_into_place_whole(tmp_path):
    from benchmarks.goodput_experiments import held_out_prompts

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt_id": f"p{i // 2}", "source": "test", "task": "chat",
             "model": "m", "prompt_tokens": 5, "output_tokens": 10 + i,
             "prompt": f"text {i}"} for i in range(40)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cache = tmp_path / "cache"
    train, test = held_out_prompts(prompts, cache, seed=0)
    train_ids = {json.loads(line)["prompt_id"] for line in train.read_text().splitlines()}
    test_ids = {json.loads(line)["prompt_id"] for line in test.read_text().splitlines()}
    assert train_ids and test_ids and not train_ids & test_ids
    assert len(train.read_text().splitlines()) + len(test.read_text().splitlines()) == 40
    assert sorted(p.name for p in cache.iterdir()) == ["prompts-test.jsonl",
                                                       "prompts-train.jsonl"]
