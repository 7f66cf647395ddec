"""Agentic matrix (simulator): GoodServe against the baselines users deploy, on the
traffic it exists for.

Workloads: the Mooncake conversation trace with its own lengths and prefix blocks
(`--content trace`, rate in req/s), and closed-loop `coding-agent` and `chat-agent`
sessions (rate in sessions/s, Poisson session arrivals). Clusters: `small`
(configs/paper-4gpu.yaml) and `large` (configs/mixed-16gpu.yaml, sixteen engines of
four kinds). SLO = scale x solo time on an A800 (an agent step's context counted as
cached).

Load: for each (workload, cluster), the reference rate L* is where the best of the
calibration baselines (round-robin, least-request, prefix-cache) meets 80% of requests
at SLO scale 2, found by geometric bisection on a calibration seed (100) that is not
reported; the matrix runs 0.5, 0.8, 1.0 and 1.5 x L*. Every (workload, cluster, load,
seed) unit runs every policy at scales 1, 1.5, 2 and 3; cells.csv keeps each unit, so
an interrupted matrix resumes where it stopped (--resume).

Writes under --out: calibration.csv, cells.csv (one row per unit, policy and scale),
matrix.csv and matrix.md (per workload, cluster, load and scale: GoodServe / best
baseline with the best baseline named, exact lengths / GoodServe, mean and range over
seeds; the best baseline's seed-to-seed spread as the noise; GoodServe's met at 1.5x
over its met at 1.0x load) and matrix.png (GoodServe / best baseline as heat maps).
Usage: python -m benchmarks.agentic [--jobs 2] [--resume] [--only-clusters small]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from app.config import load_cluster_config
from app.routing.registry import PolicyKind, RoutingOptions
from app.workload import Arrivals, ContentMode, Workload
from benchmarks.matrix_io import append_rows, read_rows
from benchmarks.replay import ReplaySpec, build_workload, context_limit_of, run_replay

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("mooncake", "coding-agent", "chat-agent")
CLUSTERS = {"small": REPO / "configs" / "paper-4gpu.yaml",
            "large": REPO / "configs" / "mixed-16gpu.yaml"}
DURATION_S = {"small": 600.0, "large": 300.0}  # arrival windows: ~1.5 CPU-hours in all
LOAD_FACTORS = (0.5, 0.8, 1.0, 1.5)
SCALES = (1.0, 1.5, 2.0, 3.0)
CALIBRATION_SCALE = 2.0
TARGET_MET_SHARE = 0.8
CALIBRATION_SEED = 100
GOODSERVE, EXACT = PolicyKind.GOODSERVE.value, PolicyKind.GOODSERVE_EXACT.value
BASELINES = ("round-robin", "least-request", "prefix-cache", "preble", "llumnix", "slo-pack",
             "llm-d", "session-affinity", "dynamo-kv")
POLICIES = (GOODSERVE, EXACT, *BASELINES)
CALIBRATION_POLICIES = ("round-robin", "least-request", "prefix-cache")
# a first guess of L* per engine, for the bracket search (req/s or sessions/s)
START_RATE_PER_ENGINE = {"mooncake": 0.3, "coding-agent": 0.03, "chat-agent": 0.2}
CELL_FIELDS = ["workload", "cluster", "load_factor", "rate", "seed", "policy", "slo_scale",
               "requests", "met", "goodput_rps"]


@dataclass(frozen=True)
class Unit:
    """One simulated workload: every policy at every scale runs on it."""

    workload: str
    cluster: str
    load_factor: float
    rate: float
    seed: int

    @property
    def key(self) -> tuple[str, str, float, int]:
        return (self.workload, self.cluster, self.load_factor, self.seed)


def make_workload(workload: str, cluster: str, rate: float, seed: int,
                  duration_s: float) -> Workload:
    config = load_cluster_config(CLUSTERS[cluster])
    if workload == "mooncake":
        return build_workload(arrivals=Arrivals.TRACE, trace=TRACE, prompts=None, rate=rate,
                              duration_s=duration_s, max_requests=None, seed=seed,
                              content=ContentMode.TRACE)
    return build_workload(arrivals=Arrivals.POISSON, trace=None, prompts=None, rate=rate,
                          duration_s=duration_s, max_requests=None, seed=seed,
                          content=ContentMode(workload),
                          context_limit=context_limit_of(config))


def run_cells(workload: str, cluster: str, rate: float, seed: int, duration_s: float,
              policies: Sequence[str], scales: Sequence[float]) -> list[dict]:
    """`policies` at `scales` on one workload: one row per (policy, scale)."""
    spec = ReplaySpec(load_cluster_config(CLUSTERS[cluster]),
                      tuple(PolicyKind.from_str(p) for p in policies), tuple(scales),
                      seed=seed, routing=RoutingOptions(seed))
    cells = run_replay(spec, make_workload(workload, cluster, rate, seed, duration_s))
    return [{"policy": c.policy, "slo_scale": c.slo_scale, "requests": c.summary["requests"],
             "met": c.summary["met"], "goodput_rps": c.summary["goodput_rps"]} for c in cells]


def best_met_share(rows: Sequence[dict]) -> float:
    return max(int(r["met"]) / max(int(r["requests"]), 1) for r in rows)


class Unreachable(ValueError):
    """The policies never meet the target share, however light the load."""


def calibrate(share_at: Callable[[float], float], start: float, *, steps: int = 5,
              max_doublings: int = 8) -> float:
    """The rate where a non-increasing met share crosses TARGET_MET_SHARE: a bracket
    by doubling or halving from `start`, then `steps` geometric bisections."""
    low = high = start
    if share_at(start) >= TARGET_MET_SHARE:
        for _ in range(max_doublings):
            high *= 2
            if share_at(high) < TARGET_MET_SHARE:
                break
            low = high
        else:
            return high
    else:
        for _ in range(max_doublings):
            low /= 2
            if share_at(low) >= TARGET_MET_SHARE:
                break
            high = low
        else:
            raise Unreachable(f"the met share stays below {TARGET_MET_SHARE} down to {low:.3g}")
    for _ in range(steps):
        middle = math.sqrt(low * high)
        if share_at(middle) >= TARGET_MET_SHARE:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def calibrate_unit(workload: str, cluster: str, duration_s: float,
                   policies: Sequence[str]) -> float:
    """L* by the cheap calibration policies; by every baseline when those never meet
    the target (long prompts on weak GPUs miss even when idle unless a deadline-aware
    baseline keeps them off those GPUs)."""
    engines = len(load_cluster_config(CLUSTERS[cluster]).engines())

    def share_by(names: Sequence[str]) -> Callable[[float], float]:
        return lambda rate: best_met_share(run_cells(
            workload, cluster, rate, CALIBRATION_SEED, duration_s, names,
            (CALIBRATION_SCALE,)))

    start = START_RATE_PER_ENGINE[workload] * engines
    try:
        return calibrate(share_by(policies), start)
    except Unreachable:
        return calibrate(share_by(BASELINES), start)


def reference_rates(out: Path, pairs: Sequence[tuple[str, str]], jobs: int,
                    policies: Sequence[str]) -> dict[tuple[str, str], float]:
    """L* per (workload, cluster), from calibration.csv where it was found before."""
    path = out / "calibration.csv"
    known = {(r["workload"], r["cluster"]): r["rate"]
             for r in read_rows(path, numeric=("rate",))}
    todo = [p for p in pairs if p not in known]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {p: pool.submit(calibrate_unit, *p, DURATION_S[p[1]], policies) for p in todo}
        for pair, future in tqdm(futures.items(), desc="calibrate", unit="pair"):
            known[pair] = future.result()
            append_rows(path, [{"workload": pair[0], "cluster": pair[1], "rate": known[pair]}],
                        ["workload", "cluster", "rate"])
    return known


def run_unit(unit: Unit, policies: Sequence[str]) -> list[dict]:
    rows = run_cells(unit.workload, unit.cluster, unit.rate, unit.seed,
                     DURATION_S[unit.cluster], policies, SCALES)
    return [{"workload": unit.workload, "cluster": unit.cluster,
             "load_factor": unit.load_factor, "rate": unit.rate, "seed": unit.seed, **row}
            for row in rows]


def done_units(cells: Sequence[dict]) -> set[tuple[str, str, float, int]]:
    return {(c["workload"], c["cluster"], float(c["load_factor"]), int(c["seed"]))
            for c in cells}


# ---- aggregation ----------------------------------------------------------------------


def _met_by(cells: Sequence[dict]) -> dict[tuple, dict[str, int]]:
    """(workload, cluster, load_factor, scale, seed) -> policy -> met."""
    out: dict[tuple, dict[str, int]] = defaultdict(dict)
    for c in cells:
        key = (c["workload"], c["cluster"], float(c["load_factor"]), float(c["slo_scale"]),
               int(c["seed"]))
        out[key][c["policy"]] = int(c["met"])
    return out


def _summary(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.fmean(values), min(values), max(values)


def aggregate(cells: Sequence[dict]) -> list[dict]:
    """One row per (workload, cluster, load factor, scale): ratios over seeds."""
    met = _met_by(cells)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for workload, cluster, factor, scale, seed in met:
        groups[(workload, cluster, factor, scale)].append(seed)
    rows = []
    for key in sorted(groups):
        per_seed = [met[(*key, seed)] for seed in sorted(groups[key])]
        if not all(GOODSERVE in m and any(b in m for b in BASELINES) for m in per_seed):
            continue
        best = [max((b for b in BASELINES if b in m), key=lambda b: (m[b], b))
                for m in per_seed]
        ratio = [m[GOODSERVE] / max(m[b], 1) for m, b in zip(per_seed, best, strict=True)]
        exact = [m[EXACT] / max(m[GOODSERVE], 1) for m in per_seed if EXACT in m]
        best_met = [m[b] for m, b in zip(per_seed, best, strict=True)]
        row = {"workload": key[0], "cluster": key[1], "load_factor": key[2],
               "slo_scale": key[3], "seeds": len(per_seed),
               "goodserve_met": statistics.fmean(m[GOODSERVE] for m in per_seed),
               "best_baseline": Counter(best).most_common(1)[0][0],
               "best_baseline_met": statistics.fmean(best_met),
               "best_baseline_spread": (max(best_met) - min(best_met))
               / max(statistics.fmean(best_met), 1)}
        row.update(zip(("ratio_mean", "ratio_min", "ratio_max"), _summary(ratio), strict=True))
        if exact:
            row.update(zip(("exact_mean", "exact_min", "exact_max"), _summary(exact),
                           strict=True))
        rows.append(row)
    return rows


def collapse_ratios(cells: Sequence[dict]) -> dict[tuple[str, str, float], float]:
    """GoodServe's met at 1.5x load over its met at 1.0x, mean over seeds, per
    (workload, cluster, scale)."""
    met = _met_by(cells)
    out: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    for (workload, cluster, factor, scale, seed), m in met.items():
        base = met.get((workload, cluster, 1.0, scale, seed), {})
        if factor == 1.5 and GOODSERVE in m and base.get(GOODSERVE):
            out[(workload, cluster, scale)].append(m[GOODSERVE] / base[GOODSERVE])
    return {k: statistics.fmean(v) for k, v in out.items()}


def _ratio_text(row: dict, prefix: str) -> str:
    mean, low, high = (row[f"{prefix}_{s}"] for s in ("mean", "min", "max"))
    return f"{mean:.2f}" if row["seeds"] == 1 else f"{mean:.2f} [{low:.2f}, {high:.2f}]"


def write_markdown(path: Path, rows: Sequence[dict], collapse: dict, calibration: dict) -> None:
    lines = ["# Agentic matrix (simulator)", "",
             "Per cell: mean [min, max] over seeds. GoodServe / best baseline (the best "
             "baseline of each seed; the one best most often is named), exact lengths / "
             "GoodServe, and the best baseline's seed-to-seed spread ((max - min) / mean "
             "of its met requests), the noise a ratio must clear.", "",
             "Reference loads L* (best calibration baseline meets 80% at scale 2, seed "
             f"{CALIBRATION_SEED}):", ""]
    lines += [f"- {w} on {c}: {rate:.3g} {'req/s' if w == 'mooncake' else 'sessions/s'}"
              for (w, c), rate in sorted(calibration.items())]
    for workload in WORKLOADS:
        for cluster in CLUSTERS:
            mine = [r for r in rows if r["workload"] == workload and r["cluster"] == cluster]
            if not mine:
                continue
            lines += ["", f"## {workload}, {cluster} cluster", "",
                      "| load | scale | GoodServe / best | best baseline | spread | "
                      "exact / GoodServe |", "|---|---|---|---|---|---|"]
            for r in mine:
                exact = _ratio_text(r, "exact") if "exact_mean" in r else "-"
                lines.append(f"| {r['load_factor']:g}x | {r['slo_scale']:g} | "
                             f"{_ratio_text(r, 'ratio')} | {r['best_baseline']} | "
                             f"{r['best_baseline_spread']:.2f} | {exact} |")
            kept = [(s, v) for (w, c, s), v in sorted(collapse.items())
                    if w == workload and c == cluster]
            if kept:
                lines += ["", "GoodServe met at 1.5x load / at 1.0x: " + ", ".join(
                    f"scale {s:g}: {v:.2f}" for s, v in kept)]
    path.write_text("\n".join(lines) + "\n")


def write_heatmaps(path: Path, rows: Sequence[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = sorted({(r["workload"], r["cluster"]) for r in rows},
                    key=lambda p: (WORKLOADS.index(p[0]), list(CLUSTERS).index(p[1])))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    for ax, (workload, cluster) in zip(axes[0], panels, strict=True):
        grid = np.full((len(LOAD_FACTORS), len(SCALES)), np.nan)
        for r in rows:
            if (r["workload"], r["cluster"]) == (workload, cluster):
                grid[LOAD_FACTORS.index(r["load_factor"]),
                     SCALES.index(r["slo_scale"])] = r["ratio_mean"]
        ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, origin="lower")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(SCALES)), [f"{s:g}" for s in SCALES])
        ax.set_yticks(range(len(LOAD_FACTORS)), [f"{f:g}x" for f in LOAD_FACTORS])
        ax.set_xlabel("SLO scale")
        ax.set_title(f"{workload}, {cluster}", fontsize=9)
    axes[0][0].set_ylabel("load / L*")
    fig.suptitle("GoodServe met / best baseline met", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path, calibration: dict) -> None:
    cells = read_agentic_cells(out / "cells.csv")
    rows = aggregate(cells)
    if rows:
        with (out / "matrix.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + [
                k for k in ("exact_mean", "exact_min", "exact_max") if k not in rows[0]])
            writer.writeheader()
            writer.writerows(rows)
    write_markdown(out / "matrix.md", rows, collapse_ratios(cells), calibration)
    write_heatmaps(out / "matrix.png", rows)


def read_agentic_cells(path: Path) -> list[dict]:
    return read_rows(path, numeric=("load_factor", "rate", "slo_scale", "goodput_rps"),
                     integer=("seed",))


# ---- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "agentic")
    parser.add_argument("--only-workloads", default=",".join(WORKLOADS))
    parser.add_argument("--only-clusters", default=",".join(CLUSTERS))
    parser.add_argument("--seeds", default="0,1,2", help="small cluster")
    parser.add_argument("--large-seeds", default="0")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--calibration-policies", default=",".join(CALIBRATION_POLICIES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="keep units in cells.csv")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    workloads = [w for w in args.only_workloads.split(",") if w]
    if "mooncake" in workloads and not TRACE.is_file():
        print(f"skipping mooncake: {TRACE} is absent")
        workloads.remove("mooncake")
    clusters = [c for c in args.only_clusters.split(",") if c]
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = [(w, c) for w in workloads for c in clusters]
    policies = [p for p in args.policies.split(",") if p]
    calibration = reference_rates(args.out, pairs, args.jobs,
                                  args.calibration_policies.split(","))
    if not args.report_only:
        _run_matrix(args, pairs, calibration, policies)
    write_report(args.out, calibration)
    print(f"wrote {args.out}/matrix.md, matrix.csv, matrix.png")
    return 0


def _run_matrix(args: argparse.Namespace, pairs: Sequence[tuple[str, str]],
                calibration: dict, policies: Sequence[str]) -> None:
    cells_path = args.out / "cells.csv"
    if not args.resume and cells_path.exists():
        cells_path.unlink()
    done = done_units(read_agentic_cells(cells_path))
    seeds = {"small": [int(s) for s in args.seeds.split(",")],
             "large": [int(s) for s in args.large_seeds.split(",")]}
    units = [Unit(w, c, f, calibration[(w, c)] * f, s)
             for w, c in pairs for f in LOAD_FACTORS for s in seeds[c]]
    todo = [u for u in units if u.key not in done]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_unit, u, policies) for u in todo]
        for future in tqdm(futures, desc="agentic matrix", unit="workload"):
            append_rows(cells_path, future.result(), CELL_FIELDS)


if __name__ == "__main__":
    raise SystemExit(main())
