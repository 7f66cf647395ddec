"""GoodServe with several router replicas against one router (simulator).

Setup. Workloads:
- `headline`: the short-prompt headline (configs/paper-4gpu.yaml, Mooncake arrivals at
  190 req/s for 60 s, held-out prompts, the MoE (K=9) trained on the rest);
- the agentic matrix's units at load 1.0 x L* (`benchmarks.agentic`, its
  calibration.csv): `chat-agent` and `coding-agent` on paper-4gpu, `mooncake` and
  `chat-agent-large` on configs/mixed-16gpu.yaml, windows as in the matrix.
Variants (`--variants`): `K[/sharing[/spread]]`, K router replicas (`RouterFleet`),
sharing nothing | reports | budgets | learning (default: what the live replicas
share), spread session (default: a hash of the
session; lone requests at random) | random; replicas report every 0.1 s (the live poll).
Each variant runs GoodServe at every SLO scale of --scales on the same workload.
`--spread-ticks`: the Mooncake trace's timestamps are rounded to ticks of about ten
requests; spread each tick's requests up to the next (`mooncake/spread`) instead of
replaying them at one instant, where replicas cannot see each other's placements.

Choice and report data: the sharing was chosen on headline seed 0 and chat-agent seed
11; the report is headline seeds 1-3 and the matrix's seed 0 (`--seeds`).

Writes under --out: cells.csv (one row per workload, seed, variant and scale) and
report.md (each variant's met requests over one router's, mean over seeds).
Usage: python -m benchmarks.routers [--workloads headline,chat-agent] [--seeds 1,2,3]
       [--variants 1,2,4,8,16,4/nothing,4/budgets] [--jobs 2] [--resume] [--spread-ticks]
       [--reestimate conditional|repredict]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, run_replay
from app.routing.fleet import FleetConfig, Sharing, Spread
from app.routing.goodserve import GoodServeConfig, LengthReestimate
from app.routing.length import PredictorLength
from app.routing.registry import PolicyKind, RoutingOptions
from app.workloads.workload import spread_within_ticks
from benchmarks.agentic import CLUSTERS, DURATION_S, TRACE, MatrixSetup, in_pool, make_workload
from benchmarks.agentic import read_calibrations as read_agentic_calibrations
from benchmarks.cli import run_command
from benchmarks.goodput_experiments import (
    DEFAULT_PROMPTS,
    DEFAULT_TRACE,
    REPO,
    held_out_prompts,
    train_moe,
)
from benchmarks.matrix_io import append_rows, read_rows

HEADLINE_RATE, HEADLINE_DURATION_S = 190.0, 60.0
AGENTIC = {"chat-agent": ("chat-agent", "small"), "coding-agent": ("coding-agent", "small"),
           "mooncake": ("mooncake", "large"), "chat-agent-large": ("chat-agent", "large")}
WORKLOADS = ("headline", *AGENTIC)
CELL_FIELDS = ("workload", "cluster", "seed", "variant", "routers", "sharing", "spread",
               "slo_scale", "requests", "met", "goodput_rps")


@dataclass(frozen=True)
class Variant:
    """K routers sharing `sharing`, requests spread by `spread`."""

    routers: int
    sharing: Sharing = Sharing.LEARNING
    spread: Spread = Spread.SESSION

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = text.strip().split("/")
        try:
            return cls(int(parts[0]), *(kind(p) for kind, p in zip((Sharing, Spread),
                                                                 parts[1:], strict=False)))
        except ValueError:
            raise ValueError(f"variant {text!r}: give K[/nothing|reports|budgets"
                             "[/session|random]]") from None

    @property
    def label(self) -> str:
        if self.routers == 1:
            return "1"
        return f"{self.routers}/{self.sharing.value}/{self.spread.value}"

    def fleet(self) -> FleetConfig:
        return FleetConfig(self.routers, self.spread, self.sharing)


@dataclass(frozen=True)
class Unit:
    workload: str
    seed: int


def unit_label(workload: str, spread_ticks: bool) -> str:
    """The workload's name in cells.csv: `mooncake/spread` with its ticks spread."""
    return "mooncake/spread" if spread_ticks and workload == "mooncake" else workload


def run_unit(unit: Unit, variants: Sequence[Variant], scales: Sequence[float],
             predictor_dir: Path, test_prompts: Path, calibration: Path,
             spread_ticks: bool = False,
             reestimate: LengthReestimate = LengthReestimate.CONDITIONAL) -> list[dict]:
    """Every variant at every scale on one workload and seed; with `spread_ticks` the
    Mooncake trace's requests that share a timestamp arrive spread over their tick
    (`spread_within_ticks`), and the workload is labelled `mooncake/spread`.
    `reestimate` is how the watchdog re-estimates the MoE's lengths (the headline's; the
    agentic units' label-free histories condition on the tokens generated either way)."""
    from predictor.registry import load_predictor

    routing = RoutingOptions(unit.seed)
    if unit.workload == "headline":
        from app.experiments.replay import attach_predictions
        from app.workloads.workload import load_prompts, load_trace, trace_workload

        cluster_name, config = "small", load_cluster_config(CLUSTERS["small"])
        routing = RoutingOptions(unit.seed, GoodServeConfig(reestimate=reestimate),
                                 lambda: PredictorLength(
            load_predictor(predictor_dir, "moe")))
        work = attach_predictions(trace_workload(
            load_trace(DEFAULT_TRACE), rate=HEADLINE_RATE, duration_s=HEADLINE_DURATION_S,
            prompts=load_prompts(test_prompts), seed=unit.seed, name="mooncake+prompts"),
            routing.length_factory())
    else:
        name, cluster_name = AGENTIC[unit.workload]
        config = load_cluster_config(CLUSTERS[cluster_name])
        rates = {(c.workload, c.cluster): c.rate for c in read_agentic_calibrations(calibration)}
        rate = rates.get((name, cluster_name))
        if rate is None:
            return []
        work = make_workload(name, config, rate, unit.seed,
                             MatrixSetup(dict(DURATION_S), TRACE, ()))
    label = unit_label(unit.workload, spread_ticks)
    if label != unit.workload:
        work = spread_within_ticks(work, unit.seed)
    rows = []
    for variant in variants:
        spec = ReplaySpec(config, (PolicyKind.GOODSERVE,), tuple(scales), seed=unit.seed,
                          routing=routing, fleet=variant.fleet())
        for cell in run_replay(spec, work):
            rows.append({"workload": label, "cluster": cluster_name,
                         "seed": unit.seed, "variant": variant.label,
                         "routers": variant.routers, "sharing": variant.sharing.value,
                         "spread": variant.spread.value, "slo_scale": cell.slo_scale,
                         "requests": cell.summary["requests"], "met": cell.summary["met"],
                         "goodput_rps": cell.summary["goodput_rps"]})
    return rows


def report(cells: Sequence[dict], reestimate: LengthReestimate) -> str:
    """Per workload and scale: each variant's met over one router's, mean [min, max]
    over seeds."""
    lines = ["# Several router replicas against one (simulator)", "",
             "Met requests with K replicas / with one router, mean [min, max] over seeds. "
             f"The watchdog re-estimates the MoE's lengths by `{reestimate.value}`.", ""]
    variants = sorted({c["variant"] for c in cells if c["variant"] != "1"},
                      key=lambda v: (int(v.split("/")[0]), v))
    lines += ["| workload | seeds | scale | one router met | " + " | ".join(variants) + " |",
              "|---|---|---|---|" + "---|" * len(variants)]
    keys = dict.fromkeys((c["workload"], float(c["slo_scale"])) for c in cells)
    for workload, scale in keys:
        mine = [c for c in cells if c["workload"] == workload and float(c["slo_scale"]) == scale]
        base = {c["seed"]: int(c["met"]) for c in mine if c["variant"] == "1"}
        row = [workload, ",".join(str(s) for s in sorted(base)), f"{scale:g}",
               f"{statistics.fmean(base.values()):.0f}" if base else "-"]
        for v in variants:
            ratios = [int(c["met"]) / base[c["seed"]] for c in mine
                      if c["variant"] == v and base.get(c["seed"])]
            row.append(f"{statistics.fmean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
                       if ratios else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def routers(
    out: Annotated[Path, typer.Option()] = REPO / "results" / "routers",
    workloads: Annotated[str, typer.Option(help="headline, " + ", ".join(AGENTIC))] = ",".join(
        WORKLOADS),
    seeds: Annotated[str, typer.Option(help="workload seeds")] = "1,2,3",
    agentic_seeds: Annotated[str, typer.Option(help="seeds of the agentic units")] = "0",
    variants: Annotated[str, typer.Option(help="K[/sharing[/spread]], comma-separated")] = (
        "1,2,4,8,16,4/nothing,4/reports,4/budgets,4/learning/random"),
    scales: Annotated[str, typer.Option()] = "1,2,3",
    calibration: Annotated[Path, typer.Option(help="the agentic matrix's calibration.csv")] = (
        REPO / "results" / "agentic" / "calibration.csv"),
    prompts: Annotated[Path, typer.Option()] = DEFAULT_PROMPTS,
    jobs: Annotated[int, typer.Option(help="units at once (processes)")] = 2,
    resume: Annotated[bool, typer.Option("--resume", help="keep --out/cells.csv; run only "
                                         "the units it lacks")] = False,
    spread_ticks: Annotated[bool, typer.Option(
        "--spread-ticks", help="mooncake: spread each tick's requests (the trace's "
        "timestamps are rounded) up to the next tick instead of one instant")] = False,
    reestimate: Annotated[LengthReestimate, typer.Option(
        help="how the watchdog re-estimates the MoE's lengths (headline)")] = (
        LengthReestimate.CONDITIONAL),
) -> int:
    """Run every variant on each unit; write cells.csv and report.md."""
    try:
        chosen = [w.strip() for w in workloads.split(",") if w.strip()]
        if bad := [w for w in chosen if w not in WORKLOADS]:
            raise ValueError(f"unknown workload {bad[0]!r}; known: {', '.join(WORKLOADS)}")
        variant_list = [Variant.parse(v) for v in variants.split(",") if v.strip()]
        if 1 not in {v.routers for v in variant_list}:
            variant_list.insert(0, Variant(1))
        scale_list = [float(s) for s in scales.split(",")]
        seed_list = [int(s) for s in seeds.split(",")]
        agentic_list = [int(s) for s in agentic_seeds.split(",")]
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if not prompts.exists():
        print(f"error: {prompts} not found")
        return 2
    split_dir = Path.home() / ".cache" / "goodserve" / "prompt-split-seed0"
    _, test_prompts = held_out_prompts(prompts, split_dir, 0)
    if not (split_dir / "predictors" / "moe").exists():
        train_moe(split_dir / "prompts-train.jsonl", split_dir / "predictors", 0)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cells.csv"
    if not resume:
        path.unlink(missing_ok=True)
    done = {(c["workload"], int(c["seed"])) for c in read_rows(path)}
    units = [Unit(w, s) for w in chosen for s in (seed_list if w == "headline" else agentic_list)
             if (unit_label(w, spread_ticks), s) not in done]
    for rows in in_pool(run_unit, [(u, variant_list, scale_list, split_dir / "predictors",
                                    test_prompts, calibration, spread_ticks, reestimate)
                                   for u in units],
                        jobs, "router variants", "unit"):
        append_rows(path, rows, CELL_FIELDS)
    text = report(read_rows(path, integer=("seed", "met", "requests")), reestimate)
    (out / "report.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(routers, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
