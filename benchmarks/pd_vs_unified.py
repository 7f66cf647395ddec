"""P/D vs unified GoodServe on the same GPUs (simulator), with the split SARA recommends.

Setup: configs/paper-4gpu.yaml (H800, A800, A40, 2x V100 TP2); Mooncake conversation
arrivals time-scaled to --rate for --duration s; request content from the held-out 20%
of prompt_lengths.jsonl, the MoE (K=9) trained on the rest; SLO = scale x solo time on
an A800. For each SLO scale:
- stage targets from the end-to-end deadlines (`app.planning.split.stage_slos`);
- the split from `split_inventory` over the cluster's engines, given the workload's
  length moments (what a controller measures) and the cluster's KV link;
- GoodServe on the unified cluster and on the disaggregated one (that split, prefill
  placed by least TTFT, decode by just-enough, KV over the modelled link).
`--every-split` also simulates every other split, to see where SARA's pick ranks.

Writes under --out: splits.csv (per scale: targets, per-engine capacities, the split),
goodput.csv (per seed, scale and cluster), report.md and goodput.png.
Usage: python -m benchmarks.pd_vs_unified [--seeds 2,3] [--rate 190] [--every-split]
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import ClusterConfig, load_cluster_config
from app.experiments.autoscale import observed
from app.experiments.plan_check import inventory, with_layout
from app.experiments.replay import ReplaySpec, attach_predictions, cluster_model, run_replay
from app.planning.cluster_plan import Layout
from app.planning.params import ModelParams
from app.planning.split import (
    EngineKind,
    PoolSplit,
    prefill_counts,
    split_inventory,
    stage_slos,
)
from app.routing.goodserve import GoodServeConfig
from app.routing.length import PredictorLength
from app.routing.registry import PolicyKind, RoutingOptions
from app.workloads.slo import reference_instance
from app.workloads.workload import Workload, load_prompts, load_trace, trace_workload
from benchmarks.cli import run_command
from benchmarks.goodput_experiments import (
    DEFAULT_PROMPTS,
    DEFAULT_TRACE,
    REPO,
    PredictorOption,
    PromptsOption,
    TraceOption,
    held_out_prompts,
    train_moe,
)
from predictor.progress import Progress

SCALES = (1.0, 1.5, 2.0, 2.5, 3.0)
UNIFIED = "unified"


def with_split(cluster: ClusterConfig, prefill: dict[str, int]) -> ClusterConfig:
    """The same engines in disaggregated mode: the first `prefill[kind]` of each kind
    prefill, the rest decode."""
    return with_layout(cluster, _layout(prefill))


def split_label(prefill: dict[str, int]) -> str:
    """'A800+H800' for the prefill pool (the rest decode)."""
    return _layout(prefill).label


def _layout(prefill: dict[str, int]) -> Layout:
    return Layout(tuple((k, n) for k, n in sorted(prefill.items()) if n))


def every_prefill_pool(kinds: Counter[EngineKind]) -> list[dict[str, int]]:
    """Every prefill pool leaving at least one engine to each pool."""
    ordered = sorted(kinds)
    return [{k.name: n for k, n in zip(ordered, counts, strict=True) if n}
            for counts in prefill_counts([kinds[k] for k in ordered])]


def recommend(cluster: ClusterConfig, workload: Workload, scale: float,
              reference_gpu: str = "A800") -> tuple[PoolSplit, dict]:
    """SARA's split for one scale, and the row describing it."""
    model = cluster_model(cluster)
    stats = observed(workload).workload
    slo = stage_slos(reference_instance(model, reference_gpu), stats, scale)
    split = split_inventory(inventory(cluster), ModelParams.named(model), stats, slo,
                            cluster.kv_link_gbps)
    row = {
        "slo_scale": scale, "ttft_s": round(slo.ttft_s, 5), "tpot_s": round(slo.tpot_s, 5),
        "kv_s": round(slo.kv_s, 5), "p_slo": slo.p_slo,
        "prefill_pool": split_label(split.prefill), "decode_pool": split_label(split.decode),
        "model_goodput_rps": round(split.goodput_rps, 2), "binding": split.binding,
        **{f"{c.kind.name}_prefill_rps": round(c.prefill_rps, 2) for c in split.capacities},
        **{f"{c.kind.name}_decode_rps": round(c.decode_rps, 2) for c in split.capacities},
    }
    return split, row


def simulate(cluster: ClusterConfig, workload: Workload, scale: float, seed: int,
             routing: RoutingOptions) -> dict:
    spec = ReplaySpec(cluster, (PolicyKind.GOODSERVE,), (scale,), seed=seed, routing=routing)
    (cell,) = run_replay(spec, workload)
    return {"requests": cell.summary["requests"], "met": cell.summary["met"],
            "goodput_rps": cell.summary["goodput_rps"]}


def read_csv(path: Path) -> list[dict]:
    """Rows written by `write_csv`, numbers and flags parsed back."""
    def parse(value: str):
        if value in ("True", "False"):
            return value == "True"
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return value
    with path.open() as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def mean_goodput(cells: Sequence[dict], scale: float, pick) -> float:
    """Mean over seeds of the cells at `scale` that `pick` selects (nan if none)."""
    values = [c["goodput_rps"] for c in cells if c["slo_scale"] == scale and pick(c)]
    return statistics.fmean(values) if values else math.nan


def report(out: Path, setup: dict, splits: Sequence[dict], cells: Sequence[dict]) -> None:
    scales = sorted({r["slo_scale"] for r in splits})
    lines = ["# P/D vs unified GoodServe (simulator, same GPUs)", "", "## Setup", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items()]
    lines += ["", "## Goodput, req/s (mean over seeds)", "",
              "| SLO scale | unified | P/D, SARA's split | P/D / unified | SARA's prefill pool "
              "| best split simulated | its goodput |", "|---|---|---|---|---|---|---|"]
    for scale in scales:
        unified = mean_goodput(cells, scale, lambda c: c["cluster"] == UNIFIED)
        sara = mean_goodput(cells, scale, lambda c: c["sara_pick"])
        by_split = {name: mean_goodput(cells, scale, lambda c, n=name: c["cluster"] == n)
                    for name in {c["cluster"] for c in cells
                                 if c["cluster"] != UNIFIED and c["slo_scale"] == scale}}
        best = max(by_split, key=by_split.__getitem__)
        picked = " / ".join(sorted({r["prefill_pool"] for r in splits if r["slo_scale"] == scale}))
        others = f"{best} | {by_split[best]:.1f}" if len(by_split) > 1 else "- | -"
        lines.append(f"| {scale:g} | {unified:.1f} | {sara:.1f} | {sara / unified:.2f} | "
                     f"{picked} | {others} |")
    lines += ["", "## SARA's targets and split per seed and scale", "",
              "| seed | SLO scale | tau_pre s | tau_dec s | prefill pool | decode pool | model "
              "goodput req/s | binding |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['slo_scale']:g} | {r['ttft_s']:.4f} | {r['tpot_s']:.4f} | "
              f"{r['prefill_pool']} | {r['decode_pool']} | {r['model_goodput_rps']:.1f} | "
              f"{r['binding']} |" for r in splits]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot(out / "goodput.png", scales, cells)


def plot(path: Path, scales: Sequence[float], cells: Sequence[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pick in (("unified", lambda c: c["cluster"] == UNIFIED),
                        ("P/D, SARA's split", lambda c: c["sara_pick"])):
        ax.plot(scales, [mean_goodput(cells, s, pick) for s in scales], marker="o", label=label)
    others = sorted({c["cluster"] for c in cells if c["cluster"] != UNIFIED and not c["sara_pick"]})
    for name in others:
        ax.plot(scales, [mean_goodput(cells, s, lambda c, n=name: c["cluster"] == n)
                         for s in scales], color="grey", alpha=0.3, lw=1)
    ax.set_xlabel("SLO scale")
    ax.set_ylabel("goodput, req/s")
    ax.set_title("GoodServe on paper-4gpu: unified vs P/D" +
                 (" (grey: other splits)" if others else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pd_vs_unified(
    out: Annotated[Path, typer.Option()] = REPO / "results" / "pd-vs-unified",
    trace: TraceOption = DEFAULT_TRACE,
    prompts: PromptsOption = DEFAULT_PROMPTS,
    predictor: PredictorOption = None,
    cluster_path: Annotated[Path, typer.Option("--cluster")] = (
        REPO / "configs" / "paper-4gpu.yaml"),
    rate: Annotated[float, typer.Option()] = 190.0,
    duration: Annotated[float, typer.Option(help="arrival window, s")] = 60.0,
    seeds: Annotated[str, typer.Option(help="workload seeds")] = "2,3",
    scales: Annotated[str, typer.Option()] = ",".join(f"{s:g}" for s in SCALES),
    every_split: Annotated[bool, typer.Option(
        "--every-split", help="also simulate every other prefill/decode split")] = False,
    report_only: Annotated[bool, typer.Option(
        "--report-only",
        help="rewrite report.md and goodput.png from --out's CSVs, running nothing")] = False,
) -> int:
    """Simulate unified and P/D GoodServe per seed and scale (or with --report-only,
    redraw); write the CSVs and the report under --out."""
    if report_only:
        splits, cells = read_csv(out / "splits.csv"), read_csv(out / "goodput.csv")
        setup_lines = (out / "report.md").read_text().split("## Goodput")[0]
        setup = dict(line[2:].split(": ", 1) for line in setup_lines.splitlines()
                     if line.startswith("- "))
        report(out, setup, splits, cells)
        print((out / "report.md").read_text())
        return 0
    if not trace.exists() or not prompts.exists():
        print(f"error: data not found ({trace}, {prompts})")
        return 2
    try:
        cluster = load_cluster_config(cluster_path)
        scale_list = [float(s) for s in scales.split(",")]
        seed_list = [int(s) for s in seeds.split(",")]
    except ValueError as error:
        print(f"error: {error}")
        return 2
    if cluster.mode != UNIFIED:
        print(f"error: {cluster_path} must describe a unified cluster (the split assigns roles)")
        return 2
    split_dir = Path.home() / ".cache" / "goodserve" / "prompt-split-seed0"
    train_path, test_path = held_out_prompts(prompts, split_dir, 0)
    predictor_dir = predictor or split_dir / "predictors"
    if not (predictor_dir / "moe").exists():
        train_moe(train_path, predictor_dir, 0)
    from predictor.registry import load_predictor

    out.mkdir(parents=True, exist_ok=True)
    splits: list[dict] = []
    cells: list[dict] = []
    every = every_prefill_pool(inventory(cluster)) if every_split else []
    runs = len(seed_list) * len(scale_list) * (2 + max(0, len(every) - 1))
    with Progress(total=runs, desc="simulations") as bar:
        for seed in seed_list:
            routing = RoutingOptions(seed, GoodServeConfig(), lambda: PredictorLength(
                load_predictor(predictor_dir, "moe")))
            workload = attach_predictions(
                trace_workload(load_trace(trace), rate=rate,
                               duration_s=duration, prompts=load_prompts(test_path),
                               seed=seed, name="mooncake"),
                routing.length_factory())
            for scale in scale_list:
                split, row = recommend(cluster, workload, scale)
                splits.append({"seed": seed, **row})
                pools = [split.prefill] + [p for p in every if p != split.prefill]
                candidates = [(UNIFIED, cluster)] + [
                    (split_label(p), with_split(cluster, p)) for p in pools]
                for name, config in candidates:
                    cells.append({"seed": seed, "slo_scale": scale, "cluster": name,
                                  "sara_pick": name == split_label(split.prefill),
                                  **simulate(config, workload, scale, seed, routing)})
                    bar.update()
    write_csv(out / "splits.csv", splits)
    write_csv(out / "goodput.csv", cells)
    setup = {"cluster": cluster_path.name, "rate_rps": rate, "duration_s": duration,
             "seeds": seeds, "kv_link_gbps": cluster.kv_link_gbps,
             "arrivals": "Mooncake conversation trace, time-scaled",
             "prompts": "held-out 20% of prompt_lengths.jsonl by prompt_id",
             "predictor": "MoE (K=9) trained on the other 80%",
             "slo": "scale x solo time on an A800; stage targets from stage_slos, p_slo 0.9",
             "policy": "goodserve (P/D: least-TTFT prefill, just-enough decode)",
             "every_split": every_split}
    report(out, setup, splits, cells)
    print((out / "report.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(pd_vs_unified, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
