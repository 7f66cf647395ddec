"""Agentic matrix (simulator): GoodServe against the baselines users deploy, on the
traffic it exists for.

Setup. Workloads: `mooncake`, the Mooncake conversation trace with its own lengths and
prefix blocks (ContentMode.TRACE; --trace, default ../shared/data/traces/ from the
repository root, skipped with a message when absent), stretched to the rate (req/s),
each seed a window (--duration) at its own seeded offset in the stretched trace (so seeds
see different conversations, and the trace's opening burst is no likelier than any
other part); `coding-agent`, `chat-agent` and `research-agent` (an orchestrator whose
parallel sub-agents branch from its context and are joined), closed-loop session
presets with Poisson session arrivals (rate in sessions/s). Clusters: `small`
(configs/paper-4gpu.yaml) and `large` (configs/mixed-16gpu.yaml, sixteen engines of four
kinds). SLO = scale x solo time on an A800 (an agent step's context counted as cached).

Load. Per (workload, cluster), the reference rate L* is where the best calibration
baseline (--calibration-policies; by default round-robin, least-request and
prefix-cache, and on coding-agent Preble and Llumnix) stops meeting 80% of requests at
SLO scale 2: a bracket by doubling or halving from a
per-engine starting rate, then 6 geometric bisections, on a calibration seed (100) that
is never reported. A rate whose window holds fewer than 50 requests is too coarse to
bisect on; if the cheap baselines are still under 80% there, every baseline is tried,
and a pair that no baseline brings to 80% is skipped with the reason (Mooncake on the
small cluster: its long prompts miss scale 2 on the A40 and V100 even when idle, the
best baseline meeting 60-74% from 0.11 to 1.2 req/s). The matrix runs 0.5, 0.8, 1, 1.5,
2, 3 and 4 x L*; each (workload, cluster, load, seed) unit runs every policy (GoodServe,
GoodServe with exact lengths, every registered baseline) at scales 1, 1.5, 2 and 3.
Seeds: 0, 1, 2 on small, 0 on large.

Windows (--duration): 500 s of arrivals for Mooncake and chat-agent, 20,000 s for
coding-agent, 3,000 s for research-agent (its sessions run ~19 steps over minutes).
Coding sessions run for minutes with contexts of half the model's limit:
in 500 s the queues they build have not reached a steady state, so L* came out 6x too
high (0.046 sessions/s on paper-4gpu against 0.0075 with a 5,000 s window), and a unit
held 25-60 steps, with the best baseline's seed-to-seed spread of met steps 0.4-0.8.
20,000 s at L* is about 150 sessions.

Cost, measured on this 2-core machine in CPU seconds per unit (11 policies x 4 scales)
at about L*, with a 300 s window: coding-agent small 6 (48 requests), chat-agent small
50 (320), Mooncake small 35 (at 1 req/s, 335); chat-agent large about 430 (3,423
requests: round-robin 13 and GoodServe 74, each 5.6x its time with a 60 s window, where
the whole unit took 77); with a 60 s window, coding-agent large 8 and Mooncake large 21.
With the 5,000 s window, one GoodServe run of coding-agent small is 14 s; with 3,000 s on
the large cluster, GoodServe 24 s, llm-d 48 s, round-robin 14 s.
Per cell (one policy at one scale) that is 0.03 s (round-robin on coding-agent small,
simulated once and re-scored at every scale) to about 38 s (llm-d on chat-agent large).
Cost grows a little faster than the window (5.6x for 5x). A calibration is about ten
runs of the three cheap baselines at one scale (Mooncake large with a 500 s window: 144
CPU s, L* = 4.06 req/s). chat-agent on the large cluster is over half of a full matrix;
the committed matrix leaves it out (--only-workloads).

Writes under --out: calibration.csv (L* per pair), cells.csv (one row per unit, policy
and scale; --resume skips the units it holds at the current L*), matrix.csv and
matrix.md (per workload, cluster, load and scale: GoodServe met / best baseline met with
the best baseline named, exact lengths / GoodServe, mean and range over seeds; the best
baseline's seed-to-seed spread as the noise; GoodServe's met at 1.5x over its met at 1.0x
load), matrix.png (GoodServe / best baseline heat maps per workload and cluster) and
attainment.png (every policy's met share against load, per pair and scale).
GoodServe arms run GoodServe again with one cluster setting changed: --move-paths
token-ids,kv with every move forced to each path (cells "goodserve@token-ids",
"goodserve@kv"), --keep-session-kv with each session's KV kept through its tool waits
(cells "goodserve@kept-kv"); matrix.md then adds GoodServe, as configured, over each arm.

Capacity (--capacity, instead of the matrix). A policy's capacity is the highest arrival
rate at which at least 90% of the steps meet their deadline, at SLO scales 1.5, 2 and 3;
a rejected step, and a step never sent because its session ended or the run stopped,
counts as a miss (the simulator records each). Per (workload, cluster, seed, policy) and
scale: the calibration's search (`find_crossing`) with the target 90%, bisecting until
the bracket is within 3% of the rate, at most 12 runs; scale 1.5 starts from the
per-engine first guess, each looser scale from the capacity found at the one before.
Pairs: every workload on both clusters, coding-agent on the large one included; seeds
0, 1, 2 (--capacity-seeds) on both; policies GoodServe and every baseline (slo-pack
among them). Writes capacity.csv (one row per workload, cluster, seed, policy and scale:
the capacity, the lowest rate tried that missed, the runs used; --resume keeps the
rows at the current windows) and capacity.md (per pair and scale, GoodServe's capacity
over the best baseline's, per seed and mean [min, max], the best baseline named; the
weakest and the best pair; every policy's capacity, mean [min, max] over seeds).
Cost: a search takes about 7 runs (one to three to bracket, 5 bisections), so a full
run is 6 pairs x 3 seeds x 10 policies x 3 scales x ~7-8, about 4,000 simulator runs
(at most 6,480); each runs one policy at one scale, about one matrix cell. By the cell
costs above, coding-agent on the large cluster (20,000 s windows, 100-330 CPU s a run)
is most of it: roughly 30-50 CPU hours in all, half that in wall time with --jobs 2.

Usage: python -m benchmarks.agentic [--jobs 2] [--resume] [--only-clusters small]
       [--only-workloads chat-agent] [--duration coding-agent=20000]
       [--policies goodserve,round-robin] [--move-paths token-ids,kv]
       python -m benchmarks.agentic --capacity [--jobs 2] [--resume]
       [--capacity-seeds 0,1,2] [--report-only]
"""

from __future__ import annotations

import csv
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.engines.config import load_cluster_config
from app.experiments.replay import ReplaySpec, build_workload, context_limit_of, run_replay
from app.routing.move_path import MoveRule
from app.routing.registry import PolicyKind, RoutingOptions
from app.workloads.workload import (
    Arrivals,
    ContentMode,
    Workload,
    load_trace,
    scale_and_window,
    trace_workload,
)
from benchmarks.cli import run_command
from benchmarks.matrix_io import (
    append_rows,
    draw_ratio_grid,
    mean_range_text,
    ratio,
    read_rows,
    save_compact_png,
)
from predictor.progress import Progress

if TYPE_CHECKING:
    from app.engines.config import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("mooncake", "coding-agent", "chat-agent", "research-agent")
CLUSTERS = {"small": REPO / "configs" / "paper-4gpu.yaml",
            "large": REPO / "configs" / "mixed-16gpu.yaml"}
LOAD_FACTORS = (0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 4.0)
COLLAPSE_FACTORS = (1.5, 1.0)  # GoodServe's met at the first load over its met at the second
SCALES = (1.0, 1.5, 2.0, 3.0)
# arrivals per run, per workload: coding-agent sessions run for minutes, hold long
# contexts and arrive ~50x less often than chat sessions (see the module docstring)
DURATION_S = {"mooncake": 500.0, "coding-agent": 20000.0, "chat-agent": 500.0,
              "research-agent": 3000.0}
DURATION_HELP = ("arrival window per run, s: one number for every workload, or "
                 "workload=seconds pairs (default: "
                 + ", ".join(f"{w} {d:g}" for w, d in DURATION_S.items()) + ")")
CALIBRATION_SCALE = 2.0
TARGET_MET_SHARE = 0.8
CALIBRATION_SEED = 100
MAX_BRACKET_STEPS = 8  # doublings or halvings of a rate search before it gives up
CALIBRATION_RESOLUTION = 0.011  # L*'s bracket: 6 bisections of a factor 2
CALIBRATION_MAX_RUNS = 1 + MAX_BRACKET_STEPS + 6
MIN_SEARCH_REQUESTS = 50  # a met share over fewer requests is too coarse to bisect on
# and over fewer sessions, whose steps are not independent (a window expected to hold
# two or three long sessions may draw none)
MIN_SEARCH_SESSIONS = 5
# capacity: the highest rate at which a policy meets a share of the steps, per scale; at
# 90% (CAPACITY_SHARE), and at 80% too, which says something where baselines never reach 90%
CAPACITY_SHARES = (0.9, 0.8)
CAPACITY_SHARE = CAPACITY_SHARES[0]
CAPACITY_SCALES = (1.5, 2.0, 3.0)
CAPACITY_RESOLUTION = 0.03  # the search stops when the bracket is within 3% of the rate
CAPACITY_MAX_RUNS = 12  # per policy and scale: a factor-2 bracket and 5 bisections take 7
CAPACITY_SEEDS = (0, 1, 2)
GOODSERVE, EXACT = PolicyKind.GOODSERVE.value, PolicyKind.GOODSERVE_EXACT.value
ARM_PREFIX = f"{GOODSERVE}@"  # GoodServe with one cluster setting changed
# the baselines users deploy; llm-d, session-affinity and dynamo-kv run where the
# policy registry has them (membership in PolicyKind), and count as baselines in any case
CANDIDATE_BASELINES = ("round-robin", "least-request", "prefix-cache", "preble", "llumnix",
                       "slo-pack", "llm-d", "session-affinity", "dynamo-kv")
BASELINES = tuple(n for n in CANDIDATE_BASELINES if n in {k.value for k in PolicyKind})
POLICIES = (GOODSERVE, EXACT, *BASELINES)
CAPACITY_POLICIES = (GOODSERVE, *BASELINES)
# the baselines L* is bisected on, per workload: the cheap ones, except on coding-agent,
# where over a long window they never meet 80% at scale 2 (they spread a session's
# steps over GPUs that must recompute its context) and the strongest two set the load
CHEAP_CALIBRATION = ("round-robin", "least-request", "prefix-cache")
CALIBRATION_POLICIES = {"mooncake": CHEAP_CALIBRATION, "coding-agent": ("preble", "llumnix"),
                        "chat-agent": CHEAP_CALIBRATION, "research-agent": CHEAP_CALIBRATION}
# a first guess of L* per engine, where the bracket search starts (req/s or sessions/s)
START_RATE_PER_ENGINE = {"mooncake": 0.3, "coding-agent": 0.002, "chat-agent": 0.2,
                         "research-agent": 0.005}
CELL_FIELDS = ["workload", "cluster", "load_factor", "rate", "seed", "policy", "slo_scale",
               "requests", "met", "goodput_rps"]
CALIBRATION_FIELDS = ["workload", "cluster", "duration_s", "seed", "rate", "policies", "note"]
CAPACITY_FIELDS = ["workload", "cluster", "duration_s", "seed", "policy", "slo_scale",
                   "capacity", "lowest_failing_rate", "runs", "share"]


@dataclass(frozen=True)
class GoodServeArm:
    """GoodServe with one cluster setting changed, run beside the matrix's GoodServe."""

    name: str  # its cells are "goodserve@<name>"
    setting: str  # a ClusterConfig field
    value: object

    @classmethod
    def forced_moves(cls, rule: MoveRule) -> GoodServeArm:
        """Every move forced to `rule`'s path, against the default of choosing per move."""
        return cls(rule.value, "move_path", rule)

    @classmethod
    def kept_session_kv(cls) -> GoodServeArm:
        """Each session's KV kept on its engine through the tool waits it expects."""
        return cls("kept-kv", "keep_session_kv", True)

    @property
    def label(self) -> str:
        return f"{ARM_PREFIX}{self.name}"


@dataclass(frozen=True)
class MatrixSetup:
    """What every worker needs besides its unit."""

    durations_s: dict[str, float]  # arrival window of each workload's units and calibration
    trace: Path  # the Mooncake conversation trace
    policies: tuple[str, ...]  # run on every unit
    # GoodServe again with one cluster setting changed per arm (cells "goodserve@<arm>")
    arms: tuple[GoodServeArm, ...] = ()

    def duration_s(self, workload: str) -> float:
        return self.durations_s[workload]


@dataclass(frozen=True)
class Unit:
    """One simulated workload: every policy at every scale runs on it."""

    workload: str
    cluster: str
    load_factor: float
    rate: float  # load_factor x L*: req/s (mooncake) or sessions/s
    seed: int

    @property
    def key(self) -> tuple[str, str, float, int]:
        return (self.workload, self.cluster, self.load_factor, self.seed)


# ---- workloads and runs ----------------------------------------------------------------


def trace_window(trace: Path, rate: float, duration_s: float, seed: int) -> Workload:
    """The trace's own requests stretched to `rate` req/s, in a `duration_s` window at a
    seeded offset (the whole stretched trace when it is shorter)."""
    scaled, span_s = scale_and_window(load_trace(trace), rate=rate)
    offset_s = random.Random(seed).uniform(0.0, max(span_s - duration_s, 0.0))
    kept = [r for r in scaled if offset_s <= r.arrival_s < offset_s + duration_s]
    return trace_workload(kept, duration_s=duration_s, name="mooncake")


def make_workload(workload: str, cluster: ClusterConfig, rate: float, seed: int,
                  setup: MatrixSetup) -> Workload:
    if workload == "mooncake":
        return trace_window(setup.trace, rate, setup.duration_s(workload), seed)
    return build_workload(arrivals=Arrivals.POISSON, trace=None, prompts=None, rate=rate,
                          duration_s=setup.duration_s(workload), max_requests=None, seed=seed,
                          content=ContentMode(workload), context_limit=context_limit_of(cluster))


def run_cells(workload: str, cluster: str, rate: float, seed: int, setup: MatrixSetup,
              policies: Sequence[str], scales: Sequence[float]) -> list[dict]:
    """`policies` at `scales` on one workload: one row per (policy, scale)."""
    config = load_cluster_config(CLUSTERS[cluster])
    work = make_workload(workload, config, rate, seed, setup)
    spec = ReplaySpec(config, tuple(PolicyKind.from_str(p) for p in policies), tuple(scales),
                      seed=seed, routing=RoutingOptions(seed))
    cells = run_replay(spec, work) if policies else []
    for arm in setup.arms:
        changed = replace(spec, cluster=config.model_copy(update={arm.setting: arm.value}),
                          policies=(PolicyKind.GOODSERVE,))
        cells += [c.renamed(arm.label) for c in run_replay(changed, work)]
    return [{"policy": c.policy, "slo_scale": c.slo_scale, "requests": c.summary["requests"],
             "met": c.summary["met"], "goodput_rps": c.summary["goodput_rps"]} for c in cells]


def run_unit(unit: Unit, setup: MatrixSetup) -> list[dict]:
    rows = run_cells(unit.workload, unit.cluster, unit.rate, unit.seed, setup, setup.policies,
                     SCALES)
    return [{"workload": unit.workload, "cluster": unit.cluster,
             "load_factor": unit.load_factor, "rate": unit.rate, "seed": unit.seed, **row}
            for row in rows]


# ---- calibration --------------------------------------------------------------------------


class NoCrossing(ValueError):
    """The met share does not cross the target within the rates searched."""

    def __init__(self, message: str, *, always_below: bool) -> None:
        super().__init__(message)
        self.always_below = always_below  # under the target even at the lightest rate


@dataclass(frozen=True)
class Crossing:
    """Where a met share that falls with the rate crosses a target, as far as the rates
    tried tell."""

    low: float | None  # the highest rate tried that meets the target; None if none did
    high: float | None  # the lowest rate tried under the target; None if every one met it
    runs: int  # rates tried


def find_crossing(share_at: Callable[[float], float], target: float, start: float, *,
                  resolution: float, max_runs: int, min_rate: float = 0.0) -> Crossing:
    """Bracket the rate where a non-increasing `share_at` falls under `target`, doubling
    from `start` while it is met and halving while it is not (at most MAX_BRACKET_STEPS
    steps, never below `min_rate`), then bisect geometrically until high <= low x (1 +
    `resolution`); `share_at` is called at most `max_runs` times."""
    low: float | None = None
    high: float | None = None
    runs = 0

    def probe(rate: float) -> None:
        nonlocal low, high, runs
        runs += 1
        if share_at(rate) >= target:
            low = rate
        else:
            high = rate

    rate = max(start, min_rate)
    probe(rate)
    for _ in range(MAX_BRACKET_STEPS):
        step = rate * 2 if high is None else max(rate / 2, min_rate)
        if (low is not None and high is not None) or runs >= max_runs or step == rate:
            break
        rate = step
        probe(rate)
    while (low is not None and high is not None and high > low * (1 + resolution)
           and runs < max_runs):
        probe(math.sqrt(low * high))
    return Crossing(low, high, runs)


def calibrate(share_at: Callable[[float], float], start: float, *,
              min_rate: float = 0.0) -> float:
    """The rate where a non-increasing met share crosses TARGET_MET_SHARE (see
    `find_crossing`): the final bracket's geometric middle."""
    found = find_crossing(share_at, TARGET_MET_SHARE, start, resolution=CALIBRATION_RESOLUTION,
                          max_runs=CALIBRATION_MAX_RUNS, min_rate=min_rate)
    if found.low is None or found.high is None:
        meets = found.high is None
        where, side = ("up to", "above") if meets else ("down to", "below")
        last = found.low if meets else found.high
        raise NoCrossing(f"the best met share at scale {CALIBRATION_SCALE:g} stays {side} "
                         f"{TARGET_MET_SHARE:.0%} {where} {last:.3g}", always_below=not meets)
    return math.sqrt(found.low * found.high)


def met_share(row: dict) -> float:
    """Met steps over every step of the run's workload: the simulator records rejected
    steps, steps of an ended session and steps never sent, all as not met."""
    return ratio(int(row["met"]), int(row["requests"]))


def best_met_share(rows: Sequence[dict]) -> float:
    return max(met_share(r) for r in rows)


@dataclass(frozen=True)
class Calibration:
    """L* of one (workload, cluster); rate None when no baseline reaches the target."""

    workload: str
    cluster: str
    duration_s: float
    seed: int
    rate: float | None
    policies: tuple[str, ...]  # the baselines whose best met share was bisected on
    note: str = ""  # why there is no rate

    def as_row(self) -> dict:
        return {"workload": self.workload, "cluster": self.cluster,
                "duration_s": self.duration_s, "seed": self.seed,
                "rate": "" if self.rate is None else self.rate,
                "policies": " ".join(self.policies), "note": self.note}

    @classmethod
    def from_row(cls, row: dict) -> Calibration:
        return cls(row["workload"], row["cluster"], float(row["duration_s"]), int(row["seed"]),
                   float(row["rate"]) if row["rate"] else None, tuple(row["policies"].split()),
                   row["note"])


def search_range(workload: str, cluster: str, seed: int,
                 setup: MatrixSetup) -> tuple[float, float]:
    """(start, min_rate) of a rate search: the per-engine first guess, and the lightest
    rate whose window holds about MIN_SEARCH_REQUESTS requests and, for agent sessions,
    MIN_SEARCH_SESSIONS sessions."""
    config = load_cluster_config(CLUSTERS[cluster])
    start = START_RATE_PER_ENGINE[workload] * len(config.engines())
    work = make_workload(workload, config, start, seed, setup)
    floor = MIN_SEARCH_REQUESTS / max(len(work.requests), 1)
    if work.graph is not None:
        sessions = {r.session_id for r in work.requests}
        floor = max(floor, MIN_SEARCH_SESSIONS / max(len(sessions), 1))
    return start, start * floor


def calibrate_pair(workload: str, cluster: str, setup: MatrixSetup, seed: int,
                   policies: Sequence[str]) -> Calibration:
    """L* by `policies`, then by every baseline when those stay under the target down
    to the lightest measurable rate (long prompts miss on weak GPUs even when idle,
    unless a baseline keeps them off those GPUs)."""
    start, min_rate = search_range(workload, cluster, seed, setup)

    def share_by(names: Sequence[str]) -> Callable[[float], float]:
        return lambda rate: best_met_share(run_cells(
            workload, cluster, rate, seed, setup, names, (CALIBRATION_SCALE,)))

    note = ""
    for names in dict.fromkeys((tuple(policies), BASELINES)):
        try:
            rate = calibrate(share_by(names), start, min_rate=min_rate)
            return Calibration(workload, cluster, setup.duration_s(workload), seed, rate, names)
        except NoCrossing as e:
            note = str(e)
            if not e.always_below:
                break
    return Calibration(workload, cluster, setup.duration_s(workload), seed, None, names, note)


def read_calibrations(path: Path) -> list[Calibration]:
    """The rows of calibration.csv in this format (older rows are left out)."""
    return [Calibration.from_row(r) for r in read_rows(path)
            if all(k in r and r[k] is not None for k in CALIBRATION_FIELDS)]


def reference_rates(out: Path, pairs: Sequence[tuple[str, str]], setup: MatrixSetup,
                    seed: int, policies: dict[str, tuple[str, ...]],
                    jobs: int) -> list[Calibration]:
    """L* per pair by its workload's `policies`, reusing calibration.csv rows of the same
    window, seed and policies (or of every baseline, where those fell back to them)."""
    path = out / "calibration.csv"
    kept = read_calibrations(path)
    path.unlink(missing_ok=True)
    append_rows(path, [c.as_row() for c in kept], CALIBRATION_FIELDS)
    known = {(c.workload, c.cluster): c for c in kept
             if (c.duration_s, c.seed) == (setup.duration_s(c.workload), seed)
             and c.policies in (policies[c.workload], BASELINES)}
    todo = [(*p, setup, seed, policies[p[0]]) for p in pairs if p not in known]
    for found in in_pool(calibrate_pair, todo, jobs, "calibrate L*", "pair"):
        append_rows(path, [found.as_row()], CALIBRATION_FIELDS)
        known[(found.workload, found.cluster)] = found
    return [known[p] for p in pairs]


# ---- units and resumption ------------------------------------------------------------------


def plan_units(calibrations: Sequence[Calibration],
               seeds: dict[str, Sequence[int]]) -> list[Unit]:
    """Every (load factor, seed) unit of each calibrated pair, seed-major."""
    return [Unit(c.workload, c.cluster, f, c.rate * f, s)
            for c in calibrations if c.rate is not None
            for s in seeds[c.cluster] for f in LOAD_FACTORS]


def pending_units(units: Sequence[Unit], cells: Sequence[dict]) -> list[Unit]:
    """The units `cells` holds no row of at their rate (a row at another rate was run
    against an earlier L*)."""
    rates: dict[tuple[str, str, float, int], set[float]] = defaultdict(set)
    for c in cells:
        rates[_cell_key(c)].add(float(c["rate"]))
    return [u for u in units
            if not any(math.isclose(r, u.rate, rel_tol=1e-9) for r in rates[u.key])]


def stale_cells(units: Sequence[Unit], cells: Sequence[dict]) -> list[dict]:
    """The rows of `units` at a rate other than theirs now."""
    by_key = {u.key: u for u in units}
    return [c for c in cells if _cell_key(c) in by_key
            and not math.isclose(float(c["rate"]), by_key[_cell_key(c)].rate, rel_tol=1e-9)]


def _cell_key(cell: dict) -> tuple[str, str, float, int]:
    return (cell["workload"], cell["cluster"], float(cell["load_factor"]), int(cell["seed"]))


def in_pool(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int, desc: str,
            unit: str) -> Iterator[Any]:
    """fn(*task) per task as each finishes, in `jobs` processes (in this one for 1),
    under a progress bar."""
    if jobs <= 1:
        yield from (fn(*task) for task in Progress(tasks, desc=desc, unit=unit))
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(fn, *task) for task in tasks]
        for future in Progress(as_completed(futures), total=len(futures), desc=desc,
                               unit=unit):
            yield future.result()


def run_matrix(out: Path, units: Sequence[Unit], setup: MatrixSetup, jobs: int) -> None:
    """Run the units cells.csv lacks, appending each as it finishes."""
    path = out / "cells.csv"
    cells = read_cells(path)
    if stale := stale_cells(units, cells):
        print(f"dropping {len(stale)} cells run at an earlier L*")
        path.unlink()
        append_rows(path, [c for c in cells if c not in stale], CELL_FIELDS)
    for rows in in_pool(run_unit, [(u, setup) for u in pending_units(units, cells)], jobs,
                        "agentic matrix", "unit"):
        append_rows(path, rows, CELL_FIELDS)


def read_cells(path: Path) -> list[dict]:
    return read_rows(path, numeric=("load_factor", "rate", "slo_scale", "goodput_rps"),
                     integer=("seed", "requests", "met"))


# ---- aggregation ----------------------------------------------------------------------


MetKey = tuple[str, str, float, float, int]  # (workload, cluster, load_factor, scale, seed)


def met_table(cells: Sequence[dict]) -> dict[MetKey, dict[str, tuple[int, int]]]:
    """(workload, cluster, load factor, scale, seed) -> policy -> (met, requests)."""
    out: dict[MetKey, dict[str, tuple[int, int]]] = defaultdict(dict)
    for c in cells:
        key = (c["workload"], c["cluster"], float(c["load_factor"]), float(c["slo_scale"]),
               int(c["seed"]))
        out[key][c["policy"]] = (int(c["met"]), int(c["requests"]))
    return out


def met_counts(results: dict[str, tuple[int, int]]) -> dict[str, int]:
    """policy -> met requests, from policy -> (met, requests)."""
    return {policy: met for policy, (met, _) in results.items()}


def best_baseline(score: dict[str, float]) -> str | None:
    """The baseline scoring highest (the earlier in CANDIDATE_BASELINES on a tie)."""
    ran = [b for b in CANDIDATE_BASELINES if b in score]
    return max(ran, key=lambda b: (score[b], -ran.index(b))) if ran else None


def most_common(names: Sequence[str]) -> str:
    """The name given most often (the first seen on a tie)."""
    return Counter(names).most_common(1)[0][0]


@dataclass(frozen=True)
class MatrixRow:
    """One (workload, cluster, load factor, scale) cell over its seeds."""

    workload: str
    cluster: str
    load_factor: float
    slo_scale: float
    seeds: tuple[int, ...]
    goodserve_share: tuple[float, ...]  # GoodServe's met / requests, per seed
    vs_best: tuple[float, ...]  # GoodServe met / best baseline met, per seed
    best: tuple[str, ...]  # the best baseline, per seed
    best_met: tuple[int, ...]  # the best baseline's met requests, per seed
    exact_vs_goodserve: tuple[float, ...]  # exact lengths met / GoodServe met, seeds with both
    collapse: tuple[float, ...]  # at 1.5x: GoodServe met here / at 1.0x, seeds with both
    # per GoodServe arm that ran ("goodserve@<arm>"): GoodServe met / the arm's met
    vs_arms: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # steps met per second, per seed: GoodServe's and the best baseline's (what a share
    # cannot say where every policy misses most steps)
    goodserve_goodput: tuple[float, ...] = ()
    best_goodput: tuple[float, ...] = ()

    @property
    def best_named(self) -> str:
        """The baseline best on most seeds."""
        return most_common(self.best)

    @property
    def noise(self) -> float | None:
        """The best baseline's seed-to-seed spread, (max - min) / mean of its met
        requests; None with one seed."""
        if len(self.best_met) < 2:
            return None
        return ratio(max(self.best_met) - min(self.best_met),
                     sum(self.best_met) / len(self.best_met))


def aggregate(cells: Sequence[dict]) -> list[MatrixRow]:
    """One row per (workload, cluster, load factor, scale), over the seeds where
    GoodServe and at least one baseline ran."""
    table = met_table(cells)
    seeds: dict[tuple[str, str, float, float], list[int]] = defaultdict(list)
    for (workload, cluster, factor, scale, seed), met in table.items():
        if GOODSERVE in met and best_baseline(met_counts(met)):
            seeds[(workload, cluster, factor, scale)].append(seed)
    goodputs: dict[MetKey, dict[str, float]] = defaultdict(dict)
    for c in cells:
        key = (c["workload"], c["cluster"], float(c["load_factor"]), float(c["slo_scale"]),
               int(c["seed"]))
        goodputs[key][c["policy"]] = float(c["goodput_rps"])
    return [_matrix_row(table, goodputs, key, sorted(seeds[key]))
            for key in sorted(seeds, key=_order)]


def _order(key: tuple[str, str, float, float]) -> tuple:
    workload, cluster, factor, scale = key
    return (*_pair_order((workload, cluster)), factor, scale)


def _pair_order(pair: tuple[str, str]) -> tuple:
    """Workloads, then clusters, in the order they are declared."""
    workload, cluster = pair
    return (_rank(workload, WORKLOADS), workload, _rank(cluster, list(CLUSTERS)), cluster)


def _rank(name: str, known: Sequence[str]) -> int:
    return known.index(name) if name in known else len(known)


def _matrix_row(table: dict[MetKey, dict[str, tuple[int, int]]],
                goodputs: dict[MetKey, dict[str, float]],
                key: tuple[str, str, float, float], seeds: Sequence[int]) -> MatrixRow:
    workload, cluster, factor, scale = key
    per_seed = [table[(*key, s)] for s in seeds]
    best = [best_baseline(met_counts(m)) or "" for m in per_seed]
    goodput = [goodputs[(*key, s)] for s in seeds]
    ours = [m[GOODSERVE][0] for m in per_seed]
    collapse: list[float] = []
    if factor == COLLAPSE_FACTORS[0]:
        for seed, met in zip(seeds, ours, strict=True):
            at_base = table.get((workload, cluster, COLLAPSE_FACTORS[1], scale, seed), {})
            if GOODSERVE in at_base:
                collapse.append(ratio(met, at_base[GOODSERVE][0]))
    return MatrixRow(
        workload, cluster, factor, scale, tuple(seeds),
        goodserve_share=tuple(ratio(*m[GOODSERVE]) for m in per_seed),
        vs_best=tuple(ratio(o, m[b][0]) for o, m, b in zip(ours, per_seed, best, strict=True)),
        best=tuple(best), best_met=tuple(m[b][0] for m, b in zip(per_seed, best, strict=True)),
        exact_vs_goodserve=tuple(ratio(m[EXACT][0], o)
                                 for o, m in zip(ours, per_seed, strict=True) if EXACT in m),
        collapse=tuple(collapse),
        vs_arms=tuple(
            (label.removeprefix(ARM_PREFIX),
             tuple(ratio(o, m[label][0]) for o, m in zip(ours, per_seed, strict=True)
                   if label in m))
            for label in dict.fromkeys(p for m in per_seed for p in m
                                       if p.startswith(ARM_PREFIX))),
        goodserve_goodput=tuple(g[GOODSERVE] for g in goodput),
        best_goodput=tuple(g[b] for g, b in zip(goodput, best, strict=True)))


# ---- report ----------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> list[str]:
    if not values:
        return ["", "", ""]
    return [f"{x:.3f}" for x in (sum(values) / len(values), min(values), max(values))]


def write_matrix_csv(path: Path, rows: Sequence[MatrixRow]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["workload", "cluster", "load_factor", "slo_scale", "seeds",
                         "goodserve_met_share", "vs_best_mean", "vs_best_min", "vs_best_max",
                         "best_baseline", "best_baselines", "best_baseline_noise",
                         "exact_vs_goodserve_mean", "exact_vs_goodserve_min",
                         "exact_vs_goodserve_max", "collapse_mean", "collapse_min",
                         "collapse_max"])
        for r in rows:
            writer.writerow([r.workload, r.cluster, r.load_factor, r.slo_scale,
                             " ".join(map(str, r.seeds)), _stats(r.goodserve_share)[0],
                             *_stats(r.vs_best), r.best_named, " ".join(r.best),
                             "" if r.noise is None else f"{r.noise:.3f}",
                             *_stats(r.exact_vs_goodserve), *_stats(r.collapse)])


def _text(values: Sequence[float]) -> str:
    return mean_range_text(values) if values else "-"


def _calibration_lines(calibrations: Sequence[Calibration]) -> list[str]:
    lines = [f"Reference loads L* (the best of the named baselines meets "
             f"{TARGET_MET_SHARE:.0%} at scale {CALIBRATION_SCALE:g}; calibration seed, "
             "window):", ""]
    for c in calibrations:
        what = (f"{c.rate:.3g} {rate_unit(c.workload)}" if c.rate is not None
                else f"skipped: {c.note}")
        lines.append(f"- {c.workload} on {c.cluster}: {what} ({', '.join(c.policies)}; "
                     f"seed {c.seed}, {c.duration_s:g} s)")
    return lines


def write_markdown(path: Path, rows: Sequence[MatrixRow],
                   calibrations: Sequence[Calibration]) -> None:
    lines = ["# Agentic matrix (simulator)", "",
             "Per cell: mean [min, max] over seeds. GoodServe met / best baseline met (each "
             "seed's best baseline; the one best on most seeds is named), the noise (the best "
             "baseline's seed-to-seed spread, (max - min) / mean of its met requests: a "
             "ratio within it of 1 is a tie), exact lengths / GoodServe, and the goodput "
             "(steps met per second, the mean over seeds) of GoodServe and of each seed's "
             "best baseline.", "",
             *_calibration_lines(calibrations)]
    for workload, cluster in dict.fromkeys((r.workload, r.cluster) for r in rows):
        mine = [r for r in rows if (r.workload, r.cluster) == (workload, cluster)]
        lines += ["", f"## {workload}, {cluster} cluster", "",
                  "| load | scale | GoodServe met | GoodServe / best | best baseline | noise | "
                  "exact / GoodServe | goodput, GoodServe / best |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mine:
            noise = "-" if r.noise is None else f"{r.noise:.2f}"
            goodput = " / ".join(f"{sum(g) / len(g):.3g}"
                                 for g in (r.goodserve_goodput, r.best_goodput))
            lines.append(f"| {r.load_factor:g}x | {r.slo_scale:g} | "
                         f"{sum(r.goodserve_share) / len(r.goodserve_share):.0%} | "
                         f"{_text(r.vs_best)} | {r.best_named} | {noise} | "
                         f"{_text(r.exact_vs_goodserve)} | {goodput} |")
        arms = list(dict.fromkeys(arm for r in mine for arm, _ in r.vs_arms))
        if arms:
            lines += ["", "GoodServe / GoodServe with one setting changed (token-ids, kv: "
                      "every move forced to that path, against choosing per move; kept-kv: "
                      "each session's KV kept through its tool waits):", "",
                      "| load | scale | " + " | ".join(f"/ {a}" for a in arms) + " |",
                      "|---|---|" + "---|" * len(arms)]
            for r in mine:
                by_arm = dict(r.vs_arms)
                lines.append(f"| {r.load_factor:g}x | {r.slo_scale:g} | " + " | ".join(
                    _text(by_arm.get(a, ())) for a in arms) + " |")
        collapse = [f"scale {r.slo_scale:g}: {_text(r.collapse)}" for r in mine if r.collapse]
        if collapse:
            lines += ["", f"GoodServe met at {COLLAPSE_FACTORS[0]:g}x load / at "
                      f"{COLLAPSE_FACTORS[1]:g}x: " + ", ".join(collapse)]
    path.write_text("\n".join(lines) + "\n")


def write_heatmaps(path: Path, rows: Sequence[MatrixRow]) -> None:
    """GoodServe / best baseline: a panel per (workload, cluster), rows load factor,
    columns scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(dict.fromkeys(r.workload for r in rows))
    clusters = sorted({r.cluster for r in rows}, key=lambda c: (_rank(c, list(CLUSTERS)), c))
    if not rows:
        return
    fig, axes = plt.subplots(len(workloads), len(clusters), squeeze=False,
                             layout="constrained",
                             figsize=(3.6 * len(clusters) + 1.2, 2.6 * len(workloads) + 0.4))
    for (i, workload), (j, cluster) in ((w, c) for w in enumerate(workloads)
                                         for c in enumerate(clusters)):
        grid = np.full((len(LOAD_FACTORS), len(SCALES)), np.nan)
        for r in rows:
            if (r.workload, r.cluster) == (workload, cluster):
                values = [min(v, 10.0) for v in r.vs_best]
                grid[LOAD_FACTORS.index(r.load_factor), SCALES.index(r.slo_scale)] = (
                    sum(values) / len(values))
        ax = axes[i][j]
        image = draw_ratio_grid(ax, grid, [f"{s:g}" for s in SCALES],
                                [f"{f:g}x" for f in LOAD_FACTORS])
        ax.set_title(f"{workload}, {cluster}", fontsize=9)
        ax.set_xlabel("SLO scale")
        ax.set_ylabel("load / L*")
    fig.colorbar(image, ax=axes, label="log2 (GoodServe met / best baseline met)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_attainment_plot(path: Path, cells: Sequence[dict]) -> None:
    """Met share against load: a row of panels per (workload, cluster), one panel per
    SLO scale; GoodServe thick, exact lengths dashed, each baseline thin; the mean over
    seeds (GoodServe's [min, max] shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share: dict[tuple[str, str, float, str, float], list[float]] = defaultdict(list)
    for c in cells:
        share[(c["workload"], c["cluster"], float(c["slo_scale"]), c["policy"],
               float(c["load_factor"]))].append(ratio(int(c["met"]), int(c["requests"])))
    pairs = sorted({k[:2] for k in share}, key=_pair_order)
    if not pairs:
        return
    fig, axes = plt.subplots(len(pairs), len(SCALES), squeeze=False, sharey=True,
                             layout="constrained",
                             figsize=(2.8 * len(SCALES), 2.0 * len(pairs) + 0.5))
    for (i, pair), (j, scale) in ((p, s) for p in enumerate(pairs) for s in enumerate(SCALES)):
        ax = axes[i][j]
        for policy in dict.fromkeys(k[3] for k in share if k[:3] == (*pair, scale)):
            loads = sorted(k[4] for k in share if k[:4] == (*pair, scale, policy))
            runs = [share[(*pair, scale, policy, f)] for f in loads]
            means = [sum(r) / len(r) for r in runs]
            if policy == GOODSERVE:
                ax.plot(loads, means, color="black", linewidth=2.2, label="GoodServe", zorder=3)
                ax.fill_between(loads, [min(r) for r in runs], [max(r) for r in runs],
                                color="black", alpha=0.15, linewidth=0)
            elif policy in CANDIDATE_BASELINES or policy == EXACT:
                ax.plot(loads, means, linewidth=1.0, linestyle="--" if policy == EXACT else "-",
                        label="exact lengths" if policy == EXACT else policy)
        ax.axhline(CAPACITY_SHARE, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(LOAD_FACTORS, [f"{f:g}" for f in LOAD_FACTORS])
        ax.set_title(f"{pair[0]}, {pair[1]}, scale {scale:g}", fontsize=8)
        ax.set_xlabel("load / L*", fontsize=8)
        if j == 0:
            ax.set_ylabel("steps met")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=6, fontsize=7)
    save_compact_png(fig, path)
    plt.close(fig)


def write_report(out: Path, calibrations: Sequence[Calibration]) -> list[MatrixRow]:
    cells = read_cells(out / "cells.csv")
    rows = aggregate(cells)
    write_matrix_csv(out / "matrix.csv", rows)
    write_markdown(out / "matrix.md", rows, calibrations)
    write_heatmaps(out / "matrix.png", rows)
    write_attainment_plot(out / "attainment.png", cells)
    return rows


# ---- capacity ----------------------------------------------------------------------------


def rate_unit(workload: str) -> str:
    return "req/s" if workload == "mooncake" else "sessions/s"


@dataclass(frozen=True)
class Capacity:
    """A policy's capacity at one SLO scale on one seed: the highest arrival rate tried at
    which it met `share` of the steps."""

    workload: str
    cluster: str
    duration_s: float
    seed: int
    policy: str
    slo_scale: float
    capacity: float  # 0 when no rate tried, down to the lightest measurable, met the share
    lowest_failing_rate: float | None  # None when every rate tried met: a lower bound
    runs: int  # simulator runs the search took
    share: float = CAPACITY_SHARE  # of the steps on time

    @property
    def coarse(self) -> bool:
        """The run cap stopped the search with its bracket wider than CAPACITY_RESOLUTION."""
        return (self.capacity > 0 and self.lowest_failing_rate is not None
                and self.lowest_failing_rate > self.capacity * (1 + CAPACITY_RESOLUTION))

    @property
    def key(self) -> tuple[str, str, int, str, float]:
        """The search that found it: one per (workload, cluster, seed, policy, share)."""
        return (self.workload, self.cluster, self.seed, self.policy, self.share)

    def as_row(self) -> dict:
        return {"workload": self.workload, "cluster": self.cluster,
                "duration_s": self.duration_s, "seed": self.seed, "policy": self.policy,
                "slo_scale": self.slo_scale, "capacity": self.capacity,
                "lowest_failing_rate": ("" if self.lowest_failing_rate is None
                                        else self.lowest_failing_rate),
                "runs": self.runs, "share": self.share}

    @classmethod
    def from_row(cls, row: dict) -> Capacity:
        """A capacity.csv row (rows written before the share was recorded are 90%'s)."""
        failing = row["lowest_failing_rate"]
        return cls(row["workload"], row["cluster"], float(row["duration_s"]), int(row["seed"]),
                   row["policy"], float(row["slo_scale"]), float(row["capacity"]),
                   float(failing) if failing else None, int(row["runs"]),
                   float(row.get("share") or CAPACITY_SHARE))


def capacity_searches(share_at: Callable[[float, float], float], start: float, *,
                      target: float = CAPACITY_SHARE, min_rate: float = 0.0,
                      max_runs: int = CAPACITY_MAX_RUNS) -> list[tuple[float, Crossing]]:
    """(scale, where `share_at(rate, scale)` crosses `target`) per CAPACITY_SCALES,
    tightest first; each search starts at the capacity found at the scale before it (a
    looser deadline seldom lowers it), so its bracket takes one or two runs."""
    found = []
    for scale in CAPACITY_SCALES:
        crossing = find_crossing(lambda rate, scale=scale: share_at(rate, scale),
                                 target, start, resolution=CAPACITY_RESOLUTION,
                                 max_runs=max_runs, min_rate=min_rate)
        found.append((scale, crossing))
        start = crossing.low or start
    return found


def policy_capacities(workload: str, cluster: str, seed: int, policy: str,
                      setup: MatrixSetup, share: float = CAPACITY_SHARE) -> list[Capacity]:
    """`policy`'s capacity at `share` of the steps at every CAPACITY_SCALES on one seed,
    searched from the workload's per-engine first guess."""
    start, min_rate = search_range(workload, cluster, seed, setup)
    arm = next((a for a in setup.arms if a.label == policy), None)
    alone = replace(setup, arms=(arm,) if arm else ())
    policies = () if arm else (policy,)

    def share_at(rate: float, scale: float) -> float:
        (row,) = run_cells(workload, cluster, rate, seed, alone, policies, (scale,))
        return met_share(row)

    return [Capacity(workload, cluster, setup.duration_s(workload), seed, policy, scale,
                     crossing.low or 0.0, crossing.high, crossing.runs, share)
            for scale, crossing in capacity_searches(share_at, start, target=share,
                                                     min_rate=min_rate)]


def read_capacities(path: Path) -> list[Capacity]:
    return [Capacity.from_row(r) for r in read_rows(path)]


def run_capacities(out: Path, pairs: Sequence[tuple[str, str]], seeds: Sequence[int],
                   setup: MatrixSetup, jobs: int, resume: bool) -> None:
    """Search every (pair, seed, policy, share) that capacity.csv lacks at the setup's
    windows (all of them unless `resume`), appending each as it finishes."""
    path = out / "capacity.csv"
    kept = ([c for c in read_capacities(path) if c.duration_s == setup.duration_s(c.workload)]
            if resume else [])
    path.unlink(missing_ok=True)
    append_rows(path, [c.as_row() for c in kept], CAPACITY_FIELDS)
    done = {c.key for c in kept}
    tasks = [(workload, cluster, seed, policy, setup, share) for share in CAPACITY_SHARES
             for workload, cluster in pairs for seed in seeds
             for policy in (*setup.policies, *(a.label for a in setup.arms))
             if (workload, cluster, seed, policy, share) not in done]
    for found in in_pool(policy_capacities, tasks, jobs, "capacity", "search"):
        append_rows(path, [c.as_row() for c in found], CAPACITY_FIELDS)


@dataclass(frozen=True)
class CapacityRatio:
    """GoodServe's capacity over the best baseline's at one (workload, cluster, scale,
    share)."""

    workload: str
    cluster: str
    slo_scale: float
    share: float
    seeds: tuple[int, ...]
    # per seed; None where no baseline met the share even at the lightest rate tried
    # (nothing to divide by)
    vs_best: tuple[float | None, ...]
    best: tuple[str, ...]  # the baseline of highest capacity, per seed

    @property
    def measured(self) -> tuple[float, ...]:
        """The seeds' ratios where a baseline met the share."""
        return tuple(v for v in self.vs_best if v is not None)

    @property
    def mean(self) -> float | None:
        return sum(self.measured) / len(self.measured) if self.measured else None

    @property
    def best_named(self) -> str:
        """The baseline best on most seeds."""
        return most_common(self.best)


def capacity_ratios(capacities: Sequence[Capacity]) -> list[CapacityRatio]:
    """One row per (workload, cluster, scale, share), over the seeds where GoodServe and
    at least one baseline were searched."""
    table: dict[tuple[str, str, float, float], dict[int, dict[str, float]]] = defaultdict(
        lambda: defaultdict(dict))
    for c in capacities:
        table[(c.workload, c.cluster, c.slo_scale, c.share)][c.seed][c.policy] = c.capacity
    rows = []
    for key in sorted(table, key=lambda k: (*_pair_order(k[:2]), -k[3], k[2])):
        by_seed = {s: caps for s, caps in sorted(table[key].items())
                   if GOODSERVE in caps and best_baseline(caps)}
        if by_seed:
            best = {s: best_baseline(caps) or "" for s, caps in by_seed.items()}
            rows.append(CapacityRatio(
                *key, tuple(by_seed),
                vs_best=tuple(ratio(caps[GOODSERVE], caps[best[s]]) if caps[best[s]] > 0
                              else None for s, caps in by_seed.items()),
                best=tuple(best.values())))
    return rows


def pair_standing(ratios: Sequence[CapacityRatio]) -> list[tuple[tuple[str, str], float]]:
    """Per (workload, cluster): GoodServe / best baseline at CAPACITY_SHARE as the mean
    over its scales of each scale's mean over seeds (the seeds where a baseline met the
    share); lowest first."""
    means: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in ratios:
        if r.share == CAPACITY_SHARE and r.mean is not None:
            means[(r.workload, r.cluster)].append(r.mean)
    return sorted(((pair, sum(m) / len(m)) for pair, m in means.items()),
                  key=lambda item: item[1])


def _capacity_text(found: Sequence[Capacity]) -> str:
    """Mean [min, max] of the capacities, marked >= when one is a lower bound."""
    values = [c.capacity for c in found]
    mean = sum(values) / len(values)
    text = (f"{mean:.3g}" if len(values) == 1
            else f"{mean:.3g} [{min(values):.3g}, {max(values):.3g}]")
    return (">= " if any(c.lowest_failing_rate is None for c in found) else "") + text


def _capacity_summary_lines(ratios: Sequence[CapacityRatio]) -> list[str]:
    lines = ["GoodServe's capacity / the best baseline's (each seed's best baseline; the one "
             "best on most seeds is named), mean [min, max] over the seeds where a baseline "
             "met the share; -: no baseline met it even at the lightest rate tried, so there "
             "is nothing to divide by (GoodServe's own capacity is in the tables below):", "",
             "| workload, cluster | share | scale | GoodServe / best | per seed | "
             "best baseline |", "|---|---|---|---|---|---|"]
    for r in ratios:
        per_seed = ", ".join("-" if v is None else f"{v:.2f}" for v in r.vs_best)
        lines.append(f"| {r.workload}, {r.cluster} | {r.share:.0%} | {r.slo_scale:g} | "
                     f"{_text(r.measured)} | {per_seed} | {r.best_named} |")
    if standing := pair_standing(ratios):
        (weak, weak_ratio), (strong, strong_ratio) = standing[0], standing[-1]
        lines += ["", f"Weakest pair: {weak[0]} on {weak[1]}, {weak_ratio:.2f}; best pair: "
                  f"{strong[0]} on {strong[1]}, {strong_ratio:.2f} (GoodServe / best "
                  "baseline, the mean over scales of each scale's mean over seeds)."]
    return lines


def _capacity_pair_lines(found: Sequence[Capacity]) -> list[str]:
    """Every policy's capacity per scale on one (workload, cluster)."""
    first = found[0]
    scales = sorted({c.slo_scale for c in found})
    order = (GOODSERVE, EXACT, *CANDIDATE_BASELINES)
    policies = sorted({c.policy for c in found}, key=lambda p: (_rank(p, order), p))
    seeds = " ".join(map(str, sorted({c.seed for c in found})))
    lines = ["", f"## {first.workload}, {first.cluster} cluster, {first.share:.0%} of steps "
             f"({rate_unit(first.workload)}; seeds {seeds}; {first.duration_s:g} s windows)",
             "",
             "| policy | " + " | ".join(f"scale {s:g}" for s in scales) + " | runs |",
             "|---|" + "---|" * len(scales) + "---|"]
    for policy in policies:
        mine = [c for c in found if c.policy == policy]
        cells = [_capacity_text([c for c in mine if c.slo_scale == s]) if any(
            c.slo_scale == s for c in mine) else "-" for s in scales]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {sum(c.runs for c in mine)} |")
    return lines


def write_capacity_markdown(path: Path, capacities: Sequence[Capacity]) -> None:
    lines = ["# Capacity (simulator)", "",
             "A policy's capacity is the highest arrival rate at which at least "
             f"{' (or '.join(f'{s:.0%}' for s in CAPACITY_SHARES)}) of the steps meet their "
             "deadline; rejected steps and steps "
             "never sent (their session ended, or the run stopped) count as misses. Per "
             "policy, seed and SLO scale: a bracket by doubling or halving the rate, then "
             f"geometric bisection to {CAPACITY_RESOLUTION:.0%} of the rate, at most "
             f"{CAPACITY_MAX_RUNS} simulator runs; the highest rate that met is reported. "
             ">=: on some seed every rate tried met (a lower bound); 0: no rate tried met, "
             f"down to the lightest whose window holds about {MIN_SEARCH_REQUESTS} requests "
             f"and, of agent sessions, {MIN_SEARCH_SESSIONS} sessions.",
             ""]
    if coarse := sum(c.coarse for c in capacities):
        lines += [f"{coarse} of {len(capacities)} searches stopped at the run cap with the "
                  f"bracket wider than {CAPACITY_RESOLUTION:.0%} (capacity.csv: capacity and "
                  "lowest_failing_rate).", ""]
    lines += _capacity_summary_lines(capacity_ratios(capacities))
    pairs = sorted({(c.workload, c.cluster) for c in capacities}, key=_pair_order)
    for pair in pairs:
        for share in sorted({c.share for c in capacities}, reverse=True):
            if found := [c for c in capacities
                         if (c.workload, c.cluster) == pair and c.share == share]:
                lines += _capacity_pair_lines(found)
    path.write_text("\n".join(lines) + "\n")


# ---- command line ------------------------------------------------------------------------


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if bad := [n for n in names if n not in known]:
        raise ValueError(f"unknown {what} {bad[0]!r}; known: {', '.join(known)}")
    return names


def _durations(text: str, defaults: dict[str, float] = DURATION_S) -> dict[str, float]:
    """`defaults`, overridden by `text`: one number (every workload) or name=seconds."""
    durations = dict(defaults)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for part in parts:
        name, _, seconds = part.rpartition("=")
        if not name and len(parts) > 1:
            raise ValueError(f"duration {part!r}: give workload=seconds for each workload")
        for workload in _names(name, WORKLOADS, "workload") if name else WORKLOADS:
            try:
                durations[workload] = float(seconds)
            except ValueError:
                raise ValueError(f"duration {part!r}: {seconds!r} is not a number") from None
            if not durations[workload] > 0:
                raise ValueError(f"duration {part!r}: the window must be positive")
    return durations


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def agentic(
    out: Annotated[Path, typer.Option()] = REPO / "results" / "agentic",
    trace: Annotated[Path, typer.Option(help="Mooncake conversation trace (JSONL)")] = TRACE,
    only_workloads: Annotated[str, typer.Option()] = ",".join(WORKLOADS),
    only_clusters: Annotated[str, typer.Option()] = ",".join(CLUSTERS),
    seeds: Annotated[str, typer.Option(help="reported seeds on the small cluster")] = "0,1,2",
    large_seeds: Annotated[str, typer.Option(help="reported seeds on the large cluster")] = "0",
    calibration_seed: Annotated[int, typer.Option(
        help="seed of the L* search; must not be a reported seed")] = CALIBRATION_SEED,
    policies: Annotated[str, typer.Option(
        help="policies per unit or capacity search; the reports need goodserve and a "
        "baseline (default: every policy; with --capacity, goodserve and the baselines)")
    ] = "",
    calibration_policies: Annotated[str, typer.Option(
        help="baselines whose best met share L* is bisected on, for every workload "
        "(default: " + "; ".join(f"{w} {','.join(p)}" for w, p in
                                 CALIBRATION_POLICIES.items()) + ")")
    ] = "",
    duration: Annotated[str, typer.Option(help=DURATION_HELP)] = "",
    jobs: Annotated[int, typer.Option(
        help="units, or capacity searches, simulated at once (processes)")] = 2,
    resume: Annotated[bool, typer.Option(
        "--resume", help="keep --out/calibration.csv and cells.csv (capacity.csv with "
        "--capacity); run only what they lack")
    ] = False,
    report_only: Annotated[bool, typer.Option(
        "--report-only",
        help="rewrite matrix.* from --out/cells.csv and calibration.csv (capacity.md from "
        "capacity.csv with --capacity), running nothing")
    ] = False,
    move_paths: Annotated[str, typer.Option(
        help="also run GoodServe with every move forced to these paths (token-ids, kv), "
        "against its default of choosing per move")] = "",
    keep_session_kv: Annotated[bool, typer.Option(
        "--keep-session-kv", help="also run GoodServe with each session's KV kept on its "
        "engine through the tool waits it expects (cluster.keep_session_kv)")] = False,
    capacity: Annotated[bool, typer.Option(
        "--capacity",
        help=f"instead of the matrix, find each policy's capacity (the highest rate at which "
        f"{CAPACITY_SHARE:.0%} of steps meet their deadline) at scales "
        f"{', '.join(f'{s:g}' for s in CAPACITY_SCALES)}; writes --out/capacity.csv and "
        "capacity.md (--resume keeps capacity.csv)")] = False,
    capacity_seeds: Annotated[str, typer.Option(
        help="seeds of --capacity, on every cluster")] = ",".join(map(str, CAPACITY_SEEDS)),
) -> int:
    """Calibrate L* per (workload, cluster), run the matrix, write the report; with
    --capacity, search each policy's capacity instead."""
    try:
        workloads = _names(only_workloads, WORKLOADS, "workload")
        clusters = _names(only_clusters, list(CLUSTERS), "cluster")
        chosen = (_names(policies, POLICIES, "policy")
                  or list(CAPACITY_POLICIES if capacity else POLICIES))
        calibrators = ({w: tuple(_names(calibration_policies, BASELINES, "baseline"))
                        for w in WORKLOADS} if calibration_policies
                       else dict(CALIBRATION_POLICIES))
        reported = {"small": _seeds(seeds), "large": _seeds(large_seeds)}
        searched = _seeds(capacity_seeds)
        durations = _durations(duration)
        arms = [GoodServeArm.forced_moves(MoveRule(p))
                for p in _names(move_paths, [r.value for r in MoveRule
                                             if r is not MoveRule.CHEAPER], "move path")]
        arms += [GoodServeArm.kept_session_kv()] if keep_session_kv else []
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if calibration_seed in {*reported["small"], *reported["large"]}:
        print(f"error: the calibration seed {calibration_seed} is a reported seed")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if capacity:
        return capacity_command(out, [(w, c) for w in workloads for c in clusters],
                                MatrixSetup(durations, trace, tuple(chosen), tuple(arms)),
                                searched,
                                jobs=jobs, resume=resume, report_only=report_only)
    if report_only:
        latest = {(c.workload, c.cluster): c
                  for c in read_calibrations(out / "calibration.csv")}
        write_report(out, list(latest.values()))
        print(f"wrote {out}/matrix.md, matrix.csv, matrix.png, attainment.png")
        return 0
    if not resume:
        for name in ("calibration.csv", "cells.csv"):
            (out / name).unlink(missing_ok=True)
    setup = MatrixSetup(durations, trace, tuple(chosen), tuple(arms))
    pairs = with_trace([(w, c) for w in workloads for c in clusters], trace)
    calibrations = reference_rates(out, pairs, setup, calibration_seed, calibrators, jobs)
    for c in calibrations:
        if c.rate is None:
            print(f"skipping {c.workload} on {c.cluster}: {c.note}")
    run_matrix(out, plan_units(calibrations, reported), setup, jobs)
    write_report(out, calibrations)
    print(f"wrote {out}/cells.csv, matrix.md, matrix.csv, matrix.png, attainment.png")
    return 0


def with_trace(pairs: Sequence[tuple[str, str]], trace: Path) -> list[tuple[str, str]]:
    """`pairs`, less Mooncake's (with a message) when its trace is absent."""
    if not trace.is_file() and any(w == "mooncake" for w, _ in pairs):
        print(f"skipping mooncake: the trace {trace} is absent")
        return [(w, c) for w, c in pairs if w != "mooncake"]
    return list(pairs)


def capacity_command(out: Path, pairs: Sequence[tuple[str, str]], setup: MatrixSetup,
                     seeds: Sequence[int], *, jobs: int, resume: bool,
                     report_only: bool) -> int:
    """--capacity: search what capacity.csv lacks (nothing with `report_only`), then
    write capacity.md from it."""
    if not report_only:
        run_capacities(out, with_trace(pairs, setup.trace), seeds, setup, jobs, resume)
    write_capacity_markdown(out / "capacity.md", read_capacities(out / "capacity.csv"))
    print(f"wrote {out}/capacity.csv, capacity.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(agentic, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
