"""Check the sizing models against the engines: per pool role and engine kind, the
rate one engine sustains with `p_slo` of its requests within their deadlines, measured
in the simulator, against the rates the models give it.

Two models are compared with each measurement:
- **served** (`app/planning/served.py`), evaluated on the measured traffic itself (its
  lengths, the prefix its engine finds cached, each request's deadline) with the whole
  slack given to the stage under test, as the measurement gives it: the factor
  measured / served says whether the model describes the engine;
- **sara**, SARA's stage models at the controller's stage targets (the mean request's):
  its factor is what the controller's `capacity_factors` were.
    python -m app.experiments.calibrate --config configs/autoscale-sim.yaml --prompts P
    python -m app.experiments.calibrate --content coding-agent
The search doubles the rate from a quarter of the served model's until the engine
misses, then bisects, up to MAX_FACTOR times that model's rate or the most its helpers
carry (the factor is then a lower bound).

An engine sustains a rate when it serves it in steady state: over the window's
second half, p_slo of the requests arriving there meet their deadlines, and the stage
under test finishes as many requests as arrive (STABLE_SHARE). A queue that grows
without bound still meets long deadlines over a short window, which once made the
prefill engines look 5-8 times faster than they are. Agent sessions need a longer
warm-up: a session's steps follow each other over its tool waits, so the steps open
sessions send build up over a session's span (chat-agent about 65 s, coding-agent about
180 s, tool waits and solo service). Their window is at least STEADY_SPANS mean spans,
and the steps that arrive after it (the sessions' tails, on an engine whose load is
falling) are not counted: on 60-s windows both once made the decoders look 1.5-1.9
times faster than they are.

One engine of the kind serves the role under test; the other stage is served by
helpers of the strongest kind for it, twice what the model says the rate needs (at
most 16), so that it is not the bottleneck. Poisson arrivals (of requests, or of agent
sessions whose steps follow each other), deadlines as in the experiment (slo_scale x
solo time on the reference GPU).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import typer

from app.experiments.autoscale import (
    DEFAULT_CONFIG,
    AutoscaleConfig,
    load_autoscale_config,
    observed,
)
from app.experiments.replay import cli_error
from app.hardware.specs import get_model
from app.planning.inventory import DECODE, PREFILL, UNIFIED, InventorySizer, capacity_key
from app.planning.params import ModelParams
from app.planning.served import EngineModel, StageBudgets, TrafficSample
from app.planning.split import EngineKind
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.sim.elastic import engine_setup
from app.sim.instance import InstanceSetup
from app.sim.records import RequestOutcome, RequestRecord
from app.sim.simulator import Simulator
from app.workloads.sessions import SessionPreset, SessionTimeline, preset_workload
from app.workloads.slo import assign_slos, reference_instance, solo_latencies_s
from app.workloads.workload import Arrivals, Content, SyntheticArrivals, Workload, poisson_workload

BISECTION_STEPS = 6
MAX_HELPERS = 16
MAX_FACTOR = 8.0  # the search's cap on measured / served model
MAX_REQUESTS = 4000  # per measurement: high rates are measured over a shorter window
MIN_DURATION_S = 10.0
MIN_MEASURED = 200  # requests expected in the measured (second) half, at least
MIN_SAMPLE = 1000  # requests the served model is evaluated on, at least
STABLE_SHARE = 0.95  # second-half finishes over arrivals for a stage that keeps up
STEADY_SPANS = 6.0  # session traffic: the window, in mean session spans (half is warm-up)
PREFILL_SHARE = {PREFILL: 1.0, DECODE: 0.0, UNIFIED: 1.0}  # the measurement's slack split


@dataclass(frozen=True)
class Measured:
    role: str
    kind: EngineKind
    measured_rps: float  # requests (agent steps) per second one engine sustains
    served_rps: float  # the served model on the measured traffic
    sara_rps: float  # SARA's stage model at the controller's targets
    offered: float  # the traffic rate it was measured at (requests or sessions per s)

    @property
    def factor(self) -> float:
        """Measured over the served model."""
        return self.measured_rps / self.served_rps if self.served_rps > 0 else math.inf

    @property
    def sara_factor(self) -> float:
        return self.measured_rps / self.sara_rps if self.sara_rps > 0 else math.inf


@dataclass(frozen=True)
class Traffic:
    """What the engines are measured on: prompts arriving as a Poisson process, or agent
    sessions of a preset arriving so (their steps closed-loop)."""

    pool: Sequence[Content] = ()
    preset: SessionPreset | None = None
    context_limit: int = 0

    def workload(self, rate: float, duration_s: float, seed: int) -> Workload:
        if self.preset is None:
            return poisson_workload(rate, duration_s, self.pool, seed=seed)
        arrivals = SyntheticArrivals(Arrivals.POISSON, rate, duration_s)
        return preset_workload(self.preset, arrivals, self.context_limit, seed)

    @classmethod
    def sessions(cls, preset: SessionPreset, model: str) -> Traffic:
        """Sessions of `preset` for `model`, whose context limit bounds them."""
        return cls(preset=preset, context_limit=get_model(model).max_context_tokens)

    @property
    def label(self) -> str:
        return "prompts" if self.preset is None else self.preset.value


@dataclass(frozen=True)
class Run:
    """One measurement: the share of requests met, and whether the stage kept up."""

    attainment: float
    stable: bool
    requests_per_s: float

    def sustains(self, p_slo: float) -> bool:
        return self.stable and self.attainment >= p_slo


class Calibrator:
    """Measures one engine per (role, kind) of an experiment's inventory."""

    def __init__(self, config: AutoscaleConfig, traffic: Traffic, seed: int,
                 duration_s: float = 60.0) -> None:
        self.config, self.traffic, self.seed, self.duration_s = config, traffic, seed, duration_s
        self.settings = config.controller.settings(config.model, config.roles)
        self.reference = reference_instance(config.model, config.controller.reference_gpu)
        self.scale = config.controller.slo_scale
        self.p_slo = self.settings.slo.p_slo
        sample = self._workload(self._probe_rate())
        lengths = observed(sample).workload
        self.sizer = InventorySizer(ModelParams.named(config.model), lengths,
                                    self.settings.slo.targets_for(lengths), self.settings.stock)
        self.skipped: list[str] = []  # pool kinds `run` could not measure

    def _probe_rate(self) -> float:
        """A rate whose workload shows the traffic's lengths: 10 requests or 0.2 sessions
        per second."""
        return 10.0 if self.traffic.preset is None else 0.2

    def run(self) -> list[Measured]:
        """One row per (role, kind) the model gives a rate and the helpers can serve;
        the others are listed in `skipped`."""
        rows = []
        self.skipped = []
        for role in self.config.roles:
            for stock in self.settings.stock:
                guess = self.served_rate(role, stock.kind, self._probe_rate())
                if guess <= 0 or not self._helpers_suffice(role, 2.0 * guess):
                    self.skipped.append(capacity_key(role, stock.kind))
                    continue
                offered, run = self.sustained(role, stock.kind, guess)
                rows.append(Measured(role, stock.kind, run.requests_per_s,
                                     self.served_rate(role, stock.kind, offered),
                                     self.sizer.rate_of(role, stock.kind, 1), offered))
        return rows

    def served_rate(self, role: str, kind: EngineKind, offered: float) -> float:
        """The served model's rate (requests/s) on the traffic offered at `offered`."""
        workload = self._workload(offered)
        if len(workload) < MIN_SAMPLE:  # a few dozen requests give a noisy attainment
            workload = self._workload(offered, workload.duration_s * MIN_SAMPLE / max(
                len(workload), 1))
        sample = TrafficSample.from_workload(workload, self.reference, self.scale)
        budgets = StageBudgets.split(sample, self.reference, PREFILL_SHARE[role])
        model = EngineModel.for_kind(kind, self.config.model, sample, budgets, self.p_slo)
        return model.rate(role)

    def sustained(self, role: str, kind: EngineKind, served_rps: float) -> tuple[float, Run]:
        """Highest offered rate the engine sustains (`Run.sustains`), and its run: doubling
        from a quarter of the served model's while it does (within MAX_FACTOR of it and
        what the helpers carry), then bisection."""
        offered_per_request = 1.0 / self._requests_per_offered
        start = 0.25 * served_rps * offered_per_request
        lo, hi = 0.0, start
        best = Run(1.0, True, 0.0)
        while (run := self.measure(role, kind, hi)).sustains(self.p_slo):
            lo, best = hi, run
            if 2 * hi > MAX_FACTOR * served_rps * offered_per_request or not \
                    self._helpers_suffice(role, 2 * run.requests_per_s):
                return lo, best
            hi = 2 * hi
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            run = self.measure(role, kind, mid)
            if run.sustains(self.p_slo):
                lo, best = mid, run
            else:
                hi = mid
        return lo, best

    @cached_property
    def _requests_per_offered(self) -> float:
        """Requests (agent steps) per unit of offered rate: 1 for prompts, a session's
        mean step count for sessions."""
        if self.traffic.preset is None:
            return 1.0
        workload = self._session_sample
        return len(workload) / (self._probe_rate() * workload.duration_s)

    @cached_property
    def _session_sample(self) -> Workload:
        """Sessions at the probe rate over MIN_SAMPLE / rate seconds: what the window's
        length is worked out from (steps per session, a session's span)."""
        rate = self._probe_rate()
        return self.traffic.workload(rate, MIN_SAMPLE / rate, self.seed)

    def measure(self, role: str, kind: EngineKind, offered: float) -> Run:
        workload = self._workload(offered)
        setups = [engine_setup(self.config.model, role, kind), *self._helpers(
            role, len(workload) / workload.duration_s)]
        stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(seed=self.seed))
        sim = Simulator(setups, stack.policy, watchdog=stack.watchdog,
                        kv_link_gbps=self.config.kv_link_gbps, seed=self.seed)
        records = sim.run(workload).records
        return Run(steady_attainment(records, workload.duration_s),
                   keeps_up(records, role, workload.duration_s),
                   late_rate(records, workload.duration_s))

    def _workload(self, offered: float, duration_s: float | None = None) -> Workload:
        duration = self.duration_s if duration_s is None else duration_s
        if self.traffic.preset is None and duration_s is None:
            duration = max(min(self.duration_s, MAX_REQUESTS / offered), MIN_DURATION_S)
        elif self.traffic.preset is not None:  # sessions: long enough to settle
            duration = max(duration, STEADY_SPANS * self._session_span_s)
        # enough requests in the measured half that p_slo is told from noise (a slow
        # engine on long steps once was judged on eight)
        duration = max(duration, 2 * MIN_MEASURED / (offered * self._requests_per_offered))
        workload = self.traffic.workload(offered, duration, self.seed)
        return assign_slos(workload, solo_latencies_s(workload.requests, self.reference),
                           self.scale)

    @cached_property
    def _session_span_s(self) -> float:
        """Mean time from a session's first step to its last one's end, its steps served
        alone on the reference GPU (0 for prompts)."""
        if self.traffic.preset is None:
            return 0.0
        workload = self._session_sample
        return mean_session_span_s(workload, solo_latencies_s(workload.requests,
                                                              self.reference))

    def _helper_kind(self, role: str) -> tuple[str, EngineKind]:
        other = DECODE if role == PREFILL else PREFILL
        kinds = [s.kind for s in self.settings.stock]
        return other, max(kinds, key=lambda k: self.sizer.rate_of(other, k, 1))

    def _helpers_suffice(self, role: str, rate: float) -> bool:
        """The most helpers carry `rate` by the model: otherwise the measurement would
        be of the helpers (small decode batches cannot keep up with a fast prefill)."""
        if role == UNIFIED:
            return True
        other, best = self._helper_kind(role)
        return self.sizer.engines_for(other, best, rate) <= MAX_HELPERS

    def _helpers(self, role: str, rate: float) -> list[InstanceSetup]:
        """The other stage, out of the way: its strongest kind, twice the model's count
        (at most MAX_HELPERS)."""
        if role == UNIFIED:
            return []
        other, best = self._helper_kind(role)
        need = self.sizer.engines_for(other, best, 2.0 * rate)
        count = MAX_HELPERS if not math.isfinite(need) else min(max(need, 1), MAX_HELPERS)
        return [engine_setup(self.config.model, other, best) for _ in range(count)]


def late_rate(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Requests per second arriving over the window's second half: the offered rate, and
    for closed-loop sessions the rate their steps reach once sessions overlap (a step
    arrives when released, and a slow engine releases the next steps later)."""
    return len(second_half(records, duration_s)) / (duration_s / 2)


def steady_attainment(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Share of the requests arriving over the window's second half that met their
    deadlines (1 when none arrived there)."""
    late = second_half(records, duration_s)
    return sum(r.outcome is RequestOutcome.MET for r in late) / len(late) if late else 1.0


def second_half(records: Sequence[RequestRecord], duration_s: float) -> list[RequestRecord]:
    """The requests that arrived over the window's second half: the measured ones."""
    return [r for r in records if duration_s / 2 <= r.arrival_s < duration_s]


def mean_session_span_s(workload: Workload, solo_s: Sequence[float]) -> float:
    """Mean over sessions of the time from a session's start to its last step's end when
    nothing queues, each step taking its solo time (`SessionTimeline`): how long a
    session stays open."""
    timeline = SessionTimeline.of(workload, solo_s)
    spans: dict[str | None, float] = {}
    for request, end_s in zip(workload.requests, timeline.end_s, strict=True):
        # a step's arrival is its session's start until it is issued
        spans[request.session_id] = max(spans.get(request.session_id, 0.0),
                                        float(end_s) - request.arrival_s)
    return sum(spans.values()) / len(spans)


def keeps_up(records: Sequence[RequestRecord], role: str, duration_s: float) -> bool:
    """Over the window's second half, the stage under test finishes (a prefill: the first
    token; otherwise the last) at least STABLE_SHARE of the requests arriving there, less
    the count's noise."""
    half = duration_s / 2
    arrived = len(second_half(records, duration_s))
    if arrived == 0:
        return True
    done = [r.first_token_s if role == PREFILL else r.finish_s for r in records]
    finished = sum(t is not None and half <= t < duration_s for t in done)
    # two standard deviations of a Poisson count: a few dozen slow requests are noise
    return finished >= STABLE_SHARE * arrived - 2.0 * math.sqrt(arrived)


def factors(rows: Sequence[Measured]) -> dict[str, float]:
    """Measured over the served model, per pool kind."""
    return {capacity_key(r.role, r.kind): round(r.factor, 3) for r in rows}


def sara_factors(rows: Sequence[Measured]) -> dict[str, float]:
    """Measured over SARA's stage models: the controller's `capacity_factors` for them."""
    return {capacity_key(r.role, r.kind): round(r.sara_factor, 3) for r in rows}


def main(
    config: Path = typer.Option(DEFAULT_CONFIG, help="autoscaling experiment YAML"),
    prompts: Path | None = typer.Option(None, help="prompt_lengths.jsonl: the traffic's "
                                        "content (prompts content)"),
    content: str = typer.Option(
        "prompts", help="prompts | coding-agent | chat-agent | research-agent"),
    seed: int = typer.Option(1000, help="content and routing seed (keep it apart from the "
                             "experiment's seeds)"),
    duration_s: float = typer.Option(60.0, help="seconds of arrivals per measurement"),
    out: Path | None = typer.Option(None, help="write calibration.json here"),
) -> None:
    """Measure what one engine per pool kind sustains against the served and SARA models;
    prints both factors (the `capacity_factors` line for each)."""
    try:
        if not config.exists():
            raise ValueError(f"{config} does not exist")
        experiment = load_autoscale_config(config)
        traffic = traffic_for(content, prompts, experiment.model)
    except (ValueError, OSError) as error:
        raise cli_error(str(error)) from None
    calibrator = Calibrator(experiment, traffic, seed, duration_s)
    rows = calibrator.run()
    for r in rows:
        typer.echo(f"{r.role:8s} {r.kind.name:8s} measured {r.measured_rps:9.2f} req/s  "
                   f"served model {r.served_rps:9.2f} (factor {r.factor:.3f})  "
                   f"sara {r.sara_rps:9.2f} (factor {r.sara_factor:.3f})")
    if calibrator.skipped:
        typer.echo("not measured (the helper stage would be the bottleneck): "
                   + ", ".join(calibrator.skipped))
    typer.echo("served factors: " + json.dumps(factors(rows)))
    typer.echo("capacity_factors (sara): " + json.dumps(sara_factors(rows)))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps({
            "setup": {"config": config.name, "content": traffic.label,
                      "prompts": prompts.name if prompts else None, "seed": seed,
                      "duration_s": duration_s, "p_slo": experiment.controller.p_slo,
                      "slo_scale": experiment.controller.slo_scale},
            "rows": [{"role": r.role, "kind": r.kind.name, "offered": round(r.offered, 4),
                      "measured_rps": round(r.measured_rps, 3),
                      "served_rps": round(r.served_rps, 3), "sara_rps": round(r.sara_rps, 3),
                      "factor": round(r.factor, 3), "sara_factor": round(r.sara_factor, 3)}
                     for r in rows],
            "not_measured": calibrator.skipped,
            "served_factors": factors(rows),
            "sara_factors": sara_factors(rows)}, indent=2) + "\n")


def traffic_for(content: str, prompts: Path | None, model: str) -> Traffic:
    """The calibration's traffic: a prompt file's content, or an agent-session preset."""
    from app.workloads.workload import load_prompts

    if content == "prompts":
        if prompts is None:
            raise ValueError("--content prompts needs --prompts (prompt_lengths.jsonl)")
        if not prompts.exists():
            raise ValueError(f"{prompts} does not exist")
        return Traffic(pool=[row.content() for row in load_prompts(prompts)])
    try:
        preset = SessionPreset(content)
    except ValueError:
        choices = ", ".join(p.value for p in SessionPreset)
        raise ValueError(f"unknown content {content!r}: prompts, {choices}") from None
    return Traffic.sessions(preset, model)

if __name__ == "__main__":
    typer.run(main)
