"""`goodserve plan cluster`: SARA's mode and split for a cluster's own engines, checked
by simulating the layouts under GoodServe routing.

    goodserve plan cluster --cluster configs/paper-4gpu.yaml --content chat-agent \\
        --rate 0.4 --duration 500 --slo-scale 2 [--verify] [--json]

The workload is generated (or read from --trace) as `goodserve replay` does; its length
moments are what the plan sees, as a controller would measure them. With --verify every
layout is simulated on that workload and the report puts the modelled goodput and the
promised attainment next to the simulated ones.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import ClusterConfig, EngineRole, load_cluster_config
from app.experiments.autoscale import observed
from app.experiments.replay import (
    ReplaySpec,
    build_workload,
    cli_error,
    cluster_model,
    context_limit_of,
    run_replay,
)
from app.planning.cluster_plan import (
    UNIFIED,
    ClusterPlan,
    Layout,
    LayoutEstimate,
    plan_cluster,
    promised_attainment,
)
from app.planning.params import ModelParams
from app.planning.split import EngineKind
from app.routing.registry import PolicyKind, RoutingOptions
from app.workloads.slo import DEFAULT_REFERENCE_GPU, reference_instance
from app.workloads.workload import Arrivals, ContentMode, Workload
from predictor.progress import Progress

SHOWN = 10  # best-modelled layouts reported besides unified and those simulated
MAX_SIMULATED = 65  # above this many layouts --verify simulates the whole-kind ones


def inventory(cluster: ClusterConfig) -> Counter[EngineKind]:
    """Engine kind -> count; `with_layout` keeps the order of `cluster.engines()`."""
    return Counter(EngineKind(e.gpu_type, e.tp, e.scheduler.max_num_seqs)
                   for e in cluster.engines())


def with_layout(cluster: ClusterConfig, layout: Layout) -> ClusterConfig:
    """The same engines run as `layout`: unchanged for unified, else disaggregated with the
    first `layout.prefill_count(kind)` engines of each kind prefilling."""
    if layout.mode == UNIFIED:
        return cluster
    seen: Counter[str] = Counter()
    groups = []
    prefill = dict(layout.prefill)
    for engine in cluster.engines():
        kind = EngineKind(engine.gpu_type, engine.tp).name
        role = EngineRole.PREFILL if seen[kind] < prefill.get(kind, 0) else EngineRole.DECODE
        seen[kind] += 1
        groups.append({"count": 1, "engine": engine.model_copy(update={"role": role})})
    return ClusterConfig.model_validate({
        **cluster.model_dump(exclude={"groups", "mode", "name"}),
        "name": f"{cluster.name}-pd-{layout.label}", "mode": "disaggregated",
        "groups": groups,
    })


def layouts_to_simulate(plan: ClusterPlan) -> list[Layout]:
    """Every layout, or above `MAX_SIMULATED` of them the whole-kind ones and the
    recommended one."""
    if len(plan.estimates) <= MAX_SIMULATED:
        return [e.layout for e in plan.estimates]
    return whole_kind_layouts(plan) + [plan.recommended.layout]


def whole_kind_layouts(plan: ClusterPlan) -> list[Layout]:
    """Unified and every split where each kind prefills or decodes as a whole: the
    layouts worth simulating when there are too many splits to simulate them all."""
    kinds = [(kind.name, n) for kind, n in plan.inventory]
    layouts = [Layout()]
    for mask in range(1, 2 ** len(kinds) - 1):
        layouts.append(Layout(tuple(k for i, k in enumerate(kinds) if mask >> i & 1)))
    return layouts


@dataclass(frozen=True)
class LayoutCheck:
    """One layout: what SARA models and promises, and what the simulator measured."""

    layout: str
    mode: str
    recommended: bool
    model_goodput_rps: float
    binding: str
    prefill_share: float | None
    promised_attainment: float  # at the workload's rate
    requests: int | None = None
    met: int | None = None
    simulated_attainment: float | None = None
    simulated_goodput_rps: float | None = None


@dataclass(frozen=True)
class Simulation:
    """What the simulator measured for one layout under GoodServe."""

    requests: int
    met: int
    goodput_rps: float


def plan_for(cluster: ClusterConfig, workload: Workload, scale: float,
             reference_gpu: str = DEFAULT_REFERENCE_GPU) -> ClusterPlan:
    """SARA's scores of every layout for the workload's measured moments."""
    model = cluster_model(cluster)
    return plan_cluster(inventory(cluster), ModelParams.named(model), observed(workload).workload,
                        reference_instance(model, reference_gpu), scale, cluster.kv_link_gbps)


def check_layouts(cluster: ClusterConfig, workload: Workload, scale: float, plan: ClusterPlan,
                  layouts: Sequence[Layout] | None, seed: int,
                  routing: RoutingOptions | None = None,
                  reference_gpu: str = DEFAULT_REFERENCE_GPU, top: int = SHOWN,
                  progress: bool = False,
                  measured: Mapping[str, Simulation] | None = None) -> list[LayoutCheck]:
    """The `top` best estimates of `plan`, unified and the `layouts`, each with its
    promise at the workload's rate; the `layouts` also simulated under GoodServe, or
    their simulation taken from `measured` (by label: the simulator does not read the
    plan, so a changed model is rescored on the same runs)."""
    model = ModelParams.named(cluster_model(cluster))
    moments = observed(workload)
    simulate = set(layouts or ())
    shown = [e for rank, e in enumerate(plan.estimates)
             if rank < top or e.layout in simulate or e.layout.mode == UNIFIED]
    checks = []
    for estimate in Progress(shown, desc="layouts", enabled=progress):
        check = _modelled(plan, estimate, model, moments.workload, moments.rate_rps,
                          cluster.kv_link_gbps)
        if estimate.layout in simulate:
            run = (measured or {}).get(estimate.layout.label)
            if run is None:
                spec = ReplaySpec(with_layout(cluster, estimate.layout),
                                  (PolicyKind.GOODSERVE,), (scale,), seed=seed,
                                  reference_gpu=reference_gpu,
                                  routing=routing or RoutingOptions(seed))
                (cell,) = run_replay(spec, workload)
                run = Simulation(cell.summary["requests"], cell.summary["met"],
                                 cell.summary["goodput_rps"])
            check = replace(check, requests=run.requests, met=run.met,
                            simulated_attainment=run.met / run.requests,
                            simulated_goodput_rps=run.goodput_rps)
        checks.append(check)
    return checks


def _modelled(plan: ClusterPlan, estimate: LayoutEstimate, model: ModelParams, moments,
              rate_rps: float, kv_link_gbps: float | None) -> LayoutCheck:
    return LayoutCheck(
        layout=estimate.layout.label, mode=estimate.layout.mode,
        recommended=estimate is plan.recommended,
        model_goodput_rps=estimate.goodput_rps, binding=estimate.binding,
        prefill_share=estimate.prefill_share,
        promised_attainment=promised_attainment(plan, estimate, model, moments, rate_rps,
                                                kv_link_gbps))


def format_checks(checks: Sequence[LayoutCheck], rate_rps: float) -> str:
    """A table, recommended layout first."""
    lines = [f"{'layout':<28} {'model req/s':>11} {'binding':>8} {'share':>6} "
             f"{'promised':>8} {'simulated':>9} {'goodput':>8}"]
    for c in checks:
        share = "prop" if c.prefill_share is None else f"{c.prefill_share:g}"
        sim = ("-" if c.simulated_attainment is None else f"{c.simulated_attainment:.1%}")
        goodput = "-" if c.simulated_goodput_rps is None else f"{c.simulated_goodput_rps:.3f}"
        mark = "*" if c.recommended else " "
        lines.append(f"{mark}{c.layout:<27} {c.model_goodput_rps:>11.3f} {c.binding:>8} "
                     f"{share:>6} {c.promised_attainment:>8.1%} {sim:>9} {goodput:>8}")
    lines.append(f"* recommended; promised and simulated attainment at {rate_rps:.3g} req/s")
    return "\n".join(lines)


def plan_cluster_command(
    cluster: Annotated[Path, typer.Option(help="cluster YAML of the engines to lay out")],
    rate: Annotated[float, typer.Option(
        help="arrival rate, req/s (sessions/s for agent presets)")],
    slo_scale: Annotated[float, typer.Option(help="deadline = scale x solo time")] = 2.0,
    content: Annotated[ContentMode, typer.Option(
        help="trace | prompts | coding-agent | chat-agent | research-agent | sessions",
    )] = ContentMode.CHAT_AGENT,
    trace: Annotated[Path | None, typer.Option(help="Mooncake .jsonl or Azure .csv")] = None,
    prompts: Annotated[Path | None, typer.Option(help="prompt_lengths.jsonl")] = None,
    sessions: Annotated[Path | None, typer.Option(help="JSONL agent session log")] = None,
    duration: Annotated[float, typer.Option(help="arrival window, s")] = 300.0,
    seed: Annotated[int, typer.Option()] = 0,
    slo_reference_gpu: Annotated[str, typer.Option()] = DEFAULT_REFERENCE_GPU,
    verify: Annotated[bool, typer.Option(
        "--verify", help=f"simulate every layout (unified and each split; above "
        f"{MAX_SIMULATED} layouts, those where each GPU kind takes one role, and the "
        "recommended one)")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Recommend unified or P/D, and the split, for a cluster's own engines."""
    try:
        config = load_cluster_config(cluster)
        if config.mode != UNIFIED:
            raise ValueError(f"{cluster} must describe a unified cluster (the plan assigns "
                             "roles)")
        arrivals = Arrivals.TRACE if content in (ContentMode.TRACE, ContentMode.PROMPTS) and \
            trace is not None else Arrivals.POISSON
        workload = build_workload(arrivals=arrivals, trace=trace, prompts=prompts, rate=rate,
                                  duration_s=duration, max_requests=None, seed=seed,
                                  content=content, sessions=sessions,
                                  context_limit=context_limit_of(config))
        plan = plan_for(config, workload, slo_scale, slo_reference_gpu)
    except (ValueError, OSError) as error:
        raise cli_error(str(error)) from None
    layouts = None
    if verify:
        layouts = layouts_to_simulate(plan)
    checks = check_layouts(config, workload, slo_scale, plan, layouts, seed,
                           reference_gpu=slo_reference_gpu, progress=verify and not json_out)
    rate_rps = observed(workload).rate_rps
    if json_out:
        typer.echo(json.dumps({"rate_rps": rate_rps, "slo_scale": slo_scale,
                               "layouts": [asdict(c) for c in checks]}, indent=2))
    else:
        typer.echo(format_checks(checks, rate_rps))
