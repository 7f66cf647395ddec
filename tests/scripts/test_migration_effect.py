"""Pairing GoodServe's runs with and without migration request by request."""

from __future__ import annotations

import pytest

from app.experiments.replay import RunOutcome
from app.sim.records import RequestOutcome, RequestRecord
from benchmarks.goodput_experiments import SCALES, migration_effects
from benchmarks.migration_effect import (
    MigrationEffect,
    effect_report,
    main,
    mean_interval,
    paired_effect,
    pooled_report,
    read_effects,
    write_effects,
)

pytestmark = pytest.mark.scripts


def record(rid: str, met: bool, moves: int = 0, first: str = "A40") -> RequestRecord:
    outcome = RequestOutcome.MET if met else RequestOutcome.VIOLATED
    instances = [first, "H800"] if moves else [first]
    return RequestRecord(rid, 0.0, 1.0, 1.0, 10, 20, num_migrations=moves, outcome=outcome,
                         instance_ids=instances)


# request id -> (met with migration, moves, met without migration, first instance there)
RUNS = {
    "rescued": (True, 1, False, "A40"), "lost": (False, 1, True, "A40"),
    "unneeded": (True, 2, True, "A40"), "hopeless": (False, 1, False, "A40"),
    "elsewhere-a": (True, 1, False, "H800"), "elsewhere-b": (False, 1, True, "A800"),
    "elsewhere-c": (False, 1, True, "A800"), "gained": (True, 0, False, "A40"),
    "dropped": (False, 0, True, "A40"), "steady": (True, 0, True, "A40"),
    "missed": (False, 0, False, "A40"),
}


def runs() -> tuple[list[RequestRecord], list[RequestRecord]]:
    with_migration = [record(rid, on, moves) for rid, (on, moves, _, _) in RUNS.items()]
    without = [record(rid, off, first=first)
               for rid, (_, _, off, first) in reversed(RUNS.items())]
    return with_migration, without


def test_paired_effect_compares_moved_requests_only_like_for_like():
    effect = paired_effect(*runs())
    assert (effect.num_requests, effect.num_moved, effect.num_placed_elsewhere) == (11, 7, 3)
    # the moved requests first placed on the same instance in both runs
    assert (effect.rescued, effect.lost, effect.unneeded, effect.moved_missed_both) == (
        1, 1, 1, 1)
    assert (effect.met_with, effect.met_without) == (5, 6)
    # direct 1 - 1; indirect: placed elsewhere +1 -2, never moved +1 -1
    assert (effect.direct, effect.indirect, effect.total) == (0, -1, -1)


def test_paired_effect_refuses_runs_of_different_requests():
    with_migration, without = runs()
    with pytest.raises(ValueError, match="same requests"):
        paired_effect(with_migration, without[1:])
    with pytest.raises(ValueError, match="same requests"):
        paired_effect(with_migration, [*without[1:], record("other", True)])
    with pytest.raises(ValueError, match="same requests"):
        paired_effect([*with_migration, with_migration[0]], [*without, without[0]])


def test_effects_pair_each_seed_and_scale_and_report_means(tmp_path):
    with_migration, without = runs()
    cells = [RunOutcome(f"{policy} seed={seed}", scale, {}, tuple(records))
             for seed in (0, 1) for scale in SCALES
             for policy, records in (("goodserve", with_migration),
                                     ("goodserve-no-migration", without))]
    effects = migration_effects(cells, [0, 1])
    assert set(effects) == {(seed, scale) for seed in (0, 1) for scale in SCALES}
    assert effects[1, 2.0] == paired_effect(with_migration, without)
    report = effect_report(effects, duration_s=10.0)
    # moved 7, 4 like for like: rescued, lost, unneeded, missed anyway 1 each; direct 0,
    # indirect and total -1 request / 10 s
    assert "| 2 | 7.0 | 4.0 | 1.0 | 1.0 | 1.0 | 1.0 | +0.00 | -0.10 | -0.10 | 0 of 2 |" in report
    write_effects(tmp_path, effects, 10.0, {"rate_rps": 190.0})
    written = (tmp_path / "effect.md").read_text()
    assert written.startswith("- rate_rps: 190.0\n\n")
    assert "| 2 | 2 | +0.00 [+0.00, +0.00] | -0.10 [-0.10, -0.10] | -16.7% | 0 of 2 |" in written
    rows = (tmp_path / "effect.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * len(SCALES) and rows[0].startswith("seed,slo_scale,")
    assert (tmp_path / "effect.png").stat().st_size > 0


def effect(total: int, direct: int = 1) -> MigrationEffect:
    return MigrationEffect(num_requests=1000, num_moved=5, num_placed_elsewhere=1,
                           rescued=direct, lost=0, unneeded=1, moved_missed_both=1,
                           met_with=500 + total, met_without=500)


def test_mean_interval_is_the_student_t_interval():
    mean, half = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-3)  # t(0.975, 2) = 4.303
    assert mean_interval([5.0]) == (5.0, float("inf"))


def test_pooled_report_gives_the_plain_difference_with_its_interval():
    effects = {(seed, 2.0): effect(total) for seed, total in enumerate((10, 20, 30))}
    effects |= {(seed, 3.0): effect(-10, direct=2) for seed in range(3)}
    report = pooled_report(effects, duration_s=10.0)
    # totals 1, 2, 3 req/s: mean 2, half-width 4.303 x 1 / sqrt(3) = 2.48
    assert "| 2 | 3 | +0.10 [+0.10, +0.10] | +2.00 [-0.48, +4.48] | +4.0% | 3 of 3 |" in report
    assert "| 3 | 3 | +0.20 [+0.20, +0.20] | -1.00 [-1.00, -1.00] | -2.0% | 0 of 3 |" in report


def test_effect_csv_files_merge_and_refuse_a_seed_twice(tmp_path, capsys):
    with_migration, without = runs()
    first = {(0, 2.0): paired_effect(with_migration, without)}
    second = {(1, 2.0): effect(7)}
    write_effects(tmp_path / "a", first, 10.0)
    write_effects(tmp_path / "b", second, 10.0)
    paths = [tmp_path / "a" / "effect.csv", tmp_path / "b" / "effect.csv"]
    assert read_effects(paths) == {**first, **second}
    with pytest.raises(ValueError, match="seed 0 at scale 2"):
        read_effects([paths[0], paths[0]])
    assert main([*map(str, paths), "--duration", "10", "--out", str(tmp_path / "p.md")]) == 0
    assert "| 2 | 2 |" in (tmp_path / "p.md").read_text()
    assert main([str(paths[0]), str(paths[0])]) == 2
    assert main([str(tmp_path / "missing.csv")]) == 2
    assert capsys.readouterr().out.count("error: ") == 2
