"""Robustness matrix (simulator): GoodServe against every baseline and against itself
with exact lengths, across arrival processes, rates, SLO scales and seeds.

Setup: configs/paper-4gpu.yaml; request content from the held-out 20% of
prompt_lengths.jsonl (split by prompt_id), the MoE (K=9) trained on the other 80%;
SLO = scale x solo time on an A800. Arrival processes: Poisson, the Mooncake
conversation trace time-scaled to the rate, Gamma renewal with CV 4 and 13, and
batches of simultaneous arrivals (geometric sizes, mean 16). Every (process, rate,
seed) workload runs every policy at every scale; cells.csv keeps each run, so an
interrupted matrix resumes where it stopped (--resume).

Writes under --out: cells.csv (one row per process, rate, seed, policy, scale),
matrix.csv and matrix.md (per process, rate and scale: GoodServe / best baseline and
exact lengths / GoodServe, mean and range over seeds) and matrix.png (both ratios as
heat maps).
Usage: python -m benchmarks.robustness [--seeds 2,3,4] [--rates 100,190] [--jobs 2]
"""

from __future__ import annotations

import csv
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, attach_predictions, run_replay
from app.routing.goodserve import GoodServeConfig
from app.routing.length import PredictorLength
from app.routing.registry import PolicyKind, RoutingOptions
from app.workloads.workload import (
    Arrivals,
    BurstDistribution,
    SyntheticArrivals,
    Workload,
    load_prompts,
    load_trace,
    synthetic_workload,
    trace_workload,
)
from benchmarks.cli import run_command
from benchmarks.goodput_experiments import (
    BASELINES,
    DEFAULT_PROMPTS,
    DEFAULT_TRACE,
    REPO,
    PredictorOption,
    PromptsOption,
    TraceOption,
    held_out_prompts,
    train_moe,
)
from benchmarks.matrix_io import (
    append_rows,
    draw_ratio_grid,
    mean_range_text,
    ratio,
    read_rows,
)
from predictor.progress import Progress

SCALES = (1.0, 1.5, 2.0, 3.0)
PROCESSES = ("poisson", "mooncake", "gamma-cv4", "gamma-cv13", "batch")
POLICIES = (PolicyKind.GOODSERVE, PolicyKind.GOODSERVE_EXACT, *BASELINES)
CELL_FIELDS = ["process", "rate_rps", "seed", "policy", "slo_scale", "requests", "met",
               "goodput_rps"]
PROCESS_SPECS = {
    "poisson": dict(kind=Arrivals.POISSON),
    "gamma-cv4": dict(kind=Arrivals.GAMMA, burstiness=4.0),
    "gamma-cv13": dict(kind=Arrivals.GAMMA, burstiness=13.0),
    "batch": dict(kind=Arrivals.BATCH, mean_burst=16.0,
                  burst_distribution=BurstDistribution.GEOMETRIC),
}


@dataclass(frozen=True)
class MatrixSetup:
    """What every worker needs to build and run one workload."""

    prompts: Path  # held-out content
    predictor_dir: Path
    trace: Path
    duration_s: float
    cluster: Path


def build_workload(setup: MatrixSetup, process: str, rate: float, seed: int) -> Workload:
    prompts = load_prompts(setup.prompts)
    if process == "mooncake":
        return trace_workload(load_trace(setup.trace), rate=rate, duration_s=setup.duration_s,
                              prompts=prompts, seed=seed, name="mooncake")
    arrivals = SyntheticArrivals(rate=rate, duration_s=setup.duration_s,
                                 **PROCESS_SPECS[process])
    return synthetic_workload(arrivals, [p.content() for p in prompts], seed=seed)


WorkloadKey = tuple[str, float, int]  # (process, rate, seed)


def run_workload(setup: MatrixSetup, process: str, rate: float, seed: int,
                 policies: Sequence[PolicyKind] = POLICIES) -> list[dict]:
    """`policies` at every scale on one (process, rate, seed) workload."""
    from predictor.registry import load_predictor

    routing = RoutingOptions(seed, GoodServeConfig(), lambda: PredictorLength(
        load_predictor(setup.predictor_dir, "moe")))
    workload = attach_predictions(build_workload(setup, process, rate, seed),
                                  routing.length_factory())
    spec = ReplaySpec(load_cluster_config(setup.cluster), tuple(policies), SCALES, seed=seed,
                      routing=routing)
    return [
        {"process": process, "rate_rps": rate, "seed": seed, "policy": cell.policy,
         "slo_scale": cell.slo_scale, "requests": cell.summary["requests"],
         "met": cell.summary["met"], "goodput_rps": cell.summary["goodput_rps"]}
        for cell in run_replay(spec, workload)
    ]


def read_cells(path: Path) -> list[dict]:
    return read_rows(path, numeric=("rate_rps", "slo_scale", "goodput_rps"), integer=("seed",))


def append_cells(path: Path, rows: Sequence[dict]) -> None:
    append_rows(path, rows, CELL_FIELDS)


def missing_runs(
    cells: Sequence[dict], workloads: Sequence[WorkloadKey], policies: Sequence[PolicyKind]
) -> list[tuple[WorkloadKey, tuple[PolicyKind, ...]]]:
    """Per workload, the policies `cells` has no row for (workloads with none left out)."""
    have = {(c["process"], c["rate_rps"], c["seed"], c["policy"]) for c in cells}
    todo = []
    for workload in workloads:
        missing = tuple(k for k in policies if (*workload, k.value) not in have)
        if missing:
            todo.append((workload, missing))
    return todo


def without_runs(cells: Sequence[dict], workloads: Sequence[WorkloadKey],
                 policies: Sequence[PolicyKind]) -> list[dict]:
    """`cells` less the rows of `policies` on `workloads` (to run them again)."""
    drop = {(*w, k.value) for w in workloads for k in policies}
    return [c for c in cells
            if (c["process"], c["rate_rps"], c["seed"], c["policy"]) not in drop]


@dataclass(frozen=True)
class MatrixCell:
    """One (process, rate, scale) cell over its seeds."""

    process: str
    rate_rps: float
    slo_scale: float
    seeds: tuple[int, ...]
    vs_best: tuple[float, ...]  # GoodServe / best baseline, per seed
    best: tuple[str, ...]  # the best baseline, per seed
    exact_vs_goodserve: tuple[float, ...]  # exact lengths / GoodServe, per seed
    goodserve_rps: float  # mean over seeds


def matrix(cells: Sequence[dict]) -> list[MatrixCell]:
    goodput = {(c["process"], c["rate_rps"], c["seed"], c["policy"], c["slo_scale"]):
               c["goodput_rps"] for c in cells}
    baselines = [k.value for k in BASELINES]
    keys = sorted({(c["process"], c["rate_rps"], c["slo_scale"]) for c in cells},
                  key=lambda k: (PROCESSES.index(k[0]) if k[0] in PROCESSES else 99, k[1], k[2]))
    needed = [PolicyKind.GOODSERVE.value, PolicyKind.GOODSERVE_EXACT.value, *baselines]
    out = []
    for process, rate, scale in keys:
        # only seeds with every policy (a workload still being run again is left out)
        seeds = sorted({c["seed"] for c in cells
                        if (c["process"], c["rate_rps"], c["slo_scale"]) == (process, rate, scale)
                        and all((process, rate, c["seed"], n, scale) in goodput for n in needed)})
        if not seeds:
            continue
        vs_best, best, exact = [], [], []
        for seed in seeds:
            ours = goodput[process, rate, seed, PolicyKind.GOODSERVE.value, scale]
            name = max(baselines, key=lambda n: goodput.get((process, rate, seed, n, scale), 0))
            vs_best.append(ratio(ours, goodput[process, rate, seed, name, scale]))
            best.append(name)
            exact.append(ratio(goodput[process, rate, seed, PolicyKind.GOODSERVE_EXACT.value,
                                       scale], ours))
        mean_ours = sum(goodput[process, rate, s, PolicyKind.GOODSERVE.value, scale]
                        for s in seeds) / len(seeds)
        out.append(MatrixCell(process, rate, scale, tuple(seeds), tuple(vs_best), tuple(best),
                              tuple(exact), mean_ours))
    return out


def write_matrix(out: Path, rows: Sequence[MatrixCell]) -> None:
    with (out / "matrix.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["process", "rate_rps", "slo_scale", "seeds", "goodserve_rps",
                         "vs_best_mean", "vs_best_min", "vs_best_max", "best_baselines",
                         "exact_vs_goodserve_mean", "exact_vs_goodserve_min",
                         "exact_vs_goodserve_max"])
        for r in rows:
            writer.writerow([r.process, r.rate_rps, r.slo_scale, " ".join(map(str, r.seeds)),
                             f"{r.goodserve_rps:.2f}",
                             *(f"{x:.3f}" for x in (sum(r.vs_best) / len(r.vs_best),
                                                    min(r.vs_best), max(r.vs_best))),
                             " ".join(sorted(set(r.best))),
                             *(f"{x:.3f}" for x in (
                                 sum(r.exact_vs_goodserve) / len(r.exact_vs_goodserve),
                                 min(r.exact_vs_goodserve), max(r.exact_vs_goodserve)))])
    scales = sorted({r.slo_scale for r in rows})
    lines = ["# Robustness matrix (simulator, paper-4gpu)", "",
             "Per cell: mean [min, max] over seeds. GoodServe / best baseline (the best "
             "baseline of each seed, named below the table), then exact lengths / GoodServe.",
             ""]
    for title, pick in (("GoodServe / best baseline", lambda r: r.vs_best),
                        ("GoodServe with exact lengths / GoodServe (MoE)",
                         lambda r: r.exact_vs_goodserve)):
        lines += [f"## {title}", "", "| process | rate | " +
                  " | ".join(f"scale {s:g}" for s in scales) + " |",
                  "|---|---|" + "---|" * len(scales)]
        for process, rate in dict.fromkeys((r.process, r.rate_rps) for r in rows):
            by_scale = {r.slo_scale: r for r in rows if (r.process, r.rate_rps) == (process, rate)}
            cells = [mean_range_text(pick(by_scale[s])) if s in by_scale else "" for s in scales]
            lines.append(f"| {process} | {rate:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Best baseline per cell", "", "| process | rate | scale | best baselines "
              "(per seed) | GoodServe req/s |", "|---|---|---|---|---|"]
    lines += [f"| {r.process} | {r.rate_rps:g} | {r.slo_scale:g} | {', '.join(r.best)} | "
              f"{r.goodserve_rps:.1f} |" for r in rows]
    (out / "matrix.md").write_text("\n".join(lines) + "\n")
    write_heatmap(out / "matrix.png", rows, scales)


def write_heatmap(path: Path, rows: Sequence[MatrixCell], scales: Sequence[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(dict.fromkeys((r.process, r.rate_rps) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(labels) + 2))
    for ax, (title, pick) in zip(axes, (
            ("GoodServe / best baseline", lambda r: r.vs_best),
            ("exact lengths / GoodServe", lambda r: r.exact_vs_goodserve)), strict=True):
        grid = np.full((len(labels), len(scales)), np.nan)
        for r in rows:
            values = [min(v, 10.0) for v in pick(r)]
            grid[labels.index((r.process, r.rate_rps)), scales.index(r.slo_scale)] = (
                sum(values) / len(values))
        image = draw_ratio_grid(ax, grid, [f"{s:g}" for s in scales],
                                [f"{p} @ {r:g}" for p, r in labels])
        ax.set_xlabel("SLO scale")
        ax.set_title(title)
        fig.colorbar(image, ax=ax, label="log2 ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def robustness(
    out: Annotated[Path, typer.Option()] = REPO / "results" / "robustness",
    trace: TraceOption = DEFAULT_TRACE,
    prompts: PromptsOption = DEFAULT_PROMPTS,
    predictor: PredictorOption = None,
    processes: Annotated[str, typer.Option()] = ",".join(PROCESSES),
    rates: Annotated[str, typer.Option()] = "100,190",
    seeds: Annotated[str, typer.Option(
        help="workload seeds (seed 1 was used while choosing the policy)")] = "2,3,4",
    duration: Annotated[float, typer.Option(help="arrival window, s")] = 60.0,
    jobs: Annotated[int, typer.Option(help="workloads simulated at once")] = 2,
    resume: Annotated[bool, typer.Option(
        "--resume", help="keep --out/cells.csv and run only the missing workloads")] = False,
    policies: Annotated[str, typer.Option(
        help="policies to run (the report needs goodserve, exact lengths and every baseline)")
    ] = ",".join(k.value for k in POLICIES),
    rerun: Annotated[bool, typer.Option(
        "--rerun", help="keep --out/cells.csv but run --policies again on the chosen "
        "workloads, replacing their rows (after a policy change)")] = False,
    report_only: Annotated[bool, typer.Option(
        "--report-only", help="rewrite matrix.* from --out/cells.csv, running nothing")
    ] = False,
) -> int:
    """Run the matrix's missing workloads (or with --report-only, none); write the
    matrix under --out."""
    process_names = [p.strip() for p in processes.split(",") if p.strip()]
    unknown = [p for p in process_names if p not in PROCESSES]
    if unknown:
        print(f"error: unknown process {unknown[0]!r}; known: {', '.join(PROCESSES)}")
        return 2
    names = [p.strip() for p in policies.split(",") if p.strip()]
    known = {k.value: k for k in POLICIES}
    if bad := [n for n in names if n not in known]:
        print(f"error: unknown policy {bad[0]!r}; known: {', '.join(known)}")
        return 2
    kinds = [known[n] for n in names]
    out.mkdir(parents=True, exist_ok=True)
    cells_path = out / "cells.csv"
    if report_only:
        write_matrix(out, matrix(read_cells(cells_path)))
        print(f"wrote {out / 'matrix.md'}")
        return 0
    if not trace.exists() or not prompts.exists():
        print(f"error: data not found ({trace}, {prompts})")
        return 2
    workloads = [(p, float(r), int(s)) for s in seeds.split(",")
                 for r in rates.split(",") for p in process_names]  # seed-major
    cells = read_cells(cells_path) if resume or rerun else []
    if rerun:
        cells = without_runs(cells, workloads, kinds)
    cells_path.unlink(missing_ok=True)
    append_cells(cells_path, cells)
    split_dir = Path.home() / ".cache" / "goodserve" / "prompt-split-seed0"
    train_path, test_path = held_out_prompts(prompts, split_dir, 0)
    predictor_dir = predictor or split_dir / "predictors"
    if not (predictor_dir / "moe").exists():
        train_moe(train_path, predictor_dir, 0)
    setup = MatrixSetup(test_path, predictor_dir, trace, duration,
                        REPO / "configs" / "paper-4gpu.yaml")
    # seed-major: an interrupted run leaves whole seeds behind it
    todo = missing_runs(cells, workloads, kinds)
    # spawned workers: a fork after the predictor's training can inherit torch's
    # thread pool locks held, and the worker never starts
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_workload, setup, *workload, missing)
                   for workload, missing in todo]
        for future in Progress(futures, desc="workloads", unit="workload"):
            append_cells(cells_path, future.result())
    write_matrix(out, matrix(read_cells(cells_path)))
    print(f"wrote {out / 'cells.csv'}, matrix.csv, matrix.md, matrix.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(robustness, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
