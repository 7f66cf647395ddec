"""Simulator speed: the full Mooncake replay on the paper testbed, and 512 instances.

    PYTHONPATH=. python benchmarks/sim_speed.py [--rate 0.75] [--scale-seconds 3]

Part 1 replays the whole Mooncake conversation trace on configs/paper-4gpu.yaml
with the four baselines x five SLO scales (the native 3.4 req/s of 12k-token
prompts is far beyond four GPUs, so the trace is stretched to --rate).
Part 2 drives configs/sim-512.yaml with Poisson arrivals at --scale-rps for
--scale-seconds of virtual time (stopping at the last arrival, so the figure is
steady-state work, not a drain tail) and reports simulated requests per second.
Both print wall and CPU seconds: on a shared machine the CPU figure is steadier.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, num_simulations, run_replay
from app.routing.registry import POLICY_REGISTRY, make_policy
from app.sim.simulator import Simulator
from app.workloads.slo import DEFAULT_SLO_SCALES
from app.workloads.workload import (
    Content,
    load_prompts,
    load_trace,
    poisson_workload,
    trace_workload,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"


def trace_replay(trace: Path, cluster: Path, rate: float, rescore: bool) -> None:
    spec = ReplaySpec(
        cluster=load_cluster_config(cluster),
        policies=tuple(POLICY_REGISTRY.kinds()),
        slo_scales=DEFAULT_SLO_SCALES,
        rescore=rescore,
    )
    workload = trace_workload(load_trace(trace), rate=rate, name=trace.name)
    wall, cpu = time.perf_counter(), time.process_time()
    outcomes = run_replay(spec, workload)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{trace.name}: {len(workload)} requests at {rate} req/s "
          f"(window {workload.duration_s:.0f} s) on {spec.cluster.name}")
    print(f"{'policy':<14} {'sim wall s':>10}  "
          + " ".join(f"{f'met@{s:g}':>7}" for s in spec.slo_scales) + "  (fraction met)")
    for kind in spec.policies:
        cells = [o for o in outcomes if o.policy == kind.value]
        sim_wall = sum(o.summary["wall_s"] for o in cells)
        met = " ".join(f"{o.summary['met'] / o.summary['requests']:7.3f}" for o in cells)
        print(f"{kind.value:<14} {sim_wall:10.1f}  {met}")
    print(f"total: {wall:.1f} s wall, {cpu:.1f} s CPU for {len(spec.policies)} policies x "
          f"{len(spec.slo_scales)} SLO scales ({num_simulations(spec)} simulations)")


def scale_run(cluster: Path, rps: float, seconds: float, policy: str) -> None:
    prompts = DATA / "prompts" / "prompt_lengths.jsonl"
    if prompts.is_file():
        pool, source = [p.content() for p in load_prompts(prompts)], prompts.name
    else:
        pool, source = [Content(256, 200)], "synthetic 256 in / 200 out"
    config = load_cluster_config(cluster)
    workload = poisson_workload(rps, seconds, pool, seed=0)
    sim = Simulator.from_config(config, make_policy(policy, seed=0), max_drain_s=0.0)
    cpu = time.process_time()
    result = sim.run(workload)
    cpu = time.process_time() - cpu
    print(f"{config.name}: {len(config.engines())} instances, Poisson {rps:.0f} req/s for "
          f"{seconds} simulated s ({len(workload)} arrivals, content: {source}, {policy})")
    print(f"  {result.wall_s:.1f} s wall ({cpu:.1f} s CPU): "
          f"{len(workload) / result.wall_s:.0f} simulated requests/s wall "
          f"({len(workload) / cpu:.0f}/s CPU), {result.num_events / result.wall_s:.0f} events/s, "
          f"{result.num_token_events / result.wall_s:.0f} tokens/s, "
          f"{seconds / result.wall_s:.3f} x real time, peak memory "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


def main(
    rate: Annotated[float, typer.Option(help="Mooncake replay rate, req/s")] = 0.75,
    trace: Annotated[Path, typer.Option()] = DATA / "traces" / "mooncake_conversation_trace.jsonl",
    cluster: Annotated[Path, typer.Option()] = REPO / "configs" / "paper-4gpu.yaml",
    rescore: Annotated[bool, typer.Option(help="one run per SLO-unaware policy")] = True,
    scale_cluster: Annotated[Path, typer.Option()] = REPO / "configs" / "sim-512.yaml",
    scale_rps: Annotated[float, typer.Option()] = 10_000.0,
    scale_seconds: Annotated[float, typer.Option()] = 3.0,
    scale_policy: Annotated[str, typer.Option()] = "p2c",
    skip_trace: Annotated[bool, typer.Option()] = False,
    skip_scale: Annotated[bool, typer.Option()] = False,
) -> None:
    """Print simulator wall times for the Mooncake replay and the 512-instance run."""
    if not skip_trace:
        if trace.is_file():
            trace_replay(trace, cluster, rate, rescore)
        else:
            print(f"skipping the trace replay: {trace} not found")
    if not skip_scale:
        scale_run(scale_cluster, scale_rps, scale_seconds, scale_policy)


if __name__ == "__main__":
    typer.run(main)
