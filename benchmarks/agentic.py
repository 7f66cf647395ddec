"""Agentic matrix (simulator): GoodServe against the baselines users deploy, on the
traffic it exists for.

Setup. Workloads: `mooncake`, the Mooncake conversation trace with its own lengths and
prefix blocks (ContentMode.TRACE; --trace, default ../shared/data/traces/ from the
repository root, skipped with a message when absent), stretched to the rate (req/s),
each seed a window (--duration) at its own seeded offset in the stretched trace (so seeds
see different conversations, and the trace's opening burst is no likelier than any
other part); `coding-agent` and `chat-agent`, closed-loop session presets with Poisson
session arrivals (rate in sessions/s). Clusters: `small` (configs/paper-4gpu.yaml) and
`large` (configs/mixed-16gpu.yaml, sixteen engines of four kinds). SLO = scale x solo
time on an A800 (an agent step's context counted as cached).

Load. Per (workload, cluster), the reference rate L* is where the best calibration
baseline (--calibration-policies; by default round-robin, least-request and
prefix-cache, and on coding-agent Preble and Llumnix) stops meeting 80% of requests at
SLO scale 2: a bracket by doubling or halving from a
per-engine starting rate, then 6 geometric bisections, on a calibration seed (100) that
is never reported. A rate whose window holds fewer than 50 requests is too coarse to
bisect on; if the cheap baselines are still under 80% there, every baseline is tried,
and a pair that no baseline brings to 80% is skipped with the reason (Mooncake on the
small cluster: its long prompts miss scale 2 on the A40 and V100 even when idle, the
best baseline meeting 60-74% from 0.11 to 1.2 req/s). The matrix runs 0.5, 0.8, 1.0
and 1.5 x L*; each (workload, cluster, load, seed) unit runs every policy (GoodServe,
GoodServe with exact lengths, every registered baseline) at scales 1, 1.5, 2 and 3.
Seeds: 0, 1, 2 on small, 0 on large.

Windows (--duration): 500 s of arrivals for Mooncake and chat-agent, 20,000 s for
coding-agent. Coding sessions run for minutes with contexts of half the model's limit:
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
load) and matrix.png (GoodServe / best baseline heat maps per workload and cluster).
--move-paths token-ids,kv runs GoodServe again with every move forced to each path
(cells "goodserve@token-ids", "goodserve@kv"); matrix.md then adds GoodServe, which
chooses each move's path, over each forced run.
Usage: python -m benchmarks.agentic [--jobs 2] [--resume] [--only-clusters small]
       [--only-workloads chat-agent] [--duration coding-agent=20000]
       [--policies goodserve,round-robin] [--move-paths token-ids,kv]
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

from app.config import load_cluster_config
from app.experiments.replay import ReplaySpec, build_workload, context_limit_of, run_replay
from app.routing.move_path import MoveRule
from app.routing.registry import PolicyKind, RoutingOptions
from app.workload import (
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
)
from predictor.progress import Progress

if TYPE_CHECKING:
    from app.config import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOADS = ("mooncake", "coding-agent", "chat-agent")
CLUSTERS = {"small": REPO / "configs" / "paper-4gpu.yaml",
            "large": REPO / "configs" / "mixed-16gpu.yaml"}
LOAD_FACTORS = (0.5, 0.8, 1.0, 1.5)
COLLAPSE_FACTORS = (1.5, 1.0)  # GoodServe's met at the first load over its met at the second
SCALES = (1.0, 1.5, 2.0, 3.0)
# arrivals per run, per workload: coding-agent sessions run for minutes, hold long
# contexts and arrive ~50x less often than chat sessions (see the module docstring)
DURATION_S = {"mooncake": 500.0, "coding-agent": 20000.0, "chat-agent": 500.0}
DURATION_HELP = ("arrival window per run, s: one number for every workload, or "
                 "workload=seconds pairs (default: "
                 + ", ".join(f"{w} {d:g}" for w, d in DURATION_S.items()) + ")")
CALIBRATION_SCALE = 2.0
TARGET_MET_SHARE = 0.8
CALIBRATION_SEED = 100
CALIBRATION_STEPS = 6
MIN_CALIBRATION_REQUESTS = 50  # a met share over fewer requests is too coarse to bisect on
GOODSERVE, EXACT = PolicyKind.GOODSERVE.value, PolicyKind.GOODSERVE_EXACT.value
# the baselines users deploy; llm-d, session-affinity and dynamo-kv run where the
# policy registry has them (membership in PolicyKind), and count as baselines in any case
CANDIDATE_BASELINES = ("round-robin", "least-request", "prefix-cache", "preble", "llumnix",
                       "slo-pack", "llm-d", "session-affinity", "dynamo-kv")
BASELINES = tuple(n for n in CANDIDATE_BASELINES if n in {k.value for k in PolicyKind})
POLICIES = (GOODSERVE, EXACT, *BASELINES)
# the baselines L* is bisected on, per workload: the cheap ones, except on coding-agent,
# where over a long window they never meet 80% at scale 2 (they spread a session's
# steps over GPUs that must recompute its context) and the strongest two set the load
CHEAP_CALIBRATION = ("round-robin", "least-request", "prefix-cache")
CALIBRATION_POLICIES = {"mooncake": CHEAP_CALIBRATION, "coding-agent": ("preble", "llumnix"),
                        "chat-agent": CHEAP_CALIBRATION}
# a first guess of L* per engine, where the bracket search starts (req/s or sessions/s)
START_RATE_PER_ENGINE = {"mooncake": 0.3, "coding-agent": 0.002, "chat-agent": 0.2}
CELL_FIELDS = ["workload", "cluster", "load_factor", "rate", "seed", "policy", "slo_scale",
               "requests", "met", "goodput_rps"]
CALIBRATION_FIELDS = ["workload", "cluster", "duration_s", "seed", "rate", "policies", "note"]


@dataclass(frozen=True)
class MatrixSetup:
    """What every worker needs besides its unit."""

    durations_s: dict[str, float]  # arrival window of each workload's units and calibration
    trace: Path  # the Mooncake conversation trace
    policies: tuple[str, ...]  # run on every unit
    # GoodServe again with its moves forced to each of these paths (cells "goodserve@kv")
    move_paths: tuple[MoveRule, ...] = ()

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
    cells = run_replay(spec, work)
    for rule in setup.move_paths:
        forced = replace(spec, cluster=config.model_copy(update={"move_path": rule}),
                         policies=(PolicyKind.GOODSERVE,))
        cells += [c.renamed(move_path_label(rule)) for c in run_replay(forced, work)]
    return [{"policy": c.policy, "slo_scale": c.slo_scale, "requests": c.summary["requests"],
             "met": c.summary["met"], "goodput_rps": c.summary["goodput_rps"]} for c in cells]


def move_path_label(rule: MoveRule) -> str:
    """The cells of GoodServe with every move forced to `rule`'s path."""
    return f"{GOODSERVE}@{rule.value}"


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


def bracket(share_at: Callable[[float], float], start: float, *, min_rate: float = 0.0,
            max_steps: int = 8) -> tuple[float, float]:
    """(low, high), at most a factor 2 apart, with share(low) >= TARGET_MET_SHARE >
    share(high): doubling from `start` while the target is met, halving while it is
    not, never below `min_rate`."""
    rate = max(start, min_rate)
    meets = share_at(rate) >= TARGET_MET_SHARE
    for _ in range(max_steps):
        step = rate * 2 if meets else max(rate / 2, min_rate)
        if step == rate:
            break
        if (share_at(step) >= TARGET_MET_SHARE) != meets:
            return (rate, step) if meets else (step, rate)
        rate = step
    where = "up to" if meets else "down to"
    side = "above" if meets else "below"
    raise NoCrossing(f"the best met share at scale {CALIBRATION_SCALE:g} stays {side} "
                     f"{TARGET_MET_SHARE:.0%} {where} {rate:.3g}", always_below=not meets)


def calibrate(share_at: Callable[[float], float], start: float, *, min_rate: float = 0.0,
              steps: int = CALIBRATION_STEPS) -> float:
    """The rate where a non-increasing met share crosses TARGET_MET_SHARE: a bracket
    (see `bracket`), then `steps` geometric bisections; the bracket's geometric middle."""
    low, high = bracket(share_at, start, min_rate=min_rate)
    for _ in range(steps):
        middle = math.sqrt(low * high)
        if share_at(middle) >= TARGET_MET_SHARE:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def best_met_share(rows: Sequence[dict]) -> float:
    return max(ratio(int(r["met"]), int(r["requests"])) for r in rows)


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


def calibrate_pair(workload: str, cluster: str, setup: MatrixSetup, seed: int,
                   policies: Sequence[str]) -> Calibration:
    """L* by `policies`, then by every baseline when those stay under the target down
    to the lightest measurable rate (long prompts miss on weak GPUs even when idle,
    unless a baseline keeps them off those GPUs)."""
    config = load_cluster_config(CLUSTERS[cluster])
    start = START_RATE_PER_ENGINE[workload] * len(config.engines())
    num_requests = len(make_workload(workload, config, start, seed, setup).requests)
    min_rate = start * MIN_CALIBRATION_REQUESTS / max(num_requests, 1)

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


def best_baseline(met: dict[str, tuple[int, int]]) -> str | None:
    """The baseline meeting the most requests (the earlier in CANDIDATE_BASELINES on a tie)."""
    ran = [b for b in CANDIDATE_BASELINES if b in met]
    return max(ran, key=lambda b: (met[b][0], -ran.index(b))) if ran else None


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
    # per forced move path that ran: GoodServe (each move's path chosen) met / forced met
    vs_move_paths: tuple[tuple[str, tuple[float, ...]], ...] = ()

    @property
    def best_named(self) -> str:
        """The baseline best on most seeds."""
        return Counter(self.best).most_common(1)[0][0]

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
        if GOODSERVE in met and best_baseline(met):
            seeds[(workload, cluster, factor, scale)].append(seed)
    return [_matrix_row(table, key, sorted(seeds[key])) for key in sorted(seeds, key=_order)]


def _order(key: tuple[str, str, float, float]) -> tuple:
    workload, cluster, factor, scale = key
    return (_rank(workload, WORKLOADS), workload, _rank(cluster, list(CLUSTERS)), cluster,
            factor, scale)


def _rank(name: str, known: Sequence[str]) -> int:
    return known.index(name) if name in known else len(known)


def _matrix_row(table: dict[MetKey, dict[str, tuple[int, int]]],
                key: tuple[str, str, float, float], seeds: Sequence[int]) -> MatrixRow:
    workload, cluster, factor, scale = key
    per_seed = [table[(*key, s)] for s in seeds]
    best = [best_baseline(m) or "" for m in per_seed]
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
        vs_move_paths=tuple(
            (rule.value, ratios) for rule in MoveRule
            if (ratios := tuple(ratio(o, m[move_path_label(rule)][0])
                                for o, m in zip(ours, per_seed, strict=True)
                                if move_path_label(rule) in m))))


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
        unit = "req/s" if c.workload == "mooncake" else "sessions/s"
        what = f"{c.rate:.3g} {unit}" if c.rate is not None else f"skipped: {c.note}"
        lines.append(f"- {c.workload} on {c.cluster}: {what} ({', '.join(c.policies)}; "
                     f"seed {c.seed}, {c.duration_s:g} s)")
    return lines


def write_markdown(path: Path, rows: Sequence[MatrixRow],
                   calibrations: Sequence[Calibration]) -> None:
    lines = ["# Agentic matrix (simulator)", "",
             "Per cell: mean [min, max] over seeds. GoodServe met / best baseline met (each "
             "seed's best baseline; the one best on most seeds is named), the noise (the best "
             "baseline's seed-to-seed spread, (max - min) / mean of its met requests: a "
             "ratio within it of 1 is a tie), and exact lengths / GoodServe.", "",
             *_calibration_lines(calibrations)]
    for workload, cluster in dict.fromkeys((r.workload, r.cluster) for r in rows):
        mine = [r for r in rows if (r.workload, r.cluster) == (workload, cluster)]
        lines += ["", f"## {workload}, {cluster} cluster", "",
                  "| load | scale | GoodServe met | GoodServe / best | best baseline | noise | "
                  "exact / GoodServe |", "|---|---|---|---|---|---|---|"]
        for r in mine:
            noise = "-" if r.noise is None else f"{r.noise:.2f}"
            lines.append(f"| {r.load_factor:g}x | {r.slo_scale:g} | "
                         f"{sum(r.goodserve_share) / len(r.goodserve_share):.0%} | "
                         f"{_text(r.vs_best)} | {r.best_named} | {noise} | "
                         f"{_text(r.exact_vs_goodserve)} |")
        forced = list(dict.fromkeys(rule for r in mine for rule, _ in r.vs_move_paths))
        if forced:
            lines += ["", "GoodServe (each move's path chosen) / GoodServe with every move "
                      "forced to one path:", "",
                      "| load | scale | " + " | ".join(f"/ {p}" for p in forced) + " |",
                      "|---|---|" + "---|" * len(forced)]
            for r in mine:
                by_rule = dict(r.vs_move_paths)
                lines.append(f"| {r.load_factor:g}x | {r.slo_scale:g} | " + " | ".join(
                    _text(by_rule.get(p, ())) for p in forced) + " |")
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


def write_report(out: Path, calibrations: Sequence[Calibration]) -> list[MatrixRow]:
    rows = aggregate(read_cells(out / "cells.csv"))
    write_matrix_csv(out / "matrix.csv", rows)
    write_markdown(out / "matrix.md", rows, calibrations)
    write_heatmaps(out / "matrix.png", rows)
    return rows


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
        help="policies per unit (the report needs goodserve and a baseline)")
    ] = ",".join(POLICIES),
    calibration_policies: Annotated[str, typer.Option(
        help="baselines whose best met share L* is bisected on, for every workload "
        "(default: " + "; ".join(f"{w} {','.join(p)}" for w, p in
                                 CALIBRATION_POLICIES.items()) + ")")
    ] = "",
    duration: Annotated[str, typer.Option(help=DURATION_HELP)] = "",
    jobs: Annotated[int, typer.Option(help="units simulated at once (processes)")] = 2,
    resume: Annotated[bool, typer.Option(
        "--resume", help="keep --out/calibration.csv and cells.csv; run only what they lack")
    ] = False,
    report_only: Annotated[bool, typer.Option(
        "--report-only",
        help="rewrite matrix.* from --out/cells.csv and calibration.csv, running nothing")
    ] = False,
    move_paths: Annotated[str, typer.Option(
        help="also run GoodServe with every move forced to these paths (token-ids, kv), "
        "against its default of choosing per move")] = "",
) -> int:
    """Calibrate L* per (workload, cluster), run the matrix, write the report."""
    try:
        workloads = _names(only_workloads, WORKLOADS, "workload")
        clusters = _names(only_clusters, list(CLUSTERS), "cluster")
        chosen = _names(policies, POLICIES, "policy")
        calibrators = ({w: tuple(_names(calibration_policies, BASELINES, "baseline"))
                        for w in WORKLOADS} if calibration_policies
                       else dict(CALIBRATION_POLICIES))
        reported = {"small": _seeds(seeds), "large": _seeds(large_seeds)}
        durations = _durations(duration)
        forced = [MoveRule(p) for p in _names(move_paths, [r.value for r in MoveRule
                                                           if r is not MoveRule.CHEAPER],
                                              "move path")]
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if calibration_seed in {*reported["small"], *reported["large"]}:
        print(f"error: the calibration seed {calibration_seed} is a reported seed")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if report_only:
        latest = {(c.workload, c.cluster): c
                  for c in read_calibrations(out / "calibration.csv")}
        write_report(out, list(latest.values()))
        print(f"wrote {out}/matrix.md, matrix.csv, matrix.png")
        return 0
    if "mooncake" in workloads and not trace.is_file():
        print(f"skipping mooncake: the trace {trace} is absent")
        workloads.remove("mooncake")
    if not resume:
        for name in ("calibration.csv", "cells.csv"):
            (out / name).unlink(missing_ok=True)
    setup = MatrixSetup(durations, trace, tuple(chosen), tuple(forced))
    calibrations = reference_rates(out, [(w, c) for w in workloads for c in clusters],
                                   setup, calibration_seed, calibrators, jobs)
    for c in calibrations:
        if c.rate is None:
            print(f"skipping {c.workload} on {c.cluster}: {c.note}")
    run_matrix(out, plan_units(calibrations, reported), setup, jobs)
    write_report(out, calibrations)
    print(f"wrote {out}/cells.csv, matrix.md, matrix.csv, matrix.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(agentic, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
