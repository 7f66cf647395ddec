"""What migration does, request by request (the routing target "removing migration lowers goodput").

GoodServe and its no-migration ablation replay the same workload. Their goodput
difference mixes two things: what the watchdog's moves did to the requests it moved,
and everything else - one different decision reorders the rest of the run, so other
requests meet or miss, and even first placements differ (about a fifth of them at 190
req/s). On this simulator that second part is hundreds of requests either way, so one
run's difference says little about migration itself. Pairing the two runs' outcomes
by request id separates them. A moved request compares like with like only when the
other run placed it on the same instance first:

- direct = rescued - lost, over those like-for-like moves: met only with the move,
  minus met only without it;
- indirect = everything else: requests never moved, and moved requests that the other
  run placed elsewhere to begin with;
- total = direct + indirect = met with migration - met without.
Moves of requests that would have met anyway ("unneeded") cost their target
capacity; that cost lands in the indirect part.

Pooling runs: `python -m benchmarks.migration_effect EFFECT_CSV... [--out pooled.md]`
merges the effect.csv files of several runs (other seeds) and reports, per SLO scale,
the mean direct and total effect with a 95% Student-t interval over seeds - the total
is the plain with/without goodput difference, whose sign one seed cannot settle.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from app.experiments.replay import read_keyed_rows, write_rows_csv
from app.sim.records import RequestOutcome, RequestRecord
from benchmarks.cli import run_command


@dataclass(frozen=True)
class MigrationEffect:
    """Paired outcomes of one workload with migration on (`with`) and off (`without`)."""

    num_requests: int
    num_moved: int  # requests the watchdog moved at least once
    num_placed_elsewhere: int  # moved, but first placed elsewhere in the other run
    # moved, same first instance in both runs:
    rescued: int  # met with migration, missed without
    lost: int  # missed with migration, met without
    unneeded: int  # met in both runs
    moved_missed_both: int  # missed in both runs
    met_with: int
    met_without: int

    @property
    def direct(self) -> int:
        return self.rescued - self.lost

    @property
    def indirect(self) -> int:
        return self.total - self.direct

    @property
    def total(self) -> int:
        return self.met_with - self.met_without

    def as_row(self) -> dict[str, int]:
        return {**asdict(self), "direct": self.direct, "indirect": self.indirect,
                "total": self.total}


def _met(record: RequestRecord) -> bool:
    return record.outcome == RequestOutcome.MET


def _first_instance(record: RequestRecord) -> str | None:
    return record.instance_ids[0] if record.instance_ids else None


def paired_effect(
    with_migration: Sequence[RequestRecord], without_migration: Sequence[RequestRecord]
) -> MigrationEffect:
    """Pair two runs of the same workload by request id (ValueError if they differ)."""
    others = {r.request_id: r for r in without_migration}
    ids = {r.request_id for r in with_migration}
    if not len(ids) == len(with_migration) == len(others) == len(without_migration) or (
            ids != set(others)):
        raise ValueError("the two runs must hold the same requests, each once")
    counts = dict.fromkeys(("rescued", "lost", "unneeded", "moved_missed_both"), 0)
    key = {(True, False): "rescued", (False, True): "lost",
           (True, True): "unneeded", (False, False): "moved_missed_both"}
    moved = [r for r in with_migration if r.num_migrations]
    placed_elsewhere = 0
    for record in moved:
        other = others[record.request_id]
        if _first_instance(record) != _first_instance(other):
            placed_elsewhere += 1
            continue
        counts[key[_met(record), _met(other)]] += 1
    return MigrationEffect(
        num_requests=len(ids), num_moved=len(moved), num_placed_elsewhere=placed_elsewhere,
        met_with=sum(map(_met, with_migration)), met_without=sum(map(_met, without_migration)),
        **counts,
    )


# (seed, SLO scale) -> effect
EffectTable = Mapping[tuple[int, float], MigrationEffect]


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


def effect_report(effects: EffectTable, duration_s: float) -> str:
    """Markdown: per scale, the mean over seeds of each part (req/s) and the seeds on
    which the direct effect is positive."""
    scales = sorted({scale for _, scale in effects})
    seeds = sorted({seed for seed, _ in effects})
    lines = [
        f"Migration's effect on goodput, paired by request (req/s = requests / "
        f"{duration_s:g} s window), mean over seeds {','.join(map(str, seeds))}",
        "",
        "| SLO scale | moved | like for like | rescued | lost | unneeded | missed anyway "
        "| direct | indirect | total | seeds with direct > 0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scale in scales:
        cells = [effects[seed, scale] for seed in seeds]
        positive = sum(c.direct > 0 for c in cells)
        lines.append(
            f"| {scale:g} | {_mean([c.num_moved for c in cells]):.1f} "
            f"| {_mean([c.num_moved - c.num_placed_elsewhere for c in cells]):.1f} "
            f"| {_mean([c.rescued for c in cells]):.1f} | {_mean([c.lost for c in cells]):.1f} "
            f"| {_mean([c.unneeded for c in cells]):.1f} "
            f"| {_mean([c.moved_missed_both for c in cells]):.1f} "
            f"| {_mean([c.direct for c in cells]) / duration_s:+.2f} "
            f"| {_mean([c.indirect for c in cells]) / duration_s:+.2f} "
            f"| {_mean([c.total for c in cells]) / duration_s:+.2f} "
            f"| {positive} of {len(cells)} |"
        )
    return "\n".join(lines)


def write_effects(
    out: Path, effects: EffectTable, duration_s: float, setup: Mapping[str, Any] | None = None
) -> None:
    """effect.csv (one row per seed and scale), effect.md (the `setup` lines, then the
    tables) and effect.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"seed": seed, "slo_scale": scale, **effect.as_row()}
            for (seed, scale), effect in sorted(effects.items())]
    write_rows_csv(out / "effect.csv", rows, list(rows[0]))
    header = [f"- {key}: {value}" for key, value in (setup or {}).items()]
    interval = ["", "Mean over seeds with its 95% interval (total = the plain with/without "
                "goodput difference):", "", pooled_report(effects, duration_s)]
    (out / "effect.md").write_text(
        "\n".join([*header, *([""] if header else []), effect_report(effects, duration_s),
                   *interval]) + "\n")
    plot_effects(out / "effect.png", effects, duration_s)


def plot_effects(path: Path, effects: EffectTable, duration_s: float) -> None:
    """Direct, indirect and total effect (req/s) per SLO scale, one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({scale for _, scale in effects})
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for offset, (part, colour) in zip(
            (-0.12, 0.0, 0.12), (("direct", "tab:green"), ("indirect", "tab:grey"),
                                 ("total", "tab:blue")), strict=True):
        for i, scale in enumerate(scales):
            values = [getattr(e, part) / duration_s for (_, s), e in effects.items()
                      if s == scale]
            ax.scatter([i + offset] * len(values), values, color=colour, s=14,
                       label=part if i == 0 else None)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(scales)), [f"{s:g}" for s in scales])
    ax.set_xlabel("SLO scale")
    ax.set_ylabel("goodput change from migration (req/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_effects(paths: Sequence[Path]) -> dict[tuple[int, float], MigrationEffect]:
    """The effect.csv files `write_effects` wrote, merged (a seed and scale may appear
    once only)."""
    names = [field.name for field in fields(MigrationEffect)]
    rows = read_keyed_rows(paths, lambda row: (int(row["seed"]), float(row["slo_scale"])),
                           lambda key: f"seed {key[0]} at scale {key[1]:g}")
    return {key: MigrationEffect(**{name: int(row[name]) for name in names})
            for key, row in rows.items()}


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the two-sided Student-t interval); inf with one value."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.inf
    sem = statistics.stdev(values) / math.sqrt(len(values))
    return mean, float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * sem


def pooled_report(effects: EffectTable, duration_s: float) -> str:
    """Markdown: per scale, the direct and total effect (req/s) as mean [95% interval]
    over seeds, the total relative to goodput without migration, and the seeds on
    which the total is positive."""
    scales = sorted({scale for _, scale in effects})
    lines = ["| SLO scale | seeds | direct (req/s) | total (req/s) | total / without "
             "| seeds with total > 0 |", "|---|---|---|---|---|---|"]
    for scale in scales:
        cells = [e for (_, s), e in sorted(effects.items()) if s == scale]
        parts = []
        for values in ([c.direct for c in cells], [c.total for c in cells]):
            mean, half = mean_interval([v / duration_s for v in values])
            parts.append(f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]")
        relative = sum(c.total for c in cells) / sum(c.met_without for c in cells)
        lines.append(f"| {scale:g} | {len(cells)} | {parts[0]} | {parts[1]} "
                     f"| {relative:+.1%} | {sum(c.total > 0 for c in cells)} of {len(cells)} |")
    return "\n".join(lines)


def pool(
    effects: Annotated[list[Path], typer.Argument(help="effect.csv files")],
    duration: Annotated[float, typer.Option(help="arrival window, s")] = 60.0,
    out: Annotated[Path | None, typer.Option(help="also write the table here")] = None,
) -> int:
    """Print (and with --out, write) the pooled report of effect.csv files."""
    try:
        report = pooled_report(read_effects(effects), duration)
    except (KeyError, ValueError) as error:
        print(f"error: {error}")
        return 2
    print(report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(pool, argv, "pool effect.csv files over seeds")


if __name__ == "__main__":
    raise SystemExit(main())
