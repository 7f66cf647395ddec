"""What migration does, request by request (issue 4's "removing migration lowers goodput").

GoodServe and its no-migration ablation replay the same workload. Their goodput
difference mixes two things: the requests the watchdog moved (rescued, or lost by
the move) and every other request, whose fate changes because one different decision
reorders the rest of the run (a moved request frees one instance and loads another).
On this simulator the second part is hundreds of requests either way, so one run's
difference says little about migration itself. Pairing the two runs' outcomes by
request id separates them:

- direct  = rescued - lost: moved requests that met only with the move, minus those
            that met only without it;
- indirect = unmoved requests that met only with migration on, minus the reverse;
- total = direct + indirect = met with - met without.
Moves of requests that met in both runs ("unneeded") cost their target capacity; that
cost shows up in the indirect part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from app.sim.records import RequestOutcome, RequestRecord


@dataclass(frozen=True)
class MigrationEffect:
    """Paired outcomes of one workload with migration on (`with`) and off (`without`)."""

    num_requests: int
    num_moved: int  # requests the watchdog moved at least once
    rescued: int  # moved; met with migration, missed without
    lost: int  # moved; missed with migration, met without
    unneeded: int  # moved; met in both runs
    moved_missed_both: int  # moved; missed in both runs
    unmoved_gained: int  # not moved; met only with migration on
    unmoved_lost: int  # not moved; met only with migration off
    met_with: int
    met_without: int

    @property
    def direct(self) -> int:
        return self.rescued - self.lost

    @property
    def indirect(self) -> int:
        return self.unmoved_gained - self.unmoved_lost

    @property
    def total(self) -> int:
        return self.met_with - self.met_without

    def as_row(self) -> dict[str, int]:
        return {**asdict(self), "direct": self.direct, "indirect": self.indirect,
                "total": self.total}


def _met(record: RequestRecord) -> bool:
    return record.outcome == RequestOutcome.MET


def paired_effect(
    with_migration: Sequence[RequestRecord], without_migration: Sequence[RequestRecord]
) -> MigrationEffect:
    """Pair two runs of the same workload by request id (ValueError if they differ)."""
    others = {r.request_id: r for r in without_migration}
    ids = {r.request_id for r in with_migration}
    if not len(ids) == len(with_migration) == len(others) == len(without_migration) or (
            ids != set(others)):
        raise ValueError("the two runs must hold the same requests, each once")
    counts = dict.fromkeys(("rescued", "lost", "unneeded", "moved_missed_both",
                            "unmoved_gained", "unmoved_lost"), 0)
    num_moved = 0
    for record in with_migration:
        met_on, met_off = _met(record), _met(others[record.request_id])
        if record.num_migrations:
            num_moved += 1
            key = {(True, False): "rescued", (False, True): "lost",
                   (True, True): "unneeded", (False, False): "moved_missed_both"}
            counts[key[met_on, met_off]] += 1
        elif met_on != met_off:
            counts["unmoved_gained" if met_on else "unmoved_lost"] += 1
    return MigrationEffect(
        num_requests=len(ids), num_moved=num_moved,
        met_with=sum(map(_met, with_migration)), met_without=sum(map(_met, without_migration)),
        **counts,
    )


# (seed, SLO scale) -> effect
EffectTable = Mapping[tuple[int, float], MigrationEffect]


def effect_report(effects: EffectTable, duration_s: float) -> str:
    """Markdown: per scale, the mean over seeds of each part (req/s) and the seeds on
    which the direct effect is positive."""
    scales = sorted({scale for _, scale in effects})
    seeds = sorted({seed for seed, _ in effects})
    lines = [
        f"Migration's effect on goodput, paired by request (req/s = requests / "
        f"{duration_s:g} s window), mean over seeds {','.join(map(str, seeds))}",
        "",
        "| SLO scale | moved | rescued | lost | unneeded | direct | indirect | total "
        "| seeds with direct > 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scale in scales:
        cells = [effects[seed, scale] for seed in seeds]

        def mean(values: list[int]) -> float:
            return sum(values) / len(values)

        positive = sum(c.direct > 0 for c in cells)
        lines.append(
            f"| {scale:g} | {mean([c.num_moved for c in cells]):.0f} "
            f"| {mean([c.rescued for c in cells]):.1f} | {mean([c.lost for c in cells]):.1f} "
            f"| {mean([c.unneeded for c in cells]):.1f} "
            f"| {mean([c.direct for c in cells]) / duration_s:+.2f} "
            f"| {mean([c.indirect for c in cells]) / duration_s:+.2f} "
            f"| {mean([c.total for c in cells]) / duration_s:+.2f} "
            f"| {positive} of {len(cells)} |"
        )
    return "\n".join(lines)


def write_effects(out: Path, effects: EffectTable, duration_s: float) -> None:
    """effect.csv (one row per seed and scale), effect.md and effect.png under `out`."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    rows = [{"seed": seed, "slo_scale": scale, **effect.as_row()}
            for (seed, scale), effect in sorted(effects.items())]
    with (out / "effect.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "effect.md").write_text(effect_report(effects, duration_s) + "\n")
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
