"""Replay harness: one workload, several policies x SLO scales, one output directory.

`goodserve replay --backend sim ...` runs every (policy, SLO scale) pair through
the discrete-event simulator and writes summary.csv, requests.parquet, two PNG
plots and report.md. Policies that declare `deadline_aware = False` (the
load-balancing baselines) make the same decisions at every SLO scale, so they
are simulated once and their records re-scored against each scale (unless the
router sends deadline priorities to the engines, which makes every policy's run
depend on the deadlines).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from app.engines.config import ClusterConfig, SchedulingPolicy, load_cluster_config
from app.experiments.knob_cli import knob_options
from app.routing.fleet import DEFAULT_REPORT_INTERVAL_S, FleetConfig, Sharing, Spread
from app.routing.goodserve import GoodServeConfig, goodserve_knobs, stall_factor_label
from app.routing.length import OutputLengthEstimator, PredictorLength
from app.routing.move_path import MoveRule
from app.routing.priority import PriorityRule
from app.routing.registry import (
    POLICY_REGISTRY,
    SIM_ONLY,
    PolicyKind,
    RoutingOptions,
    build_routing,
)
from app.sim.metrics import summarize
from app.sim.records import RequestOutcome, RequestRecord
from app.sim.simulator import SimResult, Simulator
from app.workloads.sessions import SessionPreset, file_workload, preset_workload
from app.workloads.slo import (
    DEFAULT_REFERENCE_GPU,
    assign_slos,
    parse_scales,
    phases_total_s,
    reference_instance,
    solo_phases_s,
)
from app.workloads.workload import (
    Arrivals,
    BurstDistribution,
    ContentMode,
    SyntheticArrivals,
    Workload,
    load_prompts,
    load_trace,
    synthetic_workload,
    trace_workload,
)

if TYPE_CHECKING:
    from predictor.base import Predictor


class Backend(StrEnum):
    SIM = "sim"
    LIVE = "live"


@dataclass(frozen=True)
class ReplaySpec:
    """Everything one replay needs, already validated."""

    cluster: ClusterConfig
    policies: tuple[PolicyKind, ...]
    slo_scales: tuple[float, ...]
    seed: int = 0
    reference_gpu: str = DEFAULT_REFERENCE_GPU
    max_drain_s: float | None = None
    rescore: bool = True  # simulate deadline-unaware policies once, score every scale
    routing: RoutingOptions = RoutingOptions()  # tau, EMA alpha, GoodServe's predictor
    fleet: FleetConfig = FleetConfig()  # router replicas: how many, spread, shared state


@dataclass(frozen=True)
class RunOutcome:
    """One (policy, SLO scale) cell: its summary row and its records."""

    policy: str
    slo_scale: float
    summary: dict[str, Any]
    records: tuple[RequestRecord, ...]

    def renamed(self, policy: str) -> RunOutcome:
        """The same cell under another label (e.g. "goodserve tau=10"), in every output."""
        return replace(self, policy=policy, summary={**self.summary, "policy": policy})


def parse_policies(text: str) -> tuple[PolicyKind, ...]:
    if text.strip().lower() == "all":
        return tuple(POLICY_REGISTRY.kinds())
    kinds = tuple(PolicyKind.from_str(name) for name in text.split(",") if name.strip())
    if not kinds:
        raise ValueError("no policies given")
    return kinds


def cluster_model(cluster: ClusterConfig) -> str:
    models = {e.model.lower() for e in cluster.engines()}
    if len(models) != 1:
        raise ValueError(f"replay needs one model across the cluster, got {sorted(models)}")
    return models.pop()


def build_workload(
    *,
    arrivals: Arrivals,
    trace: Path | None,
    prompts: Path | None,
    rate: float | None,
    duration_s: float | None,
    max_requests: int | None,
    seed: int,
    burstiness: float = 1.0,
    mean_burst: float = 16.0,
    burst_distribution: BurstDistribution = BurstDistribution.GEOMETRIC,
    content: ContentMode | None = None,
    sessions: Path | None = None,
    context_limit: int | None = None,
) -> Workload:
    """Arrivals from the trace or a synthetic process; content by `content` (default:
    prompts when --prompts is given, else the trace's own lengths). Agent sessions
    (presets or a session log) are closed-loop: `rate` counts sessions per second."""
    content = content or (ContentMode.PROMPTS if prompts is not None else ContentMode.TRACE)
    if content.is_preset or content == ContentMode.SESSIONS:
        return _session_workload(content, arrivals, sessions, rate, duration_s, seed,
                                 burstiness, context_limit)
    if content == ContentMode.PROMPTS and prompts is None:
        raise ValueError("--content prompts needs --prompts")
    if content == ContentMode.TRACE:
        if trace is None:
            raise ValueError("--content trace needs --trace")
        prompts = None
    rows = load_trace(trace) if trace is not None else None
    prompt_rows = load_prompts(prompts) if prompts is not None else None
    if arrivals == Arrivals.TRACE:
        if rows is None:
            raise ValueError("--arrivals trace needs --trace")
        return trace_workload(
            rows, rate=rate, duration_s=duration_s, max_requests=max_requests,
            prompts=prompt_rows, seed=seed, name=trace.name,
        )
    if rate is None or duration_s is None:
        raise ValueError(f"--arrivals {arrivals.value} needs --rate and --duration")
    pool = ([p.content() for p in prompt_rows] if prompt_rows is not None
            else [r.content for r in rows])
    process = SyntheticArrivals(arrivals, rate, duration_s, burstiness, mean_burst,
                                burst_distribution)
    workload = synthetic_workload(process, pool, seed=seed)
    if max_requests is not None:
        workload = workload.with_requests(workload.requests[:max_requests])
    return workload


def _session_workload(
    content: ContentMode, arrivals: Arrivals, sessions: Path | None, rate: float | None,
    duration_s: float | None, seed: int, burstiness: float, context_limit: int | None,
) -> Workload:
    if content == ContentMode.SESSIONS:
        if sessions is None:
            raise ValueError("--content sessions needs --sessions (a JSONL session log)")
        return file_workload(sessions, rate=rate, duration_s=duration_s)
    if arrivals not in (Arrivals.POISSON, Arrivals.GAMMA):
        raise ValueError(f"--content {content.value}: sessions arrive by --arrivals poisson "
                         "or gamma")
    if rate is None or duration_s is None:
        raise ValueError(f"--content {content.value} needs --rate (sessions/s) and --duration")
    if context_limit is None:
        raise ValueError("agent sessions need the served model's context limit")
    process = SyntheticArrivals(arrivals, rate, duration_s, burstiness)
    return preset_workload(SessionPreset(content.value), process, context_limit, seed)


def with_engine_order(cluster: ClusterConfig, scheduling_policy: SchedulingPolicy | None,
                      request_priority: PriorityRule | None) -> ClusterConfig:
    """The cluster with every engine's scheduling policy and the router's request
    priority replaced where given, validated again."""
    data = cluster.model_dump()
    if scheduling_policy is not None:
        for group in data["groups"]:
            group["engine"]["scheduler"]["scheduling_policy"] = scheduling_policy
    if request_priority is not None:
        data["request_priority"] = request_priority
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"]) from None


def context_limit_of(cluster: ClusterConfig) -> int:
    """The context every engine of the cluster takes (the smallest)."""
    return min(e.max_model_len for e in cluster.engines())


def _simulate(
    spec: ReplaySpec, kind: PolicyKind, workload: Workload, progress: Callable[[int], None] | None
) -> SimResult:
    stack = build_routing(kind, spec.routing, spec.fleet)
    sim = Simulator.from_config(
        spec.cluster, stack.policy, watchdog=stack.watchdog,
        max_drain_s=spec.max_drain_s, seed=spec.seed,
    )
    return sim.run(workload, progress=progress)


def cell_outcome(
    policy: str, scale: float, records: Sequence[RequestRecord], duration_s: float,
    makespan_s: float, wall_s: float,
) -> RunOutcome:
    """One (policy, scale) cell with its summary row (sim and live backends alike)."""
    row = {"policy": policy, "slo_scale": scale, **summarize(records, duration_s).as_row(),
           "makespan_s": makespan_s, "wall_s": wall_s}
    return RunOutcome(policy, scale, row, tuple(records))


def _outcome(
    kind: PolicyKind, scale: float, result: SimResult, records: Sequence[RequestRecord],
    wall_s: float,
) -> RunOutcome:
    return cell_outcome(kind.value, scale, records, result.duration_s, result.makespan_s, wall_s)


def _reuses_runs(spec: ReplaySpec, kind: PolicyKind) -> bool:
    return (spec.rescore and not POLICY_REGISTRY.get(kind).deadline_aware
            and spec.cluster.request_priority is PriorityRule.NONE)


def _policy_cells(
    spec: ReplaySpec, kind: PolicyKind, workload: Workload,
    phases_s: Sequence[tuple[float, float]], progress: Callable[[int], None] | None,
) -> list[RunOutcome]:
    """One policy at every scale; wall_s is 0 for cells re-scored from an earlier run."""
    cells: list[RunOutcome] = []
    shared: SimResult | None = None
    solo_s = phases_total_s(workload.requests, phases_s)
    for scale in spec.slo_scales:
        if shared is not None:
            factor = scale / spec.slo_scales[0]
            records = [r.rescored(factor) for r in shared.records]
            cells.append(_outcome(kind, scale, shared, records, 0.0))
            continue
        result = _simulate(spec, kind, assign_slos(workload, solo_s, scale, phases_s),
                           progress)
        cells.append(_outcome(kind, scale, result, result.records, result.wall_s))
        if _reuses_runs(spec, kind):
            shared = result
    return cells


def run_replay(
    spec: ReplaySpec, workload: Workload, progress: Callable[[int], None] | None = None
) -> list[RunOutcome]:
    """All (policy, scale) cells, in policy-major order."""
    reference = reference_instance(cluster_model(spec.cluster), spec.reference_gpu)
    phases_s = solo_phases_s(workload.requests, reference)
    return [
        cell for kind in spec.policies
        for cell in _policy_cells(spec, kind, workload, phases_s, progress)
    ]


def num_simulations(spec: ReplaySpec) -> int:
    return sum(1 if _reuses_runs(spec, k) else len(spec.slo_scales) for k in spec.policies)


# ---- outputs ------------------------------------------------------------------------


def write_rows_csv(path: Path, rows: Sequence[dict[str, Any]], fieldnames: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)


Key = TypeVar("Key")


def read_keyed_rows(
    paths: Sequence[Path],
    key: Callable[[dict[str, str]], Key],
    describe: Callable[[Key], str],
) -> dict[Key, dict[str, str]]:
    """The rows of CSV files (as `write_rows_csv` wrote them) by `key`, merged across
    files: pooling runs made separately. ValueError for a missing file or a key seen
    twice (`describe` names it)."""
    rows: dict[Key, dict[str, str]] = {}
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        with path.open() as f:
            for row in csv.DictReader(f):
                row_key = key(row)
                if row_key in rows:
                    raise ValueError(f"{path}: {describe(row_key)} appears more than once")
                rows[row_key] = row
    return rows


def write_summary_csv(path: Path, outcomes: Sequence[RunOutcome]) -> None:
    rows = [o.summary for o in outcomes]
    write_rows_csv(path, rows, list(rows[0]))


def output_bands(records: Sequence[RequestRecord]) -> tuple[int, int]:
    """Tercile cut points of the true output lengths: short < first <= mid < second."""
    lengths = sorted(r.num_output_tokens for r in records)
    if not lengths:
        return (0, 0)
    return lengths[len(lengths) // 3], lengths[2 * len(lengths) // 3]


def placement_rows(outcomes: Sequence[RunOutcome]) -> list[dict[str, Any]]:
    """Per cell: where requests were first placed and how many met their deadline
    there, by output-length tercile. Shows which instances a policy spends on which
    requests (e.g. long requests holding the strongest GPU at a tight SLO scale)."""
    rows = []
    for o in outcomes:
        cuts = output_bands(o.records)
        counts: dict[tuple[str, str], list[int]] = {}
        for r in o.records:
            instance = r.instance_ids[0] if r.instance_ids else "-"
            band = ("short" if r.num_output_tokens < cuts[0]
                    else "mid" if r.num_output_tokens < cuts[1] else "long")
            cell = counts.setdefault((instance, band), [0, 0])
            cell[0] += 1
            cell[1] += r.outcome == RequestOutcome.MET
        rows += [
            {"policy": o.policy, "slo_scale": o.slo_scale, "instance": instance,
             "output_band": band, "band_cuts": f"{cuts[0]}/{cuts[1]}", "placed": placed,
             "met": met}
            for (instance, band), (placed, met) in sorted(counts.items())
        ]
    return rows


def write_placement_csv(path: Path, outcomes: Sequence[RunOutcome]) -> None:
    rows = placement_rows(outcomes)
    write_rows_csv(path, rows, list(rows[0]) if rows else ["policy"])


def write_records_parquet(path: Path, outcomes: Sequence[RunOutcome]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"policy": o.policy, "slo_scale": o.slo_scale, **r.as_row()}
        for o in outcomes
        for r in o.records
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


PLOT_MARKERS = "os^vDP*X<>"


def write_plots(out: Path, outcomes: Sequence[RunOutcome]) -> list[Path]:
    """goodput.png and slo_violation.png: one line per policy vs SLO scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    policies = list(dict.fromkeys(o.policy for o in outcomes))
    # one colour and marker per policy: the default cycle repeats after ten lines
    colours = plt.get_cmap("tab20").colors
    for metric, label, name in (
        ("goodput_rps", "goodput (req/s within SLO)", "goodput.png"),
        ("slo_violation_ratio", "SLO violation ratio", "slo_violation.png"),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for i, policy in enumerate(policies):
            cells = [o for o in outcomes if o.policy == policy]
            ax.plot([o.slo_scale for o in cells], [o.summary[metric] for o in cells],
                    marker=PLOT_MARKERS[i % len(PLOT_MARKERS)],
                    color=colours[(2 * i) % 20 + (i // 10) % 2], label=policy)
        ax.set_xlabel("SLO scale")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def write_report(path: Path, setup: dict[str, Any], outcomes: Sequence[RunOutcome]) -> None:
    columns = ["policy", "slo_scale", "requests", "met", "rejected", "goodput_rps",
               "slo_violation_ratio", "p50_e2e_s", "p99_e2e_s", "migrations"]
    lines = ["# Replay report", "", "## Setup", ""]
    lines += [f"- {key}: {_fmt(value)}" for key, value in setup.items()]
    lines += [
        "",
        "Goodput = requests finished by their deadline / arrival-window seconds "
        "(`duration_s`); SLO violation ratio = 1 - met / requests (rejected and "
        "unfinished requests count as violations). SLO = scale x solo time on the "
        "reference GPU.",
        "",
        "## Results",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(_fmt(o.summary[c]) for c in columns) + " |" for o in outcomes]
    lines += ["", "Plots: goodput.png, slo_violation.png. Records: requests.parquet. "
              "Where requests started and met, by output-length tercile: placement.csv.", ""]
    path.write_text("\n".join(lines))


def write_outputs(out: Path, setup: dict[str, Any], outcomes: Sequence[RunOutcome]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_summary_csv(out / "summary.csv", outcomes)
    write_records_parquet(out / "requests.parquet", outcomes)
    write_placement_csv(out / "placement.csv", outcomes)
    write_plots(out, outcomes)
    write_report(out / "report.md", setup, outcomes)


# ---- command line ---------------------------------------------------------------------


def cli_error(message: str) -> typer.Exit:
    """A one-line CLI error (exit code 2) to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@knob_options
def replay(
    cluster: Annotated[Path, typer.Option(help="cluster YAML (top-level key `cluster`)")],
    out: Annotated[Path, typer.Option(help="output directory")],
    trace: Annotated[Path | None, typer.Option(help="Mooncake .jsonl or Azure .csv")] = None,
    prompts: Annotated[Path | None, typer.Option(help="prompt_lengths.jsonl content")] = None,
    content: Annotated[
        ContentMode | None,
        typer.Option(help="trace (the trace's own lengths and prefix blocks) | prompts | "
                     "coding-agent | chat-agent | research-agent (closed-loop agent "
                     "sessions; --rate in sessions/s) | sessions (a JSONL session log, "
                     "--sessions); default: prompts with --prompts, else trace")] = None,
    sessions: Annotated[
        Path | None, typer.Option(help="JSONL agent session log (--content sessions)")] = None,
    policies: Annotated[str, typer.Option(help="comma-separated names, or 'all'")] = "all",
    slo_scales: Annotated[str, typer.Option(help="comma-separated")] = "1,1.5,2,2.5,3",
    backend: Annotated[Backend, typer.Option(help="sim | live")] = Backend.SIM,
    arrivals: Annotated[
        Arrivals, typer.Option(help="trace | poisson | gamma | batch")] = Arrivals.TRACE,
    burstiness: Annotated[
        float, typer.Option(help="gamma: coefficient of variation of inter-arrival gaps "
                            "(1 = Poisson)")] = 1.0,
    burst_size: Annotated[
        float, typer.Option(help="batch: mean requests per burst of simultaneous arrivals")
    ] = 16.0,
    burst_distribution: Annotated[
        BurstDistribution, typer.Option(help="batch: fixed | geometric | uniform burst sizes")
    ] = BurstDistribution.GEOMETRIC,
    rate: Annotated[float | None, typer.Option(help="target arrival rate, req/s")] = None,
    duration: Annotated[float | None, typer.Option(help="arrival window, seconds")] = None,
    max_requests: Annotated[int | None, typer.Option(help="keep the first N requests")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    slo_reference_gpu: Annotated[str, typer.Option()] = DEFAULT_REFERENCE_GPU,
    max_drain: Annotated[
        float | None, typer.Option(help="stop this many s after the last arrival")
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a progress bar")] = True,
    rescore: Annotated[
        bool, typer.Option(help="simulate deadline-unaware policies once for all scales")
    ] = True,
    predictor: Annotated[
        Path | None,
        typer.Option(help="directory from `goodserve predictor train`: GoodServe uses its "
                     "MoE (default: a running history of finished lengths)"),
    ] = None,
    routers: Annotated[int, typer.Option(
        min=1, help="router replicas (sim), each with its own policy state")] = 1,
    router_spread: Annotated[Spread, typer.Option(
        help="how requests reach the replicas: random | session")] = Spread.RANDOM,
    router_sharing: Annotated[Sharing, typer.Option(
        help="what the replicas know beyond their own placements: nothing | reports "
        "(the engines' queues, every --report-interval) | budgets (reports, and each "
        "other's smallest slack per engine) | learning (budgets, and each other's "
        "finishes to learn lengths from, as live replicas share)")] = Sharing.LEARNING,
    report_interval: Annotated[float, typer.Option(
        help="seconds between a replica's engine reports")] = DEFAULT_REPORT_INTERVAL_S,
    move_path: Annotated[
        MoveRule | None,
        typer.Option(help="how migrations reach their target: cheaper | token-ids | kv "
                     "(default: the cluster config's move_path)")] = None,
    scheduling_policy: Annotated[
        SchedulingPolicy | None,
        typer.Option(help="every engine's scheduling policy: fcfs | priority (default: "
                     "the cluster config's)")] = None,
    request_priority: Annotated[
        PriorityRule | None,
        typer.Option(help="the engine priority each request is sent with: none | deadline "
                     "(default: the cluster config's request_priority)")] = None,
    goodserve: GoodServeConfig = GoodServeConfig(),
) -> None:
    """Replay a trace against routing policies and SLO scales; write results to --out."""
    try:
        cluster_config = load_cluster_config(cluster)
        if move_path is not None:
            cluster_config = cluster_config.model_copy(update={"move_path": move_path})
        if scheduling_policy is not None or request_priority is not None:
            cluster_config = with_engine_order(cluster_config, scheduling_policy,
                                               request_priority)
        spec = ReplaySpec(
            cluster=cluster_config,
            policies=parse_policies(policies),
            slo_scales=parse_scales(slo_scales),
            seed=seed,
            reference_gpu=slo_reference_gpu,
            max_drain_s=max_drain,
            rescore=rescore,
            routing=RoutingOptions(seed, goodserve, _length_factory(predictor)),
            fleet=FleetConfig(routers, router_spread, router_sharing, report_interval),
        )
        if backend == Backend.LIVE and routers > 1:
            raise ValueError("--routers is for the simulator; live, run more router "
                             "replicas (the serve config's router num_replicas)")
        workload = build_workload(
            arrivals=arrivals, trace=trace, prompts=prompts, rate=rate,
            duration_s=duration, max_requests=max_requests, seed=seed,
            burstiness=burstiness, mean_burst=burst_size, burst_distribution=burst_distribution,
            content=content, sessions=sessions, context_limit=context_limit_of(spec.cluster),
        )
        if predictor is not None:
            workload = attach_predictions(workload, spec.routing.length_factory())
        if backend == Backend.LIVE:
            outcomes = run_live_with_progress(spec, workload, progress, predictor)
        else:
            outcomes = _run_with_progress(spec, workload, progress)
    except ValueError as exc:
        raise cli_error(str(exc)) from None
    setup = {
        "backend": backend.value, "cluster": f"{cluster} ({spec.cluster.name})",
        "instances": ", ".join(e.instance.name for e in spec.cluster.engines()),
        "model": cluster_model(spec.cluster), "trace": trace, "prompts": prompts,
        "content": workload.name if workload.graph is not None else (
            content or ("prompts" if prompts else "trace")),
        "arrivals": workload.name if arrivals != Arrivals.TRACE else arrivals.value,
        "rate_rps": rate, "requests": len(workload),
        "duration_s": workload.duration_s, "seed": seed, "slo_reference": slo_reference_gpu,
        "move_path": spec.cluster.move_path.value, "kv_link_gbps": spec.cluster.kv_link_gbps,
        "scheduling_policy": ",".join(sorted({e.scheduler.scheduling_policy.value
                                              for e in spec.cluster.engines()})),
        "request_priority": spec.cluster.request_priority.value,
        "predictor": predictor or "running history", **goodserve_knobs(goodserve),
        "stall_factor": stall_factor_label(goodserve.stall_factor),
        "routers": routers, "router_spread": router_spread.value,
        "router_sharing": router_sharing.value, "report_interval_s": report_interval,
    }
    write_outputs(out, setup, outcomes)
    typer.echo(f"wrote {out}/summary.csv, requests.parquet, placement.csv, goodput.png, "
               f"slo_violation.png, report.md")


def moe_factory(directory: Path) -> Callable[[], Predictor]:
    """A fresh load of the saved MoE per call (predictors learn online, so runs must not
    share one); it is loaded once here to fail early on a bad directory."""
    from predictor.registry import load_predictor

    try:
        load_predictor(directory, "moe")
    except (OSError, KeyError) as exc:
        raise ValueError(f"cannot load predictor from {directory}: {exc}") from None
    return lambda: load_predictor(directory, "moe")


def _length_factory(model_dir: Path | None) -> Callable[[], OutputLengthEstimator] | None:
    """GoodServe's length estimator: the saved MoE, fresh per run."""
    if model_dir is None:
        return None
    load = moe_factory(model_dir)
    return lambda: PredictorLength(load())


def attach_predictions(workload: Workload, length: OutputLengthEstimator) -> Workload:
    """Arrival-time L_out_hat for every request in one batched call (as the router's
    micro-batcher would compute them), so routing does not predict one by one."""
    routes = [r.route_request() for r in workload.requests]
    totals = length.predict_totals(routes, [0] * len(routes))
    return workload.with_requests(
        [replace(r, predicted_output_tokens=round(t))
         for r, t in zip(workload.requests, totals, strict=True)]
    )


def _run_with_progress(spec: ReplaySpec, workload: Workload, show: bool) -> list[RunOutcome]:
    from predictor.progress import Progress

    total = num_simulations(spec) * len(workload)
    with Progress(total=total, unit="req", enabled=show, desc="replay") as bar:
        return run_replay(spec, workload, bar.update)


def run_live_replay(
    spec: ReplaySpec, workload: Workload, predictor_dir: Path | None = None,
    progress: Callable[[int], None] | None = None, stop_serve: bool = True,
) -> list[RunOutcome]:
    """Every (policy, scale) cell through a local Ray Serve router, one deployment each.

    Deadline-unaware policies are not re-scored across scales here: a live run is
    not repeatable, so each cell is its own run. `stop_serve` False: the caller stops
    the Ray it started right after, which ends Serve too (Serve's own shutdown has its
    controller kill itself inside the call, which Ray then logs as a failed task).
    """
    from ray import serve

    from app.experiments.live_replay import live_cell, serve_config_for, stop_time_s
    from app.serving.config import ServeConfig
    from deployments.cluster import init_local_ray
    from deployments.router import free_port

    for kind in spec.policies:
        if kind in SIM_ONLY:
            raise ValueError(f"policy {kind.value!r} needs true output lengths: sim backend only")
    base = ServeConfig(cluster=spec.cluster)
    reference = reference_instance(cluster_model(spec.cluster), spec.reference_gpu)
    phases_s = solo_phases_s(workload.requests, reference)
    solo_s = phases_total_s(workload.requests, phases_s)
    stop_s = stop_time_s(workload, spec.max_drain_s)
    init_local_ray(spec.cluster)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    outcomes = []
    try:
        for kind in spec.policies:
            config = serve_config_for(
                base, kind.value, **goodserve_knobs(spec.routing.goodserve), seed=spec.seed,
                predictor_dir=None if predictor_dir is None else str(predictor_dir))
            for scale in spec.slo_scales:
                cell = assign_slos(workload, solo_s, scale, phases_s)
                records, wall_s = live_cell(config, cell, f"http://127.0.0.1:{port}", progress,
                                            stop_s)
                makespan_s = max((r.finish_s for r in records if r.finish_s is not None),
                                 default=0.0)
                outcomes.append(cell_outcome(kind.value, scale, records, cell.duration_s,
                                             makespan_s, wall_s))
    finally:
        if stop_serve:
            serve.shutdown()
    return outcomes


def run_live_with_progress(
    spec: ReplaySpec, workload: Workload, show: bool, predictor_dir: Path | None
) -> list[RunOutcome]:
    import ray

    from predictor.progress import Progress

    total = len(spec.policies) * len(spec.slo_scales) * len(workload)
    owns_ray = not ray.is_initialized()  # stop only a Ray this run starts
    try:
        with Progress(total=total, unit="req", enabled=show, desc="live replay") as bar:
            return run_live_replay(spec, workload, predictor_dir, bar.update,
                                   stop_serve=not owns_ray)
    finally:
        if owns_ray:
            ray.shutdown()
