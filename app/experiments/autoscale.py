"""Autoscaling in the simulator: the SARA controller against the autoscalers users run.

A trace's arrivals are time-warped into a time-varying load (`phases`: low, peak,
low; `ramp`: low rising to peak; `diurnal`: one smooth day; `bursty`: flat at the
phases' mean with Gamma-clustered arrivals), request content from a prompt file or the
trace; or agent sessions (`coding-agent`, `chat-agent`, `research-agent` presets, or a
session log) whose *starts* are warped so, at rates in sessions/s, their steps
closed-loop after the start.
SLO = the controller's `slo_scale` x solo time on its reference GPU. Every strategy
serves the same workload on elastic pools of simulated engines (start-up delay,
draining by token ids) routed by GoodServe:
- static-peak / static-mean: SARA's inventory sizing at the peak / mean rate, fixed;
- queue-length: Ray Serve's default rule (2 ongoing requests per replica, 30 s up /
  600 s down delays);
- throughput-planner: Dynamo's planner in throughput mode (every 180 s);
- saturation: llm-d's variant autoscaler (KV 0.8 / queue 5, spare 0.1 / 3);
- sara: the controller (`app/control`).
The dynamic strategies start from the pools SARA sizes for the first second's rate.

Writes under --out: summary.json (the printed object), timeline.csv (pool sizes per
control step), goodput.csv (met per 30 s bin) and autoscale.png.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from app.control.config import ControllerConfig
from app.control.controller import Controller, ControllerSettings, ControlStep
from app.control.plan import ScalingRules
from app.control.strategies import (
    QueueLengthScaler,
    SaturationScaler,
    StaticScaler,
    ThroughputScaler,
)
from app.engines.config import Frozen
from app.hardware.specs import get_model
from app.planning.inventory import DECODE, PREFILL, UNIFIED, PoolTargets
from app.planning.pools import Observation
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.sim.elastic import ElasticPools, Scaler, engine_setup
from app.sim.instance import InstanceSetup
from app.sim.records import RequestOutcome, RequestRecord
from app.sim.simulator import SimResult, Simulator
from app.workloads.sessions import SessionTimeline, shaped_file_workload, shaped_preset_workload
from app.workloads.slo import assign_slos, reference_instance, solo_latencies_s
from app.workloads.workload import (
    DEFAULT_BURST_CV,
    Content,
    ContentMode,
    LoadShape,
    RateProfile,
    Workload,
    load_prompts,
    load_trace,
    shaped_trace_workload,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "autoscale-sim.yaml"
STRATEGIES = ("static-peak", "static-mean", "queue-length", "throughput-planner",
              "saturation", "sara")
GOODPUT_BIN_S = 30.0
MAX_HOLDER_ROUNDS = 16  # static sizing: rounds spreading parked context over more engines
MANY_ENGINES = 1 << 30  # parked context spread so thin it takes no slot
CALIBRATION_SEED_OFFSET = 1000  # calibration draws its content apart from the experiment's


class LoadConfig(Frozen):
    """Arrival rates per second: requests for trace and prompt content, session starts
    for agent sessions."""

    low_rps: float = Field(gt=0, description="rate of the low phases / start of the ramp "
                           "(requests/s; sessions/s for session content)")
    peak_rps: float = Field(gt=0, description="rate of the peak phase / end of the ramp "
                            "(requests/s; sessions/s for session content)")
    duration_s: float = Field(gt=0, description="arrival window, s")
    burstiness: float = Field(DEFAULT_BURST_CV, ge=1, description="bursty shape: coefficient "
                              "of variation of the gaps between arrivals")


class AutoscaleConfig(Frozen):
    """The experiment: model, pool mode, load and the controller section."""

    model: str = Field("llama-3.1-8b", description="catalog model")
    mode: str = Field("disaggregated", description="unified or disaggregated pools")
    kv_link_gbps: float = Field(25.0, gt=0, description="P->D link, GB/s")
    load: LoadConfig
    content_load: dict[ContentMode, LoadConfig] = Field(
        default_factory=dict, description="the load for one content kind, in place of "
        "`load` (coding-agent, chat-agent, research-agent, sessions: rates in sessions/s)")
    controller: ControllerConfig
    max_drain_s: float | None = Field(
        None, ge=0, description="stop this long after the last arrival, simulated and live "
        "alike (unfinished requests count as violated, steps not yet issued as rejected); "
        "default: when every issued request has ended")

    @model_validator(mode="after")
    def _mode(self) -> AutoscaleConfig:
        if self.mode not in ("unified", "disaggregated"):
            raise ValueError(f"mode must be unified or disaggregated, got {self.mode!r}")
        for name, load in (("load", self.load), *self.content_load.items()):
            if load.low_rps > load.peak_rps:
                raise ValueError(f"{name}: low_rps must be <= peak_rps")
        return self

    def load_for(self, content: ContentMode) -> LoadConfig:
        """The load of a content kind: its own entry, else `load`."""
        return self.content_load.get(content, self.load)

    @property
    def roles(self) -> tuple[str, ...]:
        return (UNIFIED,) if self.mode == "unified" else (PREFILL, DECODE)


def load_autoscale_config(path: Path) -> AutoscaleConfig:
    from app.engines.config import load_yaml_model

    return load_yaml_model(path, AutoscaleConfig)


def observed(workload: Workload) -> Observation:
    """The workload's rate and length moments, as a controller would measure them (a CV
    below 0.05 counts as 0.05: the length models need some spread). Agent steps extend a
    context their session's engine caches: their uncached length is the appended tokens."""
    inputs = [r.num_prompt_tokens for r in workload.requests]
    outputs = [r.num_output_tokens for r in workload.requests]
    uncached = None
    if any(r.num_appended_tokens is not None for r in workload.requests):
        uncached = moments([r.num_prompt_tokens if r.num_appended_tokens is None
                            else max(1, r.num_appended_tokens) for r in workload.requests])
    mean_in, cv_in = moments(inputs)
    rate = len(workload) / workload.duration_s
    held = None if workload.graph is None else rate * held_token_seconds(workload)
    return Observation(
        rate_rps=rate, mean_input_len=mean_in,
        cv_input_len=cv_in, mean_output_len=statistics.fmean(outputs),
        mean_uncached_len=None if uncached is None else uncached[0],
        cv_uncached_len=None if uncached is None else uncached[1],
        held_kv_tokens=held,
    )


def held_token_seconds(workload: Workload) -> float:
    """Context token-seconds that sessions hold in tool waits, per step (Little's law:
    times the step rate, the context held on average). A step waits after its last
    parent ends, its tool wait or until its own arrival, with its first parent's context
    (prompt + output) held (`SessionTimeline` with every step instant, as no engine is
    known here: an upper bound where the arrival sets the wait)."""
    graph = workload.graph
    assert graph is not None
    requests = workload.requests
    waits = SessionTimeline.of(workload, [0.0] * len(requests)).wait_s.tolist()
    held = [wait * (requests[p[0]].num_prompt_tokens + requests[p[0]].num_output_tokens)
            for p, wait in zip(graph.parents, waits, strict=True) if p]
    return sum(held) / len(requests)


def num_sessions(workload: Workload) -> int:
    """Agent sessions in a closed-loop workload (0 for open-loop traffic)."""
    return len({r.session_id for r in workload.requests if r.session_id is not None})


def steps_per_arrival(workload: Workload) -> float:
    """Requests per arrival of the load profile: steps per session for session content."""
    return 1.0 if workload.graph is None else len(workload) / num_sessions(workload)


def moments(lengths: Sequence[int]) -> tuple[float, float]:
    """(mean, CV) of lengths, the CV at least 0.05."""
    mean = statistics.fmean(lengths)
    return mean, max(statistics.pstdev(lengths) / mean, 0.05)


def outcome_summary(records: Sequence[RequestRecord], duration_s: float, gpu_hours: float,
                    cost_usd: float, drain_migrations: int,
                    engines_started: int) -> dict[str, Any]:
    """One strategy's row: goodput, attainment, GPU time, cost and moves."""
    met = sum(r.outcome is RequestOutcome.MET for r in records)
    return {
        "goodput_rps": round(met / duration_s, 3),
        "slo_attainment": round(met / len(records), 4),
        "gpu_hours": round(gpu_hours, 3),
        "cost_usd": round(cost_usd, 3),
        "met_per_dollar": round(met / cost_usd, 1) if cost_usd else None,
        "lost": sum(r.finish_s is None and r.outcome is not RequestOutcome.REJECTED
                    for r in records),
        "rejected": sum(r.outcome is RequestOutcome.REJECTED for r in records),
        "migrations": sum(r.num_migrations for r in records),
        "drain_migrations": drain_migrations,
        "engines_started": engines_started,
    }


def session_summary(records: Sequence[RequestRecord], session_of: Mapping[str, str],
                    contexts_moved: int | None = None,
                    contexts_recomputed: int | None = None) -> dict[str, Any]:
    """Agent sessions: how many, how many broken (a step of theirs never finished:
    rejected, cancelled or lost), and what scale-down did to the contexts they held
    (left out where nobody counted it: live, the engines report no context moves)."""
    broken = {session_of[r.request_id] for r in records if r.finish_s is None}
    summary = {"sessions": len(set(session_of.values())), "steps_served":
               sum(r.finish_s is not None for r in records), "sessions_broken": len(broken)}
    if contexts_moved is not None and contexts_recomputed is not None:
        summary |= {"contexts_moved": contexts_moved, "contexts_recomputed": contexts_recomputed}
    return summary


@dataclass(frozen=True)
class StrategyRun:
    name: str
    result: SimResult
    duration_s: float
    steps: tuple[ControlStep, ...] = ()
    session_of: Mapping[str, str] = field(default_factory=dict)  # request id -> session id

    def per_bin(self) -> tuple[list[int], list[int]]:
        """Arrivals and met requests per GOODPUT_BIN_S bin of arrival time."""
        bins = math.ceil(self.duration_s / GOODPUT_BIN_S)
        arrivals, met = [0] * bins, [0] * bins
        for r in self.result.records:
            i = min(int(r.arrival_s // GOODPUT_BIN_S), bins - 1)
            arrivals[i] += 1
            met[i] += r.outcome is RequestOutcome.MET
        return arrivals, met

    def summary(self) -> dict[str, Any]:
        stats = self.result.elastic
        assert stats is not None
        summary = outcome_summary(self.result.records, self.duration_s, float(stats.gpu_hours),
                                  float(stats.cost_usd), stats.num_drain_migrations,
                                  stats.num_started)
        if self.session_of:
            summary |= session_summary(self.result.records, self.session_of,
                                       stats.num_contexts_moved, stats.num_contexts_recomputed)
        return summary


def contents_of(workload: Workload) -> list[Content]:
    """The workload's request contents, as a pool to draw other workloads from."""
    return [Content(r.num_prompt_tokens, r.num_output_tokens, r.block_hashes,
                    r.hash_block_size, r.prompt, r.task) for r in workload.requests]


def load_profile(config: AutoscaleConfig, shape: LoadShape,
                 content: ContentMode = ContentMode.TRACE,
                 duration_s: float | None = None) -> RateProfile:
    """The content's load in `shape`, over `duration_s` (default: the config's window)."""
    load = config.load_for(content)
    return RateProfile(shape, load.low_rps, load.peak_rps, duration_s or load.duration_s,
                       load.burstiness)


def build_workload(config: AutoscaleConfig, profile: RateProfile, trace: Path | None,
                   prompts: Path | None, seed: int, content: ContentMode | None = None,
                   sessions: Path | None = None) -> Workload:
    """The shaped workload with its SLOs. Content by `content` (default: prompts with
    `prompts`, else the trace's own lengths): trace and prompt content ride on the
    trace's warped arrivals; agent sessions (presets for the model's context limit, or a
    session log) start at the profile's warped arrivals (`app.workloads.sessions`)."""
    content = content or (ContentMode.PROMPTS if prompts is not None else ContentMode.TRACE)
    if content.is_preset:
        workload = shaped_preset_workload(content.value, profile,
                                          get_model(config.model).max_context_tokens, seed)
    elif content is ContentMode.SESSIONS:
        if sessions is None:
            raise ValueError("--content sessions needs --sessions (a JSONL session log)")
        workload = shaped_file_workload(sessions, profile, seed)
    else:
        if trace is None:
            raise ValueError(f"--content {content.value} needs --trace")
        if content is ContentMode.PROMPTS and prompts is None:
            raise ValueError("--content prompts needs --prompts")
        rows = load_prompts(prompts) if content is ContentMode.PROMPTS and prompts else None
        workload = shaped_trace_workload(load_trace(trace), profile, prompts=rows, seed=seed,
                                         name=f"{trace.stem}-{profile.shape.value}")
    reference = reference_instance(config.model, config.controller.reference_gpu)
    return assign_slos(workload, solo_latencies_s(workload.requests, reference),
                       config.controller.slo_scale)


def sized_pools(settings: ControllerSettings, workload: Workload,
                rate: float) -> PoolTargets:
    """SARA's inventory sizing for `rate` requests/s x (1 + headroom), on the workload's
    moments. Where the sizing counts the context sessions park on the engines, a fixed
    fleet has no running engines to spread it over: it takes the fewest engines that
    carry the rate with the context spread over them, by raising the pool's floor from
    what the rate alone needs until they do."""
    observation = observed(workload)
    target = rate * (1 + settings.headroom)
    targets = settings.sizer(observation, MANY_ENGINES).size(target, settings.roles,
                                                             settings.limits)
    if not (settings.parks_context and observation.held_kv_tokens):
        return targets
    holders = targets.total(UNIFIED)
    for _ in range(MAX_HOLDER_ROUNDS):
        floors = {**settings.limits.min_engines, UNIFIED: holders}
        limits = replace(settings.limits, min_engines=floors)
        targets = settings.sizer(observation, holders).size(target, settings.roles, limits)
        if targets.meets_slo:
            break
        holders += 1
    return targets


def setups_for(model: str, targets: PoolTargets) -> list[InstanceSetup]:
    return [engine_setup(model, role, kind)
            for role, kinds in targets.engines.items() for kind, n in kinds.items()
            for _ in range(n)]


def make_scaler(name: str, config: AutoscaleConfig, settings: ControllerSettings,
                fixed: PoolTargets | None, start_s: float) -> Scaler:
    c = config.controller
    common = dict(model=config.model, roles=config.roles, stock=settings.stock,
                  limits=settings.limits)
    if name in ("static-peak", "static-mean"):
        assert fixed is not None
        return StaticScaler(c.interval_s, c.rules, start_s, fixed=fixed)
    if name == "queue-length":
        return QueueLengthScaler(c.interval_s, ScalingRules(600.0, 0.0, c.drain_deadline_s,
                                                            scale_up_after_s=30.0),
                                 start_s, **common)
    if name == "throughput-planner":
        tpot = settings.slo.fixed.tpot_s if settings.slo.fixed else None
        return ThroughputScaler(180.0, ScalingRules(0.0, 0.0, c.drain_deadline_s), start_s,
                                tpot_s=tpot or _reference_tpot(config), **common)
    if name == "saturation":
        return SaturationScaler(c.interval_s, ScalingRules(0.0, 0.0, c.drain_deadline_s),
                                start_s, **common)
    if name == "sara":
        return Controller(settings, start_s)
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")


def _reference_tpot(config: AutoscaleConfig) -> float:
    """The decode-step target the SLO scale implies at a 1k context (Dynamo's ITL SLO)."""
    reference = reference_instance(config.model, config.controller.reference_gpu)
    return config.controller.slo_scale * reference.decode_time_per_token_s(1024)


def run_strategy(name: str, config: AutoscaleConfig, profile: RateProfile, workload: Workload,
                 routing: RoutingOptions) -> StrategyRun:
    start_s = workload.requests[0].arrival_s
    settings = config.controller.settings(config.model, config.roles)
    per_arrival = steps_per_arrival(workload)  # the profile's rates are sessions/s for sessions
    fixed = None
    if name == "static-peak":
        fixed = sized_pools(settings, workload, profile.peak_rps * per_arrival)
    elif name == "static-mean":
        fixed = sized_pools(settings, workload, profile.mean_rps * per_arrival)
    initial = fixed or sized_pools(settings, workload,
                                   float(profile.rate_at(0.0)) * per_arrival)
    scaler = make_scaler(name, config, settings, fixed, start_s)
    elastic = ElasticPools(scaler, config.model, settings.stock, settings.startup_s)
    stack = build_routing(PolicyKind.GOODSERVE, routing)
    sim = Simulator(setups_for(config.model, initial), stack.policy, watchdog=stack.watchdog,
                    kv_link_gbps=config.kv_link_gbps, max_drain_s=config.max_drain_s,
                    seed=routing.seed, elastic=elastic)
    return StrategyRun(name, sim.run(workload), workload.duration_s, tuple(elastic.steps),
                       sessions_of(workload))


def sessions_of(workload: Workload) -> dict[str, str]:
    """Request id -> session id for session content (empty for any other)."""
    if workload.graph is None:
        return {}
    return {r.request_id: r.session_id for r in workload.requests if r.session_id}


def run_experiment(config: AutoscaleConfig, profile: RateProfile, workload: Workload,
                   strategies: Sequence[str], routing: RoutingOptions,
                   progress: Callable[[str], None] | None = None) -> list[StrategyRun]:
    runs = []
    for name in strategies:
        runs.append(run_strategy(name, config, profile, workload, routing))
        if progress:
            progress(name)
    return runs


def write_outputs(out: Path, runs: Sequence[StrategyRun], setup: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = {run.name: run.summary() for run in runs}
    (out / "summary.json").write_text(json.dumps({"setup": setup, "strategies": summary},
                                                 indent=2) + "\n")
    with (out / "timeline.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["strategy", "time_s", "role", "serving", "starting", "draining"])
        for run in runs:
            assert run.result.elastic is not None
            for sample in run.result.elastic.samples:
                for role in sorted(set(sample.serving) | set(sample.starting)):
                    writer.writerow([run.name, round(sample.time_s, 1), role,
                                     sample.serving.get(role, 0), sample.starting.get(role, 0),
                                     sample.draining])
    with (out / "goodput.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["strategy", "bin_start_s", "arrivals", "met"])
        for run in runs:
            arrivals, met = run.per_bin()
            writer.writerows([run.name, i * GOODPUT_BIN_S, arrivals[i], met[i]]
                             for i in range(len(met)))
    plot(out / "autoscale.png", runs)
    return summary


def plot(path: Path, runs: Sequence[StrategyRun]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (sizes, good) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for run in runs:
        assert run.result.elastic is not None
        samples = run.result.elastic.samples
        sizes.step([s.time_s for s in samples],
                   [sum(s.serving.values()) + sum(s.starting.values()) for s in samples],
                   where="post", label=run.name)
        _, met = run.per_bin()
        good.plot([(i + 0.5) * GOODPUT_BIN_S for i in range(len(met))],
                  [m / GOODPUT_BIN_S for m in met], label=run.name)
    sizes.set_ylabel("engines held (serving + starting)")
    good.set_ylabel("goodput, req/s (by arrival)")
    good.set_xlabel("time, s")
    sizes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
