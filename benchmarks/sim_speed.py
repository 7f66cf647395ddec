"""Simulator speed, part by part, alone or beside a reference checkout.

    python -m benchmarks.sim_speed [--parts trace,scale,capacity,sessions] [--json]
        [--reference REF [--repeats N] [--out DIR]]

Parts (--parts, every one by default):
- trace: the whole Mooncake conversation trace on configs/paper-4gpu.yaml, every registered
  policy x five SLO scales (the native 3.4 req/s of 12k-token prompts is far beyond four
  GPUs, so the trace is stretched to --rate).
- scale: configs/sim-512.yaml with Poisson arrivals at --scale-rps for --scale-seconds of
  virtual time (stopping at the last arrival, so the figure is steady-state work, not a
  drain tail): simulated requests per second.
- capacity: the unit of `benchmarks.agentic --capacity` on the 16-engine cluster
  (configs/mixed-16gpu.yaml): one policy's search on chat-agent at one SLO scale and seed,
  run at the rates such a search tries, each rate one simulator run as the search makes
  it. The default rates are those of GoodServe's search at scale 2, seed 0, with 500-s
  windows, which found 2.52 sessions/s (results/agentic-capacity-large): fixed rates keep
  the work the same on both sides of a comparison, where a search would follow the met
  shares.
- sessions: an agent-session log replayed with every registered policy (llm-d among
  them) at --sessions-scales, as `goodserve replay --content sessions --sessions LOG`
  does; without --sessions, a log the project's session generator
  (app/workloads/sessions.py) writes for --sessions-preset sessions arriving at
  --sessions-rate per second for --sessions-seconds.

Each part prints wall and CPU seconds (on a shared machine the CPU figure is steadier) and
the counts that speed work must leave alone: met requests per policy cell (policy@scale,
policy@rate), or for the scale part the requests finished and the tokens emitted.

With --reference REF (a git ref or another checkout's directory; app/experiments/
reference.py), every part runs --repeats times in the reference checkout and in this one,
each run a process of its own, the sides taking turns at going first; the report gives
wall and CPU seconds per side, current / reference, and whether the counts are the same.
The timing code is this file on both sides; what it times (app/, predictor/,
benchmarks/agentic.py) is each checkout's own, so the reference needs what this file
imports at its top.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import (
    ReplaySpec,
    build_workload,
    context_limit_of,
    num_simulations,
    run_replay,
)
from app.routing.registry import POLICY_REGISTRY, PolicyKind, RoutingOptions, make_policy
from app.sim.simulator import Simulator
from app.workloads.sessions import SessionPreset, iter_session_rows, preset_sessions
from app.workloads.slo import DEFAULT_SLO_SCALES, parse_scales
from app.workloads.workload import (
    Arrivals,
    Content,
    ContentMode,
    SyntheticArrivals,
    load_prompts,
    load_trace,
    poisson_workload,
    trace_workload,
)
from benchmarks.agentic import DURATION_S, TRACE, MatrixSetup, run_cells
from benchmarks.cli import run_command

if TYPE_CHECKING:
    from app.experiments.reference import Checkout, PairedRun

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
PARTS = ("trace", "scale", "capacity", "sessions")
# GoodServe's capacity search on chat-agent, large cluster, scale 2, seed 0, 500-s windows
CAPACITY_RATES = (3.2, 1.6, 2.2627, 2.6909, 2.4675, 2.5768, 2.5216)
# options of a run beside a reference that each process is not given as they are
NOT_FORWARDED = frozenset({"parts", "skip_trace", "skip_scale", "as_json", "reference",
                           "repeats", "out"})


@dataclass(frozen=True)
class PartResult:
    """One part's timing and the counts that must not change with speed work."""

    part: str
    wall_s: float
    cpu_s: float
    counts: dict[str, int]
    lines: list[str] = field(default_factory=list)  # the report for a reader

    def as_json(self) -> dict[str, Any]:
        return {"part": self.part, "wall_s": round(self.wall_s, 3),
                "cpu_s": round(self.cpu_s, 3), "counts": self.counts}


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """Wall and CPU seconds of the block, in the dict it yields once it ends."""
    spent: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield spent
    finally:
        spent["wall_s"] = time.perf_counter() - wall
        spent["cpu_s"] = time.process_time() - cpu


def trace_replay(trace: Path, cluster: Path, rate: float, rescore: bool) -> PartResult:
    spec = ReplaySpec(
        cluster=load_cluster_config(cluster),
        policies=tuple(POLICY_REGISTRY.kinds()),
        slo_scales=DEFAULT_SLO_SCALES,
        rescore=rescore,
    )
    workload = trace_workload(load_trace(trace), rate=rate, name=trace.name)
    with timed() as spent:
        outcomes = run_replay(spec, workload)
    lines = [f"{trace.name}: {len(workload)} requests at {rate} req/s "
             f"(window {workload.duration_s:.0f} s) on {spec.cluster.name}",
             f"{'policy':<24} {'sim wall s':>10}  "
             + " ".join(f"{f'met@{s:g}':>7}" for s in spec.slo_scales)
             + f"  (met of {len(workload)})"]
    for kind in spec.policies:
        cells = [o for o in outcomes if o.policy == kind.value]
        sim_wall = sum(o.summary["wall_s"] for o in cells)
        met = " ".join(f"{o.summary['met']:7d}" for o in cells)
        lines.append(f"{kind.value:<24} {sim_wall:10.1f}  {met}")
    lines.append(f"total: {spent['wall_s']:.1f} s wall, {spent['cpu_s']:.1f} s CPU for "
                 f"{len(spec.policies)} policies x {len(spec.slo_scales)} SLO scales "
                 f"({num_simulations(spec)} simulations)")
    return PartResult("trace", spent["wall_s"], spent["cpu_s"], met_counts(outcomes), lines)


def met_counts(outcomes: Sequence[Any]) -> dict[str, int]:
    """policy@scale -> met requests, per replay cell."""
    return {f"{o.policy}@{o.slo_scale:g}": int(o.summary["met"]) for o in outcomes}


def scale_run(cluster: Path, rps: float, seconds: float, policy: str) -> PartResult:
    prompts = DATA / "prompts" / "prompt_lengths.jsonl"
    if prompts.is_file():
        pool, source = [p.content() for p in load_prompts(prompts)], prompts.name
    else:
        pool, source = [Content(256, 200)], "synthetic 256 in / 200 out"
    config = load_cluster_config(cluster)
    workload = poisson_workload(rps, seconds, pool, seed=0)
    sim = Simulator.from_config(config, make_policy(policy, seed=0), max_drain_s=0.0)
    with timed() as spent:
        result = sim.run(workload)
    wall, cpu = spent["wall_s"], spent["cpu_s"]
    lines = [f"{config.name}: {len(config.engines())} instances, Poisson {rps:.0f} req/s for "
             f"{seconds} simulated s ({len(workload)} arrivals, content: {source}, {policy})",
             f"  {wall:.1f} s wall ({cpu:.1f} s CPU): "
             f"{len(workload) / wall:.0f} simulated requests/s wall "
             f"({len(workload) / cpu:.0f}/s CPU), {result.num_events / wall:.0f} events/s, "
             f"{result.num_token_events / wall:.0f} tokens/s, "
             f"{seconds / wall:.3f} x real time, peak memory "
             f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"]
    # what the engines did, not how many events the simulator took to do it
    counts = {"finished": sum(r.finish_s is not None for r in result.records),
              "token_events": result.num_token_events}
    return PartResult("scale", wall, cpu, counts, lines)


def capacity_runs(policies: Sequence[str], rates: Sequence[float], scale: float, seed: int,
                  duration_s: float) -> PartResult:
    """Each policy on chat-agent, large cluster, at each rate: the runs of its capacity
    search at `scale` (benchmarks.agentic's `run_cells`, as the search calls it)."""
    setup = MatrixSetup({**DURATION_S, "chat-agent": duration_s}, TRACE, tuple(policies))
    counts: dict[str, int] = {}
    lines = [f"chat-agent on the large cluster, {duration_s:g}-s windows, seed {seed}, "
             f"SLO scale {scale:g}: {len(policies)} policies x {len(rates)} rates"]
    with timed() as spent:
        for policy in policies:
            for rate in rates:
                with timed() as run:
                    (row,) = run_cells("chat-agent", "large", rate, seed, setup, (policy,),
                                       (scale,))
                counts[f"{policy}@{rate:g}"] = int(row["met"])
                lines.append(f"  {policy} at {rate:g} sessions/s: {row['met']} of "
                             f"{row['requests']} steps met ({row['met'] / row['requests']:.3f})"
                             f", {run['wall_s']:.1f} s wall, {run['cpu_s']:.1f} s CPU")
    lines.append(f"total: {spent['wall_s']:.1f} s wall, {spent['cpu_s']:.1f} s CPU")
    return PartResult("capacity", spent["wall_s"], spent["cpu_s"], counts, lines)


def write_session_log(path: Path, preset: SessionPreset, rate: float, seconds: float,
                      seed: int, cluster: Path) -> str:
    """A session log of `preset` sessions arriving by Poisson at `rate` per second, for
    the context of `cluster`'s model; says what it holds."""
    limit = context_limit_of(load_cluster_config(cluster))
    starts = SyntheticArrivals(Arrivals.POISSON, rate, seconds).times(seed)
    sessions = preset_sessions(preset, starts, limit, seed)
    rows = list(iter_session_rows(sessions))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return (f"{len(sessions)} {preset.value} sessions ({len(rows)} steps) at {rate:g}/s for "
            f"{seconds:g} s, seed {seed}")


def sessions_replay(log: Path, cluster: Path, scales: Sequence[float]) -> PartResult:
    """The log through every registered policy, as `goodserve replay --content sessions`
    runs it (its loading timed too)."""
    config = load_cluster_config(cluster)
    spec = ReplaySpec(config, tuple(POLICY_REGISTRY.kinds()), tuple(scales),
                      routing=RoutingOptions(0))
    with timed() as spent:
        workload = build_workload(arrivals=Arrivals.TRACE, trace=None, prompts=None,
                                  rate=None, duration_s=None, max_requests=None, seed=0,
                                  content=ContentMode.SESSIONS, sessions=log,
                                  context_limit=context_limit_of(config))
        outcomes = run_replay(spec, workload)
    lines = [f"{log.name}: {len(workload)} steps on {config.name}, "
             f"{len(spec.policies)} policies x {len(spec.slo_scales)} SLO scales "
             f"({num_simulations(spec)} simulations)",
             f"{'policy':<24} " + " ".join(f"{f'met@{s:g}':>7}" for s in spec.slo_scales)]
    for kind in spec.policies:
        lines.append(f"{kind.value:<24} " + " ".join(
            f"{o.summary['met']:7d}" for o in outcomes if o.policy == kind.value))
    lines.append(f"total: {spent['wall_s']:.1f} s wall, {spent['cpu_s']:.1f} s CPU")
    return PartResult("sessions", spent["wall_s"], spent["cpu_s"], met_counts(outcomes),
                      lines)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if bad := [p for p in parts if p not in PARTS]:
        raise ValueError(f"unknown part {bad[0]!r}; known: {', '.join(PARTS)}")
    if not parts:
        raise ValueError("--parts names no part")
    return parts


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--capacity-rates {text!r}: give comma-separated numbers") from None
    if not rates or min(rates) <= 0:
        raise ValueError("--capacity-rates needs rates > 0")
    return rates


def parse_policies(text: str) -> list[str]:
    """Registered policy names (a bad one is a ValueError naming the known ones)."""
    return [PolicyKind.from_str(name).value for name in text.split(",") if name.strip()]


@contextmanager
def session_log(given: Path | None, write: Callable[[Path], str],
                say: Callable[[str], None]) -> Iterator[Path]:
    """The log given, or one written for the duration into a temporary directory."""
    if given is not None:
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="sim-speed-sessions-") as tmp:
        path = Path(tmp) / "sessions.jsonl"
        say(f"session log: {write(path)}")
        yield path


def main_command(
    ctx: typer.Context,
    parts: Annotated[str, typer.Option(help="comma-separated: " + ", ".join(PARTS))
                     ] = ",".join(PARTS),
    rate: Annotated[float, typer.Option(help="Mooncake replay rate, req/s")] = 0.75,
    trace: Annotated[Path, typer.Option()] = DATA / "traces" / "mooncake_conversation_trace.jsonl",
    cluster: Annotated[Path, typer.Option()] = REPO / "configs" / "paper-4gpu.yaml",
    rescore: Annotated[bool, typer.Option(help="one run per SLO-unaware policy")] = True,
    scale_cluster: Annotated[Path, typer.Option()] = REPO / "configs" / "sim-512.yaml",
    scale_rps: Annotated[float, typer.Option()] = 10_000.0,
    scale_seconds: Annotated[float, typer.Option()] = 3.0,
    scale_policy: Annotated[str, typer.Option()] = "p2c",
    skip_trace: Annotated[bool, typer.Option(help="leave out the trace part")] = False,
    skip_scale: Annotated[bool, typer.Option(help="leave out the scale part")] = False,
    capacity_policies: Annotated[str, typer.Option(
        help="capacity: whose search runs, comma-separated")] = PolicyKind.GOODSERVE.value,
    capacity_rates: Annotated[str, typer.Option(
        help="capacity: sessions/s, comma-separated (default: GoodServe's search at scale "
        "2, seed 0)")] = ",".join(f"{r:g}" for r in CAPACITY_RATES),
    capacity_scale: Annotated[float, typer.Option(help="capacity: SLO scale")] = 2.0,
    capacity_seed: Annotated[int, typer.Option(help="capacity: workload seed")] = 0,
    capacity_duration: Annotated[float, typer.Option(
        help="capacity: arrival window per run, s")] = DURATION_S["chat-agent"],
    sessions: Annotated[Path | None, typer.Option(
        help="sessions: a JSONL agent-session log (default: one generated)")] = None,
    sessions_cluster: Annotated[Path, typer.Option(help="sessions: cluster replayed on")
                                ] = REPO / "configs" / "paper-4gpu.yaml",
    sessions_scales: Annotated[str, typer.Option(help="sessions: SLO scales")
                               ] = ",".join(f"{s:g}" for s in DEFAULT_SLO_SCALES),
    sessions_preset: Annotated[SessionPreset, typer.Option(
        help="sessions, generated log: the preset")] = SessionPreset.CHAT_AGENT,
    sessions_rate: Annotated[float, typer.Option(
        help="sessions, generated log: sessions/s")] = 0.4,
    sessions_seconds: Annotated[float, typer.Option(
        help="sessions, generated log: arrival window, s")] = 60.0,
    sessions_seed: Annotated[int, typer.Option(help="sessions, generated log: seed")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print only JSON: a list of the "
                                          "parts' figures, or the comparison")] = False,
    reference: Annotated[str | None, typer.Option(
        help="a git ref or another checkout's directory: every part there and here, "
        "with current / reference")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="--reference: runs of each part on "
                                         "each side")] = 1,
    out: Annotated[Path | None, typer.Option(
        help="--reference: each run's JSON (reference-PARTn.json, current-PARTn.json) and "
        "summary.json")] = None,
) -> int:
    """Print simulator wall and CPU times, part by part."""
    try:
        chosen = [p for p in parse_parts(parts)
                  if not (p == "trace" and skip_trace or p == "scale" and skip_scale)]
        policies = parse_policies(capacity_policies)
        rates = parse_rates(capacity_rates)
        scales = parse_scales(sessions_scales)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    say: Callable[[str], None] = (lambda line: None) if as_json else print
    if "trace" in chosen and not trace.is_file():
        say(f"skipping the trace replay: {trace} not found")
        chosen.remove("trace")

    def write(path: Path) -> str:
        return write_session_log(path, sessions_preset, sessions_rate, sessions_seconds,
                                 sessions_seed, sessions_cluster)

    logs = session_log(sessions, write, say) if "sessions" in chosen else nullcontext()
    with logs as log:
        if reference is not None:
            return beside_reference(ctx, reference, chosen, repeats, log, out, as_json)
        results = []
        for part in chosen:
            if part == "trace":
                result = trace_replay(trace, cluster, rate, rescore)
            elif part == "scale":
                result = scale_run(scale_cluster, scale_rps, scale_seconds, scale_policy)
            elif part == "capacity":
                result = capacity_runs(policies, rates, capacity_scale, capacity_seed,
                                       capacity_duration)
            else:
                result = sessions_replay(log, sessions_cluster, scales)
            for line in result.lines:
                say(line)
            results.append(result)
    if as_json:
        print(json.dumps([r.as_json() for r in results]))
    return 0


# ---- beside a reference ------------------------------------------------------------------


def part_command(options: Sequence[str], key: tuple[str, int]) -> list[str]:
    """One part in a checkout: this file, that checkout's packages, printing JSON."""
    return [sys.executable, str(Path(__file__).resolve()), *options, "--parts", key[0],
            "--json"]


# run first in each checkout, unreported (`reference.run_pairs`): every policy, briefly
PRIME = ["--sessions-seconds", "5", "--sessions-scales", "2"]


def run_name(key: tuple[str, int]) -> str:
    return f"{key[0]}{key[1]}"


def count_differences(reference: Mapping[str, int], current: Mapping[str, int]) -> list[str]:
    """Each count that differs between the sides, as 'name: reference -> current'."""
    return [f"{name}: {reference.get(name, '-')} -> {current.get(name, '-')}"
            for name in dict.fromkeys([*reference, *current])
            if reference.get(name) != current.get(name)]


def comparison_report(reference: Checkout, current: Checkout, options: Sequence[str],
                      runs: Sequence[PairedRun]) -> dict[str, Any]:
    """Per part: each run's figures on both sides, their ratio and the counts' equality,
    and the summary over the part's runs."""
    from app.experiments.reference import ratios, summarize

    report: dict[str, Any] = {"reference": reference.as_dict(), "current": current.as_dict(),
                              "options": list(options), "parts": {}}
    for part in dict.fromkeys(run.key[0] for run in runs):
        mine = [run for run in runs if run.key[0] == part]
        pairs = [(_figures(run.reference), _figures(run.current)) for run in mine]
        rows = [{"repeat": run.key[1], "order": list(run.order),
                 "reference": run.reference[0], "current": run.current[0],
                 "ratio": ratios(*figures),
                 "count_differences": count_differences(run.reference[0]["counts"],
                                                        run.current[0]["counts"])}
                for run, figures in zip(mine, pairs, strict=True)]
        report["parts"][part] = {"runs": rows, "summary": summarize(pairs),
                                 "same_counts": not any(r["count_differences"] for r in rows)}
    return report


def _figures(result: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    (part,) = result
    return {"wall_s": part["wall_s"], "cpu_s": part["cpu_s"]}


def report_lines(report: Mapping[str, Any]) -> list[str]:
    from app.experiments.reference import run_table, summary_table

    ref, cur = report["reference"], report["current"]
    lines = [f"reference {ref['version']} at {ref['root']}; current {cur['version']} at "
             f"{cur['root']}"]
    for part, found in report["parts"].items():
        for run in found["runs"]:
            differences = run["count_differences"]
            counts = len(run["current"]["counts"])
            lines += ["", f"{part} run {run['repeat']} ({run['order'][0]} first):",
                      *run_table(_figures([run["reference"]]), _figures([run["current"]])),
                      f"  counts: the same ({counts})" if not differences else
                      f"  counts: {len(differences)} differ: " + "; ".join(differences)]
        if len(found["runs"]) > 1:
            lines += [f"{part} over {len(found['runs'])} runs:",
                      *summary_table(found["summary"])]
    return lines


def beside_reference(ctx: typer.Context, ref: str, parts: Sequence[str], repeats: int,
                     log: Path | None, out: Path | None, as_json: bool) -> int:
    """Each part `repeats` times in the reference checkout and in this one (module
    docstring)."""
    # imported here: reference checkouts run this file too, and may predate the module
    from app.experiments.reference import (
        current_checkout,
        forwarded_options,
        reference_checkout,
        run_pairs,
        to_stderr,
        write_runs,
    )

    progress = None if as_json else to_stderr
    options = forwarded_options(ctx, NOT_FORWARDED, {"sessions": log})
    keys = [(part, repeat) for part in parts for repeat in range(repeats)]
    try:
        with reference_checkout(ref, log=progress) as reference:
            current = current_checkout()
            runs = run_pairs(reference, current, keys,
                             lambda key: part_command(options, key), run_name, progress,
                             prime=part_command(PRIME, ("sessions", 0)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = comparison_report(reference, current, options, runs)
    if out is not None:
        write_runs(out, runs, run_name, report)
    print(json.dumps(report) if as_json else "\n".join(report_lines(report)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(main_command, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
