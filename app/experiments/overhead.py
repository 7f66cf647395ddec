"""The router's own cost per decision: `goodserve overhead --instances N --rps R`.

The router core runs in-process against N simulated instances of mixed GPU kinds
(H800, A800, A40, 2xV100 in turn), fed Poisson arrivals at R req/s for `duration_s`:
GoodServe placement, the status estimator fed by every engine iteration, the SLO
watchdog's checks, and the output-length prediction (the trained MoE through
micro-batches when a predictor directory is given, else the running history). Every
piece of router work is timed on the wall clock as it runs, stamped with the virtual
time it happened; the simulated engines' own work is not.

Those pieces are then laid on one router thread in the order they happen
(`RouterThread`): work waits while the thread is busy, so a decision's latency
(arrival to decision) includes the queueing behind earlier decisions, status updates,
watchdog checks and the prediction batch it rode in - and a router slower than the
offered rate shows as latency that grows and `decisions_per_s` below the offered rate.
MoE batches follow the router's micro-batcher rule (`_flush_s`: at once for a request
that finds no batch running; under load, once the running batch has ended and the
oldest has waited 2 ms, or 64 are queued; a batch that waits for the busy thread takes
everything that arrived meanwhile), each charged what a batch of its size measured on
the predictor.

Every request has a deadline, `slo_scale` x its solo time on an A800 (as replays set
them), so GoodServe spreads the arrivals over the instances as it does in service: a
request without one is met by any GPU and would join the weakest instance with the rest.

The length estimator starts warm: it has seen `WARM_FINISHES` finished requests from
the same content pool (a router that has been serving a while), so routing takes the
paths it takes in steady state.

With `--reference REF` (a git ref or another checkout's directory) the same measurement
runs in the reference checkout and in this one, each seed of `--seeds` in both, as
processes taking turns at going first (app/experiments/reference.py): the figures of a
shared machine are read as current / reference.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import typer

from app.engines.config import ClusterConfig
from app.engines.messages import EngineStatus
from app.experiments.reference import (
    Checkout,
    PairedRun,
    current_checkout,
    forwarded_options,
    ratios,
    reference_checkout,
    run_pairs,
    run_table,
    summarize,
    summary_table,
    to_stderr,
    write_runs,
)
from app.experiments.replay import cli_error, cluster_model, moe_factory
from app.routing.base import ActiveRequest, RouteDecision, RoutingPolicy, Watchdog, overrides
from app.routing.budgets import SlackBudgets, budgets_of
from app.routing.finish_log import lengths_of
from app.routing.fleet import FleetConfig, RouterFleet
from app.routing.instance_view import InstanceId
from app.routing.length import OutputLengthEstimator, PredictorLength, RunningHistoryLength
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.routing.view import ClusterView, FinishReport, RouteRequest, StepReport
from app.sim.instance import setups_from_config
from app.sim.simulator import Simulator
from app.workloads.slo import assign_slos, reference_instance, solo_latencies_s
from app.workloads.workload import Content, Workload, load_prompts, poisson_workload
from predictor.base import PredictionInput, Predictor
from predictor.batching import use_one_inference_thread

KINDS = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
WARM_FINISHES = 2000
MAX_BATCH_SIZE, MAX_WAIT_S = 64, 0.002  # the router's micro-batcher defaults
SWEEP_INSTANCES = (8, 32, 128, 512)
SWEEP_RPS = (1000, 2500, 5000, 10000)
DEFAULT_SLO_SCALE = 2.0  # the middle of the replays' scales 1-3
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
COMPARED = ("decisions_per_s", "p50_ms", "p99_ms", "cpu_ms_per_decision")  # and the breakdown
REFERENCE_SEEDS = (0, 1, 2)
# options of a measurement beside a reference that each process is not given as they are
NOT_FORWARDED = frozenset({"reference", "seeds", "seed", "sweep", "out", "as_json"})
# the small measurement each checkout runs first, unreported (`reference.run_pairs`)
PRIME = {"instances": 8, "rps": 200.0, "duration": 0.2, "warmup": 0.1}


def mixed_cluster(num_instances: int, model: str = "llama-3.1-8b") -> ClusterConfig:
    """`num_instances` unified engines, the GPU kinds taking turns."""
    if num_instances < 1:
        raise ValueError(f"instances must be >= 1, got {num_instances}")
    counts = [num_instances // len(KINDS) + (i < num_instances % len(KINDS))
              for i in range(len(KINDS))]
    groups = [{"count": n, "engine": {"gpu_type": gpu, "tp": tp, "model": model}}
              for (gpu, tp), n in zip(KINDS, counts, strict=True) if n > 0]
    return ClusterConfig.model_validate({"name": f"mixed-{num_instances}", "groups": groups})


@dataclass
class WorkLog:
    """Router work as it happened: (virtual time it became due, wall seconds it took,
    the arrival time when it is a routing decision, what it was)."""

    due_s: list[float] = field(default_factory=list)
    cost_s: list[float] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)  # nan: not a decision
    what: list[str] = field(default_factory=list)

    def add(self, due: float, cost: float, what: str, arrival: float = math.nan) -> None:
        self.due_s.append(due)
        self.cost_s.append(cost)
        self.arrival_s.append(arrival)
        self.what.append(what)

    @contextmanager
    def timed(self, due: float, what: str, arrival: float = math.nan) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(due, time.perf_counter() - start, what, arrival)


class TimedFinishes:
    """First-token, finish and drop callbacks passed on to `inner`, timed into `log`
    (what the timed policy and the timed watchdog share)."""

    inner: RoutingPolicy | Watchdog
    log: WorkLog

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        if not overrides(self.inner, "on_first_token"):
            return  # the substrates do not call a listener that ignores it
        with self.log.timed(now, "finish"):
            self.inner.on_first_token(request, instance_id, first_token_s, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        with self.log.timed(now, "finish"):
            self.inner.on_finish(report, now)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        with self.log.timed(now, "finish"):
            self.inner.on_drop(request, now)


class TimedFeedback(TimedFinishes, RoutingPolicy):
    """The routing policy with its feedback calls timed into a `WorkLog` (a caller
    that times the decisions itself, as `TimedFleet` does, wraps it in this)."""

    def __init__(self, policy: RoutingPolicy, log: WorkLog) -> None:
        self.inner, self.log = policy, log

    @property
    def length(self) -> OutputLengthEstimator | None:
        """The inner policy's length estimator: replicas learn each other's finishes."""
        return lengths_of(self.inner)

    @property
    def budgets(self) -> SlackBudgets | None:
        """The inner policy's budgets: replicas tell each other their slack."""
        return budgets_of(self.inner)

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        return self.inner.choose(request, view, now)

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        with self.log.timed(now, "status"):
            self.inner.on_step(instance_id, report, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        with self.log.timed(now, "status"):
            self.inner.on_status(status, now)


class TimedPolicy(TimedFeedback):
    """The routing policy, every call timed into a `WorkLog`; a decision is due at its
    request's arrival (`RouterThread` delays it behind its prediction batch)."""

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        with self.log.timed(now, "choose", decision_arrival(request)):
            return self.inner.choose(request, view, now)


def decision_arrival(request: RouteRequest) -> float:
    """The arrival a routing decision answers (nan for a re-route: not a decision)."""
    return request.arrival_s if request.num_generated_tokens == 0 else math.nan


class TimedWatchdog(TimedFinishes, Watchdog):
    """The watchdog's checks and its own callbacks timed into a `WorkLog` (it shares
    the estimators with the policy, which feeds them)."""

    def __init__(self, watchdog: Watchdog, log: WorkLog) -> None:
        super().__init__(watchdog.tau_iterations)
        self.inner, self.log = watchdog, log

    @property
    def check_period_iterations(self) -> int:
        return self.inner.check_period_iterations

    def check(self, instance_id: InstanceId, active: Sequence[ActiveRequest],
              view: ClusterView, now: float) -> Mapping[str, InstanceId]:
        with self.log.timed(now, "watchdog"):
            return self.inner.check(instance_id, active, view, now)


class TimedFleet(RoutingPolicy):
    """Several router replicas: each decision's report (the budgets and finishes a
    replica takes when one is due) and its policy timed into the log of the replica that
    makes it; the replicas' own policies and watchdogs log the rest. The simulator's
    making of what a replica knows (the engines less the others' unseen placements) is
    not timed: a deployed replica's view is its own tracker, as a single router's view is
    the simulator's, untimed too."""

    def __init__(self, fleet: RouterFleet, logs: Sequence[WorkLog]) -> None:
        self.fleet = fleet
        self.logs = {id(r): log for r, log in zip(fleet.replicas, logs, strict=True)}

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        replica = self.fleet.replica_for(request)
        log = self.logs[id(replica)]
        with log.timed(now, "report"):
            self.fleet.refresh(replica, view)
        known = self.fleet.view_of(replica, view)
        with log.timed(now, "choose", decision_arrival(request)):
            decision = replica.policy.choose(request, known, now)
        self.fleet.record(replica, request, decision)
        return decision

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self.fleet.on_step(instance_id, report, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        self.fleet.on_status(status, now)

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        self.fleet.on_first_token(request, instance_id, first_token_s, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.fleet.on_finish(report, now)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self.fleet.on_drop(request, now)


@dataclass(frozen=True)
class BatchCost:
    """Wall seconds of one prediction batch by its size, measured on the predictor with
    real prompts (linear between the measured sizes)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    max_batch_size: int = MAX_BATCH_SIZE
    max_wait_s: float = MAX_WAIT_S

    @classmethod
    def measure(cls, predictor: Predictor, inputs: Sequence[PredictionInput],
                repeats: int = 5) -> BatchCost:
        """Each batch of prompts the predictor has not seen (arrivals are new requests:
        none of their text is featurised yet)."""
        sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= MAX_BATCH_SIZE)
        seconds = []
        for size in sizes:
            runs = []
            for r in range(repeats):
                picked = [inputs[(r * size + k) % len(inputs)] for k in range(size)]
                batch = [replace(inp, prompt=f"{inp.prompt} {size}-{r}-{k}")
                         for k, inp in enumerate(picked)]
                start = time.perf_counter()
                predictor.predict(batch)
                runs.append(time.perf_counter() - start)
            seconds.append(float(np.median(runs)))
        return cls(sizes, tuple(seconds))

    def __call__(self, size: int) -> float:
        return float(np.interp(size, self.sizes, self.seconds))


@dataclass(frozen=True)
class RouterThread:
    """Lays the logged work on one thread: each piece starts when it is due and the
    thread is free. With `batches`, a decision first waits for its prediction: the
    micro-batcher's batch forms from the arrivals pending when it flushes (full, or
    `max_wait_s` after its oldest, or later when the thread is busy: then it takes
    everything that arrived meanwhile, up to the batch size)."""

    latency_s: np.ndarray  # per decision: decided - arrived
    busy_s: float  # work in the measured window, predictions included
    span_s: float  # first arrival to the last decision
    predict_s: float  # prediction batches in the measured window

    @classmethod
    def replay(cls, log: WorkLog, measured_from_s: float = -math.inf,
               batches: BatchCost | None = None) -> RouterThread:
        """Figures over the work due from `measured_from_s` on (the thread still carries
        what came before: a warm-up)."""
        due = np.asarray(log.due_s)
        order = np.argsort(due, kind="stable")
        cost, arrival, due = (np.asarray(log.cost_s)[order], np.asarray(log.arrival_s)[order],
                              due[order])
        is_decision = ~np.isnan(arrival)
        done = np.empty(len(due))
        predict_s = 0.0
        if batches is None:
            free = -math.inf
            for i in range(len(due)):
                free = max(due[i], free) + cost[i]
                done[i] = free
        else:
            predict_s = _replay_with_batches(due, cost, is_decision, done, batches,
                                             measured_from_s)
        measured = due >= measured_from_s
        decisions = measured & is_decision
        if not decisions.any():
            raise ValueError("no routing decision in the measured window")
        latency = done[decisions] - arrival[decisions]
        span = done[decisions].max() - arrival[decisions].min()
        return cls(latency, float(cost[measured].sum()) + predict_s, float(span), predict_s)


def _replay_with_batches(due: np.ndarray, cost: np.ndarray, is_decision: np.ndarray,
                         done: np.ndarray, batches: BatchCost, measured_from_s: float) -> float:
    """One thread running, whichever can start first: a decision whose prediction is
    done (first on ties), other work, or the next prediction batch. Fills `done`;
    returns the seconds of the batches started in the measured window."""
    decisions, others = np.flatnonzero(is_decision), np.flatnonzero(~is_decision)
    ready: deque[tuple[float, int]] = deque()  # (prediction done, row), in batch order
    free, next_decision, next_other, predict_s = -math.inf, 0, 0, 0.0
    batch_end = -math.inf  # when the last prediction batch ended
    while ready or next_decision < len(decisions) or next_other < len(others):
        options = []
        if ready:
            options.append((max(ready[0][0], free), 0))
        if next_other < len(others):
            options.append((max(due[others[next_other]], free), 1))
        if next_decision < len(decisions):
            options.append((max(_flush_s(due, decisions, next_decision, batch_end, batches),
                                free), 2))
        start, kind = min(options)
        if kind == 0:
            row = ready.popleft()[1]
        elif kind == 1:
            row = others[next_other]
            next_other += 1
        if kind < 2:
            free = done[row] = start + cost[row]
            continue
        end = next_decision
        while (end < len(decisions) and end - next_decision < batches.max_batch_size
               and due[decisions[end]] <= start):
            end += 1
        seconds = batches(end - next_decision)
        free = batch_end = start + seconds
        predict_s += seconds if start >= measured_from_s else 0.0
        ready.extend((free, row) for row in decisions[next_decision:end])
        next_decision = end
    return predict_s


def _flush_s(due: np.ndarray, decisions: np.ndarray, oldest: int, batch_end: float,
             batches: BatchCost) -> float:
    """When the batcher starts the batch of the oldest waiting decision
    (`predictor.batching.PredictionBatcher`): at once when it arrived with no batch
    running; else when the running batch has ended and it has waited `max_wait_s`, or
    has ended with a full batch waiting."""
    arrived = due[decisions[oldest]]
    if arrived >= batch_end:
        return arrived
    flush = max(batch_end, arrived + batches.max_wait_s)
    full = oldest + batches.max_batch_size - 1
    if full < len(decisions):
        flush = min(flush, max(batch_end, due[decisions[full]]))
    return flush


def predict_all(workload: Workload, predictor: Predictor) -> Workload:
    """Every request's arrival prediction (the values do not depend on the batching)."""
    requests = list(workload.requests)
    items = [PredictionInput(prompt=r.prompt or "", task=r.task) for r in requests]
    lengths = np.concatenate([predictor.predict(items[i:i + MAX_BATCH_SIZE])
                              for i in range(0, len(items), MAX_BATCH_SIZE)])
    return workload.with_requests([replace(r, predicted_output_tokens=max(round(t), 1))
                                   for r, t in zip(requests, lengths, strict=True)])


def warm_up(length: OutputLengthEstimator, pool: Sequence[Content], seed: int) -> None:
    """Show the estimator `WARM_FINISHES` finished requests drawn from the pool, with
    their arrival predictions when it predicts."""
    sample = poisson_workload(1000.0, WARM_FINISHES / 1000.0, pool, seed=seed + 1)
    routes = [r.route_request() for r in sample.requests]
    if isinstance(length, PredictorLength):
        totals = length.predict_totals(routes, [0] * len(routes))
        routes = [replace(r, predicted_output_tokens=max(round(t), 1))
                  for r, t in zip(routes, totals, strict=True)]
    for route, work in zip(routes, sample.requests, strict=True):
        length.on_finish(FinishReport(route, "warm-up", work.num_output_tokens, None, 0.0), 0.0)


@dataclass(frozen=True)
class Overhead:
    instances: int
    rps: float
    duration_s: float
    predictor: str
    decisions: int
    latency_ms: np.ndarray
    decisions_per_s: float
    cpu_ms_per_decision: float
    breakdown_ms: dict[str, float]  # per decision, by kind of work
    routers: int = 1
    # per router replica: decisions, p99 and last-decile p99 (ms), decisions/s, busy share
    per_router: tuple[dict[str, float], ...] = ()
    slo_scale: float = DEFAULT_SLO_SCALE
    instances_used: int = 0  # instances the decisions placed requests on

    def summary(self) -> dict[str, Any]:
        lat = self.latency_ms
        extra = {} if self.routers == 1 else {"per_router": list(self.per_router)}
        return {
            "instances": self.instances, "rps": self.rps, "duration_s": self.duration_s,
            "predictor": self.predictor, "routers": self.routers, "slo_scale": self.slo_scale,
            "instances_used": self.instances_used, "decisions": self.decisions,
            "p50_ms": round(float(np.percentile(lat, 50)), 4),
            "p99_ms": round(float(np.percentile(lat, 99)), 4),
            "max_ms": round(float(lat.max()), 4),
            "decisions_per_s": round(self.decisions_per_s, 1),
            "cpu_ms_per_decision": round(self.cpu_ms_per_decision, 4),
            "breakdown_ms_per_decision": {k: round(v, 4) for k, v in self.breakdown_ms.items()},
            **extra,
        }


def default_prompts() -> Path:
    return DATA / "prompts" / "prompt_lengths.jsonl"


def content_pool(prompts: Path | None) -> list[Content]:
    path = prompts or default_prompts()
    if path.is_file():
        return [p.content() for p in load_prompts(path)]
    if prompts is not None:
        raise ValueError(f"{prompts} does not exist")
    return [Content(256 + 64 * (i % 16), 64 + 32 * (i % 11), (i,)) for i in range(512)]


def with_deadlines(workload: Workload, cluster: ClusterConfig, slo_scale: float) -> Workload:
    """Each request's SLO: `slo_scale` x its solo time on the replays' reference GPU."""
    reference = reference_instance(cluster_model(cluster))
    return assign_slos(workload, solo_latencies_s(workload.requests, reference), slo_scale)


def measure(instances: int, rps: float, duration_s: float, pool: Sequence[Content],
            predictor_factory: Callable[[], Predictor] | None = None,
            seed: int = 0, warmup_s: float = 1.0, routers: int = 1,
            slo_scale: float = DEFAULT_SLO_SCALE) -> Overhead:
    """Run the router core at `rps` against `instances` simulated instances and lay its
    work on one thread per router replica (module docstring); the first `warmup_s` of
    arrivals fill the instances and are not reported."""
    if rps <= 0 or duration_s <= 0 or warmup_s < 0:
        raise ValueError("rps and duration must be > 0, warm-up >= 0")
    cluster = mixed_cluster(instances)
    workload = with_deadlines(poisson_workload(rps, warmup_s + duration_s, pool, seed=seed),
                              cluster, slo_scale)
    batches: BatchCost | None = None
    lengths: list[OutputLengthEstimator] = []
    for _ in range(routers):  # each replica predicts and learns on its own
        if predictor_factory is not None:
            use_one_inference_thread()  # as the router does
            predictor = predictor_factory()
            lengths.append(PredictorLength(predictor))
            if batches is None:
                workload = predict_all(workload, predictor)
                batches = BatchCost.measure(predictor, [
                    PredictionInput(r.prompt or "", task=r.task) for r in workload.requests[:512]])
        else:
            lengths.append(RunningHistoryLength())
        warm_up(lengths[-1], pool, seed)
    stacks = [build_routing(PolicyKind.GOODSERVE, RoutingOptions(
        seed=seed + k, length_factory=lambda length=length: length))
        for k, length in enumerate(lengths)]
    logs = [WorkLog() for _ in stacks]
    wrap = TimedPolicy if routers == 1 else TimedFeedback  # TimedFleet times decisions
    timed = [(wrap(stack.policy, log), TimedWatchdog(stack.watchdog, log))
             for stack, log in zip(stacks, logs, strict=True) if stack.watchdog is not None]
    if routers == 1:
        policy, watchdog = timed[0]
    else:
        fleet = RouterFleet(timed, FleetConfig(routers), seed)
        policy, watchdog = TimedFleet(fleet, logs), fleet.watchdog
    sim = Simulator(setups_from_config(cluster), policy, watchdog=watchdog, seed=seed,
                    max_drain_s=0.0)
    # Ray Serve collects and freezes a replica's heap once its constructor returns
    # (RAY_SERVE_FREEZE_GC_ON_STARTUP): what the routers and the fleet hold from start-up
    # is never scanned again, here as in a deployed replica
    gc.collect()
    gc.freeze()
    try:
        records = sim.run(workload).records
    finally:
        gc.unfreeze()
    measured_from = workload.requests[0].arrival_s + warmup_s
    threads = [RouterThread.replay(log, measured_from, batches) for log in logs]
    latency = np.concatenate([t.latency_s for t in threads])
    decisions = len(latency)
    breakdown: dict[str, float] = {}
    for log in logs:
        window = np.asarray(log.due_s) >= measured_from
        costs, what = np.asarray(log.cost_s)[window], np.asarray(log.what)[window]
        for kind in set(what):
            breakdown[kind] = breakdown.get(kind, 0.0) + float(costs[what == kind].sum())
    breakdown = {k: v / decisions * 1e3 for k, v in sorted(breakdown.items())}
    if batches is not None:
        breakdown["predict"] = sum(t.predict_s for t in threads) / decisions * 1e3
    span = max(t.span_s for t in threads)
    return Overhead(
        instances, rps, duration_s, "moe" if predictor_factory else "history", decisions,
        latency * 1e3, decisions / span if span > 0 else math.nan,
        sum(t.busy_s for t in threads) / decisions * 1e3, breakdown, routers,
        tuple(_router_figures(t) for t in threads) if routers > 1 else (), slo_scale,
        len({iid for r in records for iid in r.instance_ids}))


def _router_figures(thread: RouterThread) -> dict[str, float]:
    """One replica's figures; a replica that keeps up has a last-decile p99 like its
    whole window's and a busy share below 1."""
    lat = thread.latency_s * 1e3
    last = lat[int(len(lat) * 0.9):]
    return {"decisions": len(lat), "p99_ms": round(float(np.percentile(lat, 99)), 4),
            "last_decile_p99_ms": round(float(np.percentile(last, 99)), 4),
            "decisions_per_s": round(len(lat) / thread.span_s, 1),
            "busy_share": round(thread.busy_s / thread.span_s, 3)}


def write_sweep(out: Path, rows: Sequence[dict[str, Any]]) -> None:
    """overhead.csv and overhead.png (p50 / p99 per decision against instances)."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fields = [k for k in rows[0] if k != "breakdown_ms_per_decision"]
    with (out / "overhead.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    predictors = sorted({r["predictor"] for r in rows})
    fig, axes = plt.subplots(1, len(predictors), figsize=(6 * len(predictors), 4),
                             squeeze=False, sharey=True)
    for ax, name in zip(axes[0], predictors, strict=True):
        for rps in sorted({r["rps"] for r in rows}):
            cells = sorted((r for r in rows if r["predictor"] == name and r["rps"] == rps),
                           key=lambda r: r["instances"])
            xs = [r["instances"] for r in cells]
            line, = ax.plot(xs, [r["p99_ms"] for r in cells], marker="o",
                            label=f"{rps:g} req/s p99")
            ax.plot(xs, [r["p50_ms"] for r in cells], ls="--", color=line.get_color())
        ax.axhline(0.5, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="instances", title=f"lengths: {name}")
        ax.set_xticks(SWEEP_INSTANCES, [str(n) for n in SWEEP_INSTANCES])
    axes[0][0].set_ylabel("ms per decision (arrival to decision); dashed p50")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=120)
    plt.close(fig)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give comma-separated integers") from None
    if not seeds:
        raise ValueError("--seeds names no seed")
    return seeds


def measurement_command(options: Sequence[str], seed: int) -> list[str]:
    """One measurement in a checkout: its own `goodserve overhead`, printing its JSON."""
    return [sys.executable, "-m", "app.cli", "overhead", *options, "--seed", str(seed),
            "--json"]


def compared_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """A measurement's figures compared beside a reference: the headline ones and the
    work per decision by kind (breakdown.KIND)."""
    return {**{name: summary[name] for name in COMPARED},
            **{f"breakdown.{kind}": ms
               for kind, ms in summary["breakdown_ms_per_decision"].items()}}


def reference_report(reference: Checkout, current: Checkout, options: Sequence[str],
                     runs: Sequence[PairedRun]) -> dict[str, Any]:
    """Both sides' figures per seed with current / reference, and the summary over seeds."""
    pairs = [(compared_figures(r.reference), compared_figures(r.current)) for r in runs]
    return {
        "reference": reference.as_dict(), "current": current.as_dict(),
        "options": list(options),
        "seeds": [{"seed": run.key, "order": list(run.order), "reference": ref,
                   "current": cur, "ratio": ratios(ref, cur)}
                  for run, (ref, cur) in zip(runs, pairs, strict=True)],
        "summary": summarize(pairs),
    }


def report_lines(report: Mapping[str, Any]) -> list[str]:
    ref, cur = report["reference"], report["current"]
    lines = [f"reference {ref['version']} at {ref['root']}; current {cur['version']} at "
             f"{cur['root']}", "overhead " + " ".join(report["options"])]
    for run in report["seeds"]:
        lines += ["", f"seed {run['seed']} ({run['order'][0]} first):",
                  *run_table(run["reference"], run["current"])]
    seeds = len(report["seeds"])
    lines += ["", f"summary over {seeds} seed{'s' if seeds > 1 else ''}:",
              *summary_table(report["summary"])]
    return lines


def measure_beside(ref: str, seeds: Sequence[int], options: Sequence[str],
                   prime: Sequence[str], out: Path | None, as_json: bool) -> None:
    """The measurement per seed in the reference checkout and in this one (module
    docstring), after a small one of the same options (`prime`) in each; the report to
    stdout, each run's JSON and the report under `out`."""
    log = None if as_json else to_stderr
    with reference_checkout(ref, log=log) as reference:
        current = current_checkout()
        runs = run_pairs(reference, current, seeds,
                         lambda seed: measurement_command(options, seed),
                         name=lambda seed: f"seed {seed}", log=log,
                         prime=measurement_command(prime, seeds[0]))
    report = reference_report(reference, current, options, runs)
    if out is not None:
        write_runs(out, runs, lambda seed: f"seed{seed}", report)
    typer.echo(json.dumps(report) if as_json else "\n".join(report_lines(report)))


def overhead(
    ctx: typer.Context,
    instances: int = typer.Option(512, help="simulated instances, GPU kinds in turn"),
    rps: float = typer.Option(10_000.0, help="offered Poisson arrival rate"),
    duration: float = typer.Option(1.0, help="seconds of arrivals measured"),
    warmup: float = typer.Option(1.0, help="seconds of arrivals before, not measured"),
    predictor: Path | None = typer.Option(None, help="directory of a trained MoE "
                                          "(`goodserve predictor train`); else running history"),
    prompts: Path | None = typer.Option(None, help="prompt_lengths.jsonl content (default: "
                                        "the shared data's, else synthetic)"),
    seed: int = typer.Option(0),
    routers: int = typer.Option(1, min=1, help="router replicas sharing the rate, each on "
                                "its own thread with its own state and MoE batches"),
    slo_scale: float = typer.Option(DEFAULT_SLO_SCALE, min=0.01, help="each request's "
                                    "deadline: this x its solo time on an A800"),
    sweep: bool = typer.Option(False, help=f"every instances {SWEEP_INSTANCES} x rps "
                               f"{SWEEP_RPS}, with and without --predictor"),
    out: Path | None = typer.Option(None, help="--sweep: write overhead.csv, overhead.png; "
                                    "--reference: each run's JSON (reference-seedN.json, "
                                    "current-seedN.json) and summary.json"),
    as_json: bool = typer.Option(False, "--json", help="print only the JSON"),
    collect: bool = typer.Option(True, "--gc/--no-gc", help="--no-gc: Python's collector "
                                 "off, to see the routing work without the pauses of "
                                 "collecting this process's heap (the simulated engines' "
                                 "state and every replica's share it)"),
    reference: str | None = typer.Option(None, help="a git ref or another checkout's "
                                         "directory: the same measurement there and here, "
                                         "per seed of --seeds, with current / reference"),
    seeds: str | None = typer.Option(None, help="--reference: comma-separated seeds, each "
                                     "run on both sides (default: "
                                     + ",".join(map(str, REFERENCE_SEEDS)) + ")"),
) -> None:
    """The router's cost per routing decision at a given scale and rate (one JSON
    object; with --sweep a list, plus CSV and PNG; with --reference, beside a reference
    checkout)."""
    if reference is None and seeds is not None:
        raise cli_error("--seeds goes with --reference (one measurement takes --seed)")
    if reference is not None:
        if sweep:
            raise cli_error("--reference compares one measurement; leave out --sweep")
        if prompts is None and default_prompts().is_file():
            prompts = default_prompts()  # a reference's own default may not reach the data
        options = forwarded_options(ctx, NOT_FORWARDED, {"prompts": prompts})
        prime = forwarded_options(ctx, NOT_FORWARDED, {"prompts": prompts, **PRIME})
        try:
            measure_beside(reference, parse_seeds(seeds) if seeds else REFERENCE_SEEDS,
                           options, prime, out, as_json)
        except ValueError as error:
            raise cli_error(str(error)) from None
        return
    if not collect:
        gc.disable()
    try:
        pool = content_pool(prompts)
        factory = moe_factory(predictor) if predictor is not None else None
        if not sweep:
            result = measure(instances, rps, duration, pool, factory, seed, warmup, routers,
                             slo_scale)
            typer.echo(json.dumps(result.summary(), indent=None if as_json else 2))
            return
        rows = []
        for factory_or_none in ([None, factory] if factory else [None]):
            for n in SWEEP_INSTANCES:
                for rate in SWEEP_RPS:
                    row = measure(n, rate, duration, pool, factory_or_none, seed,
                                  warmup, routers, slo_scale).summary()
                    rows.append(row)
                    if not as_json:
                        typer.echo(json.dumps(row), err=True)
    except ValueError as error:
        raise cli_error(str(error)) from None
    if out is not None:
        write_sweep(out, rows)
    typer.echo(json.dumps(rows, indent=None if as_json else 2))
