"""The autoscaling experiment live: the SARA controller actor resizes pools of simulated
engines on a local Ray cluster while the shaped workload is sent over HTTP, and the
simulator runs the same controller on the same workload, so the two sets of decisions
can be laid side by side.

The live pools start where the simulator's do (SARA's sizing for the first second's
rate); the controller section of the experiment config is the serve config's. Cost
and GPU hours come from the controller's ledger (each engine from its launch to its
stop, start-up included, as in the simulator).
"""

from __future__ import annotations

import asyncio
import csv
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.control.fleet import template_for
from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup
from app.experiments.autoscale import (
    AutoscaleConfig,
    StrategyRun,
    outcome_summary,
    run_strategy,
    session_summary,
    sessions_of,
    sized_pools,
    steps_per_arrival,
)
from app.experiments.live_replay import drive, stop_time_s
from app.planning.inventory import PoolTargets
from app.serving.config import RoutingConfig, ServeConfig
from app.sim.records import RequestRecord
from app.workloads.workload import RateProfile, Workload

LIVE_APP = "goodserve-autoscale"
LIVE_CLUSTER = "autoscale-live"
SAMPLE_S = 1.0  # resolution of the engines-held timeline


@dataclass(frozen=True)
class LiveRun:
    """What the client measured and what the controller did."""

    records: list[RequestRecord]
    status: dict[str, Any]  # the controller's status at the end: steps and ledger
    counters: dict[str, Any]  # the router's counters
    start_s: float  # wall time of the workload's t = 0
    duration_s: float
    prices: dict[str, float]  # engine kind name -> USD per hour
    gpus: dict[str, int]  # engine kind name -> GPUs per engine
    session_of: Mapping[str, str] = field(default_factory=dict)  # request id -> session id

    @property
    def held_until_s(self) -> float:
        """Where engine time stops counting: the arrival window's end; session content
        runs until its last step has finished, and its cost counts that tail, as the
        simulator's does."""
        finished = [r.finish_s for r in self.records if r.finish_s is not None]
        if not self.session_of or not finished:
            return self.duration_s
        return max(self.duration_s, max(finished))

    def held_intervals(self) -> list[tuple[str, float, float]]:
        """(kind, from, until) per engine, relative to the workload's start."""
        end = self.held_until_s
        return [(e["kind"], e["from_s"] - self.start_s,
                 end if e["until_s"] is None else min(e["until_s"] - self.start_s, end))
                for e in self.status["ledger"].values()]

    def summary(self) -> dict[str, Any]:
        held = [(kind, max(a, 0.0), b) for kind, a, b in self.held_intervals()]
        seconds = [(kind, max(b - a, 0.0)) for kind, a, b in held]
        gpu_hours = sum(s * self.gpus.get(kind, 1) for kind, s in seconds) / 3600.0
        cost = sum(s / 3600.0 * self.prices.get(kind, 0.0) for kind, s in seconds)
        started = sum(1 for step in self.status["steps"] for _ in step["start"])
        summary = outcome_summary(self.records, self.duration_s, gpu_hours, cost,
                                  int(self.counters.get("num_drain_migrations", 0)), started)
        if self.session_of:
            summary |= session_summary(self.records, self.session_of)
        return summary


def serve_config_for(config: AutoscaleConfig, initial: PoolTargets, seed: int) -> ServeConfig:
    """Simulated engines in the initial pools, under the experiment's controller."""
    groups = [
        InstanceGroup(count=n, engine=template_for(
            EngineConfig(gpu_type=kind.gpu, model=config.model), role, kind))
        for role, kinds in initial.engines.items() for kind, n in kinds.items()
    ]
    cluster = ClusterConfig(name=LIVE_CLUSTER, mode=config.mode,
                            kv_link_gbps=config.kv_link_gbps, groups=groups)
    return ServeConfig(cluster=cluster, controller=config.controller,
                       routing=RoutingConfig(seed=seed))


def run_live(config: AutoscaleConfig, profile: RateProfile, workload: Workload,
             seed: int) -> LiveRun:
    """Serve on local Ray with the controller, replay the workload, tear everything down."""
    import ray
    from ray import serve

    from deployments.cluster import init_local_ray
    from deployments.controller import controller_for, stop_controller
    from deployments.router import build_app, free_port

    settings = config.controller.settings(config.model, config.roles)
    # the profile's rates are sessions/s for session content
    initial = sized_pools(settings, workload,
                          float(profile.rate_at(0.0)) * steps_per_arrival(workload))
    serve_config = serve_config_for(config, initial, seed)
    init_local_ray(serve_config.cluster, inventory=config.controller.inventory)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(serve_config), name=LIVE_APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        controller = controller_for(serve_config, LIVE_APP)
        start_s = time.time()
        vocab = serve_config.engine_template.instance.model.vocab_size
        records = asyncio.run(drive(url, workload, serve_config.served_model_names[0], vocab,
                                    stop_s=stop_time_s(workload, config.max_drain_s)))
        status = ray.get(controller.status.remote())
        counters = httpx.get(url + "/v1/instances", timeout=60).json()["counters"]
    finally:
        serve.delete(LIVE_APP)
        stop_controller(LIVE_CLUSTER)
        serve.shutdown()
        ray.shutdown()
    prices = {s.kind.name: s.price_per_hour for s in settings.stock}
    gpus = {s.kind.name: s.kind.tp for s in settings.stock}
    return LiveRun(records, status, counters, start_s, workload.duration_s, prices, gpus,
                   sessions_of(workload))


def run_both(config: AutoscaleConfig, profile: RateProfile, workload: Workload,
             seed: int) -> tuple[LiveRun, StrategyRun]:
    from app.routing.registry import RoutingOptions

    live = run_live(config, profile, workload, seed)
    sim = run_strategy("sara", config, profile, workload, RoutingOptions(seed=seed))
    return live, sim


def live_decisions(live: LiveRun) -> list[dict[str, Any]]:
    """The live controller's steps, timed from the workload's start."""
    return [{**step, "time_s": step["time_s"] - live.start_s} for step in live.status["steps"]]


def sim_decisions(sim: StrategyRun) -> list[dict[str, Any]]:
    """The simulated controller's steps (virtual time starts with the workload)."""
    return [step.summary() for step in sim.steps]


def held_timeline(live: LiveRun, sim: StrategyRun) -> list[tuple[float, int, int]]:
    """(time, engines held live, engines held in the simulator) every SAMPLE_S."""
    assert sim.result.elastic is not None
    samples = sim.result.elastic.samples
    intervals = live.held_intervals()
    rows = []
    t = 0.0
    while t <= live.held_until_s:
        held_live = sum(a <= t < b for _, a, b in intervals)
        before = [s for s in samples if s.time_s <= t] or samples[:1]  # the initial pools
        held_sim = (sum(before[-1].serving.values()) + sum(before[-1].starting.values())
                    if before else 0)
        rows.append((t, held_live, held_sim))
        t += SAMPLE_S
    return rows


def write_live_outputs(out: Path, live: LiveRun, sim: StrategyRun, setup: dict) -> dict:
    import json

    out.mkdir(parents=True, exist_ok=True)
    summary = {"sara": live.summary(), "sara-sim": sim.summary()}
    (out / "summary.json").write_text(json.dumps({"setup": setup, "strategies": summary},
                                                 indent=2) + "\n")
    with (out / "decisions.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["backend", "time_s", "rate_rps", "forecast_rps", "targets", "start",
                         "drain", "stop"])
        for backend, steps in (("live", live_decisions(live)), ("sim", sim_decisions(sim))):
            for step in steps:
                writer.writerow([backend, round(step["time_s"], 1), step["rate_rps"],
                                 step["forecast_rps"], json.dumps(step["targets"]),
                                 len(step["start"]), len(step["drain"]), len(step["stop"])])
    timeline = held_timeline(live, sim)
    with (out / "held.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["time_s", "live_engines", "sim_engines"])
        writer.writerows(timeline)
    plot_live(out / "autoscale-live.png", live, sim, timeline)
    return summary


def plot_live(path: Path, live: LiveRun, sim: StrategyRun,
              timeline: Sequence[tuple[float, int, int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, targets) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    held.step([r[0] for r in timeline], [r[1] for r in timeline], where="post", label="live")
    held.step([r[0] for r in timeline], [r[2] for r in timeline], where="post",
              label="simulator", linestyle="--")
    held.set_ylabel("engines held")
    held.legend()
    for label, steps, style in (("live", live_decisions(live), "-"),
                                ("simulator", sim_decisions(sim), "--")):
        targets.step([s["time_s"] for s in steps],
                     [sum(sum(k.values()) for k in s["targets"].values()) for s in steps],
                     where="post", label=label, linestyle=style)
    targets.set_ylabel("target engines (SARA)")
    targets.set_xlabel("time, s")
    targets.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
