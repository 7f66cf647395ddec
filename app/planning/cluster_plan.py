"""Mode and split for a cluster whose engines are fixed, and the attainment SARA promises.

`split_inventory` answers which engines should prefill and which decode at fixed stage
targets. A platform with a fixed cluster asks more: unified or disaggregated, which
split, and what share of requests will meet their deadlines at the rate it expects.
- Every layout is scored: unified (each engine's largest rate meeting both stage
  targets as it runs them together, below) and every prefill/decode split (the
  smallest of prefill, KV and decode capacity).
- The stage targets split each deadline's slack between the first token and the later
  ones (`stage_slos`); a layout is scored at the share that serves it best, since the
  deadline only counts the whole. Targets from the proportional split alone made the
  prefill model 5-8x pessimistic against the engines: they give the first token of a
  short prompt almost none of the slack it may use.
- The promise at a rate is the model's probability that a request meets its stage
  targets: for P/D, P(TTFT) x P(KV) x P(TPOT), each stage's engines taking traffic in
  proportion to their modelled capacity; for unified, per engine, P(TTFT) x P(TPOT)
  as it runs both stages.
- A unified engine schedules chunked prefill: each iteration carries a prompt chunk
  and every running request's next token, and the chunk's compute hides the decode
  tokens' weight reads. So the prefill queue is the prefill stage's own, and decode
  steps are stretched by the share of time spent on prompts (TPOT must meet
  tau_dec x (1 - rho_prefill)). Scoring it as time-sharing, 1 / (1 / r_prefill +
  1 / r_decode), as if each stage had the engine alone in turn, ranked a 3-H800
  prefill pool above unified on Mooncake lengths where unified met more.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.hardware.specs import InstanceSpec
from app.planning.allocator import LengthMoments
from app.planning.kv import KvStage
from app.planning.params import ModelParams, SloTargets
from app.planning.prefill import PrefillStage
from app.planning.queues import Method, MgkQueue
from app.planning.search import max_feasible_rate
from app.planning.split import (
    DEFAULT_P_SLO,
    MAX_SPLITS,
    EngineCapacity,
    EngineKind,
    decode_stage,
    engine_capacity,
    kv_capacity,
    prefill_counts,
    prefill_stage,
    split_stages,
    stage_slos,
)

UNIFIED, DISAGGREGATED = "unified", "disaggregated"
# shares of each deadline's slack given to the first token, tried per layout; None is
# the proportional split (tau_pre = scale x solo prefill)
PREFILL_SHARES: tuple[float | None, ...] = (None, 0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass(frozen=True)
class Layout:
    """One way to run the inventory: unified, or P/D with `prefill` engines per kind
    prefilling and the rest decoding."""

    prefill: tuple[tuple[str, int], ...] = ()  # (kind name, engines); empty: unified

    @property
    def mode(self) -> str:
        return DISAGGREGATED if self.prefill else UNIFIED

    @property
    def label(self) -> str:
        """'unified', or the prefill pool ('2xA800+H800'; the rest decode)."""
        if not self.prefill:
            return UNIFIED
        return "+".join(f"{n}x{k}" if n > 1 else k for k, n in self.prefill)

    def prefill_count(self, kind: EngineKind) -> int:
        return dict(self.prefill).get(kind.name, 0)


@dataclass(frozen=True)
class LayoutEstimate:
    """A layout's modelled goodput at the slack share that serves it best."""

    layout: Layout
    goodput_rps: float
    binding: str  # prefill | kv | decode (P/D), unified
    prefill_share: float | None
    slo: SloTargets
    capacities: tuple[EngineCapacity, ...]  # per engine kind, at `slo`


@dataclass(frozen=True)
class ClusterPlan:
    """Every layout of one inventory, best modelled goodput first."""

    inventory: tuple[tuple[EngineKind, int], ...]
    estimates: tuple[LayoutEstimate, ...]

    @property
    def recommended(self) -> LayoutEstimate:
        return self.estimates[0]

    def estimate(self, label: str) -> LayoutEstimate:
        for e in self.estimates:
            if e.layout.label == label:
                return e
        raise KeyError(f"no layout {label!r}; known: {[e.layout.label for e in self.estimates]}")


def plan_cluster(
    inventory: Mapping[EngineKind, int],
    model: ModelParams,
    workload: LengthMoments,
    reference: InstanceSpec,
    scale: float,
    kv_link_gbps: float | None,
    p_slo: float = DEFAULT_P_SLO,
    shares: Sequence[float | None] = PREFILL_SHARES,
    method: Method = Method.REFINED,
) -> ClusterPlan:
    """Score unified and every split of `inventory` (engine kind -> count) for deadlines
    of `scale` x solo time on `reference`; a link of None is not a constraint."""
    kinds = sorted(k for k, n in inventory.items() if n > 0)
    if not kinds:
        raise ValueError("the inventory holds no engine")
    if len({k.name for k in kinds}) < len(kinds):
        raise ValueError("engine kinds of one GPU type and tp must share max_num_seqs")
    counts = [inventory[k] for k in kinds]
    if math.prod(n + 1 for n in counts) > MAX_SPLITS:
        raise ValueError(f"more than {MAX_SPLITS} candidate splits; group the engines into "
                         "fewer kinds")
    if not shares:
        raise ValueError("give at least one prefill share")
    best: dict[Layout, tuple[tuple[float, float], LayoutEstimate]] = {}

    def offer(estimate: LayoutEstimate, tiebreak: float) -> None:
        rank = (estimate.goodput_rps, tiebreak)
        if estimate.layout not in best or rank > best[estimate.layout][0]:
            best[estimate.layout] = (rank, estimate)

    for share in shares:
        slo = stage_slos(reference, workload, scale, p_slo, share)
        capacities = tuple(engine_capacity(k, model, workload, slo, method) for k in kinds)
        unified = sum(n * unified_rps(c, model, workload, slo, method)
                      for c, n in zip(capacities, counts, strict=True))
        offer(LayoutEstimate(Layout(), unified, UNIFIED, share, slo, capacities), 0.0)
        kv_rps = math.inf if kv_link_gbps is None else kv_capacity(model, workload, slo,
                                                                   kv_link_gbps, method)
        for chosen in prefill_counts(counts):
            stages = split_stages(capacities, counts, chosen, kv_rps)
            binding = min(stages, key=stages.__getitem__)
            layout = Layout(tuple((k.name, p) for k, p in zip(kinds, chosen, strict=True) if p))
            offer(LayoutEstimate(layout, stages[binding], binding, share, slo, capacities),
                  min(stages["prefill"], stages["decode"]))
    ranked = sorted(best.values(), key=lambda item: (item[0], item[1].layout.mode == UNIFIED),
                    reverse=True)
    return ClusterPlan(tuple(zip(kinds, counts, strict=True)), tuple(e for _, e in ranked))


@functools.lru_cache(maxsize=1024)
def unified_rps(capacity: EngineCapacity, model: ModelParams, workload: LengthMoments,
                slo: SloTargets, method: Method = Method.REFINED) -> float:
    """Largest rate at which one unified engine meets each stage target with p_slo:
    at most either stage's own capacity, less as prompts stretch the decode steps.
    Memoised: a promise at each rate weighs the engines by it, a search per call."""
    top = min(capacity.prefill_rps, capacity.decode_rps)
    if top == 0:
        return 0.0

    def feasible(rate: float) -> bool:
        return min(_unified_cdfs(capacity.kind, model, workload, slo, rate, method)) >= slo.p_slo

    return max_feasible_rate(feasible, top)


def promised_attainment(
    plan: ClusterPlan, estimate: LayoutEstimate, model: ModelParams, workload: LengthMoments,
    rate_rps: float, kv_link_gbps: float | None, method: Method = Method.REFINED,
) -> float:
    """The model's share of requests meeting their stage targets at `rate_rps`."""
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"rate must be > 0, got {rate_rps}")
    slo, layout = estimate.slo, estimate.layout
    capacity = {c.kind: c for c in estimate.capacities}
    if layout.mode == UNIFIED:
        engines = [(kind, n) for kind, n in plan.inventory]
        weights = _shares([n * unified_rps(capacity[k], model, workload, slo, method)
                           for k, n in engines], [n for _, n in engines])
        return sum(w * math.prod(_unified_cdfs(kind, model, workload, slo, rate_rps * w / n,
                                               method))
                   for (kind, n), w in zip(engines, weights, strict=True) if w > 0)
    prefill = [(k, layout.prefill_count(k)) for k, _ in plan.inventory if layout.prefill_count(k)]
    decode = [(k, n - layout.prefill_count(k)) for k, n in plan.inventory
              if n > layout.prefill_count(k)]
    weights = _shares([n * capacity[k].prefill_rps for k, n in prefill], [n for _, n in prefill])
    ttft = sum(w * _ttft_cdf(prefill_stage(kind, model, workload), rate_rps * w / n, slo.ttft_s,
                             method)
               for (kind, n), w in zip(prefill, weights, strict=True) if w > 0)
    kv = 1.0
    if kv_link_gbps is not None:
        link = KvStage(model, workload.input_len)
        bandwidth = kv_link_gbps * 1e9
        kv = (0.0 if rate_rps >= link_rate_limit(link, bandwidth)
              else link.latency_cdf(rate_rps, bandwidth, slo.kv_s, method))
    weights = _shares([n * capacity[k].decode_rps for k, n in decode], [n for _, n in decode])
    tpot = sum(w * _tpot_cdf(kind, model, workload, rate_rps * w / n, slo.tpot_s, slo, method)
               for (kind, n), w in zip(decode, weights, strict=True) if w > 0)
    return ttft * kv * tpot


def link_rate_limit(link: KvStage, bandwidth_bytes_per_s: float) -> float:
    """The rate that saturates the link."""
    return bandwidth_bytes_per_s / link.transfer_bytes.mean


def _shares(capacities: Sequence[float], engines: Sequence[int]) -> list[float]:
    """Traffic shares in proportion to capacity (to engine count where none has any)."""
    total = sum(capacities)
    if total > 0:
        return [c / total for c in capacities]
    return [n / sum(engines) for n in engines]


def _ttft_cdf(stage: PrefillStage, rate_rps: float, ttft_s: float, method: Method) -> float:
    """P(TTFT <= ttft_s) for one engine at `rate_rps`."""
    if rate_rps * stage.service.mean >= 1:
        return 0.0
    return MgkQueue(rate_rps, 1, stage.service).sojourn_cdf(ttft_s, method)


def _tpot_cdf(kind: EngineKind, model: ModelParams, workload: LengthMoments, rate_rps: float,
              tpot_s: float, slo: SloTargets, method: Method) -> float:
    """P(TPOT <= tpot_s) for one engine at `rate_rps`, running at most its scheduler's
    cap (else what its memory holds with probability p_mem) at once."""
    stage = decode_stage(kind, model, workload)
    cap = kind.max_num_seqs or max(1, stage.max_batch_memory(kind.tp, slo.p_mem, method))
    return stage.tpot_cdf(kind.tp, cap, tpot_s, rate_rps, method)


def _unified_cdfs(kind: EngineKind, model: ModelParams, workload: LengthMoments,
                  slo: SloTargets, rate_rps: float, method: Method) -> tuple[float, float]:
    """P(TTFT) and P(TPOT) of one unified engine at `rate_rps`: the prefill queue its
    own, the decode steps stretched by the prompts' share of the engine."""
    prefill = prefill_stage(kind, model, workload)
    prefill_busy = rate_rps * prefill.service.mean
    if prefill_busy >= 1:
        return 0.0, 0.0
    ttft = _ttft_cdf(prefill, rate_rps, slo.ttft_s, method)
    tpot = _tpot_cdf(kind, model, workload, rate_rps, slo.tpot_s * (1.0 - prefill_busy), slo,
                     method)
    return ttft, tpot
