"""Prefill/decode split of GPUs a cluster already owns: which engines prefill, which decode.

SARA's allocator (`allocator.py`) buys homogeneous pools under a budget. A cluster
whose engines are fixed asks the other question: given these engines, which should
prefill and which decode so that the most requests meet their stage SLOs? The same
stage models answer it:
- an engine's prefill capacity is the largest arrival rate it alone serves with
  P(TTFT <= tau_pre) >= p_slo (the M/G/k model at k = 1);
- its decode capacity is the largest rate at which its `tp` devices keep a feasible
  batch range under C1-C4 (the decode model at k_d = tp), the range's top also capped
  by the engine's `max_num_seqs` (the model alone knows no scheduler cap, and a lone
  fast GPU then looks able to decode for the whole cluster);
- the KV link's capacity is the largest rate the configured bandwidth carries within
  tau_KV.
A pool's capacity is the sum over its engines (independent queues, a lower bound on a
pool that shares one queue) and a split's goodput is the smallest of prefill, KV and
decode. Engines of one kind are interchangeable, so the search enumerates how many of
each kind prefill; every split with at least one engine per pool is considered.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from app.engines.config import SchedulerConfig
from app.hardware.specs import InstanceSpec
from app.planning.allocator import LengthMoments
from app.planning.decode import DecodeStage
from app.planning.kv import KvStage
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.prefill import PrefillStage
from app.planning.queues import Method
from app.planning.search import max_feasible_rate

MAX_SPLITS = 1_000_000  # candidate splits enumerated before giving up
DEFAULT_P_SLO = 0.9


@dataclass(frozen=True, order=True)
class EngineKind:
    """One engine shape of the inventory: `tp` GPUs of one catalog type, whose scheduler
    runs at most `max_num_seqs` requests at once (None: no cap)."""

    gpu: str
    tp: int = 1
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def name(self) -> str:
        """'H800', 'V100x2'; the batch cap is not part of the name."""
        return self.gpu if self.tp == 1 else f"{self.gpu}x{self.tp}"

    def scheduler(self) -> SchedulerConfig:
        """The engine's scheduler settings: the defaults, with its batch cap."""
        if self.max_num_seqs is None:
            return SchedulerConfig()
        return SchedulerConfig(max_num_seqs=self.max_num_seqs)


@dataclass(frozen=True)
class EngineCapacity:
    """Largest arrival rate one engine of `kind` serves within each stage's SLO."""

    kind: EngineKind
    prefill_rps: float
    decode_rps: float


@dataclass(frozen=True)
class PoolSplit:
    """The goodput-maximising split; counts are engines per kind name."""

    prefill: dict[str, int]
    decode: dict[str, int]
    goodput_rps: float  # min of the three stage capacities
    prefill_rps: float
    kv_rps: float
    decode_rps: float
    binding: str  # the stage at the minimum: prefill | kv | decode
    capacities: tuple[EngineCapacity, ...]

    def role_of(self, kind: EngineKind, index: int) -> str:
        """Role of the `index`-th engine of `kind` (the first ones prefill)."""
        return "prefill" if index < self.prefill.get(kind.name, 0) else "decode"


def stage_slos(
    reference: InstanceSpec, workload: LengthMoments, scale: float,
    p_slo: float = DEFAULT_P_SLO, prefill_share: float | None = None,
) -> SloTargets:
    """Stage targets that split the mean request's end-to-end deadline.

    The mean request (mean uncached prompt, mean output) alone on `reference` waits P for
    its first token and d per later token; its deadline is `scale` x (P + (N - 1) d),
    which leaves a slack of (scale - 1) x that solo time. A request meets its deadline
    when its first token comes within P plus a share of the slack and each later token
    within d plus an equal part of the rest:
    tau_pre = P + share x slack, tau_dec = d + (1 - share) x slack / (N - 1).
    `prefill_share` None splits the slack in proportion to the solo phases, which is
    tau_pre = scale x P and tau_dec = scale x d. The deadline counts its whole slack
    wherever it is spent, so the share is a choice (`plan_cluster` searches it). The KV
    transfer has no counterpart in the unified reference; it may take as long as the
    prefill (tau_KV = tau_pre).
    """
    if not scale > 0:
        raise ValueError(f"SLO scale must be > 0, got {scale}")
    if prefill_share is not None and not 0 <= prefill_share <= 1:
        raise ValueError(f"prefill share must be in [0, 1], got {prefill_share}")
    mean_input = max(1, round(workload.input_len.mean))
    uncached = min(mean_input, max(1, round(workload.prefill_len.mean)))
    num_later = max(1, round(workload.mean_output_len) - 1)
    prefill_s, tpot_s = reference.solo_phases_s(mean_input, num_later + 1,
                                                num_cached_tokens=mean_input - uncached)
    if prefill_share is None:
        prefill_share = prefill_s / (prefill_s + num_later * tpot_s)
    slack = (scale - 1) * (prefill_s + num_later * tpot_s)
    ttft_s = prefill_s + prefill_share * slack
    return SloTargets(ttft_s=ttft_s, kv_s=ttft_s,
                      tpot_s=tpot_s + (1 - prefill_share) * slack / num_later, p_slo=p_slo)


def prefill_stage(kind: EngineKind, model: ModelParams, workload: LengthMoments
                  ) -> PrefillStage:
    """One engine of `kind` prefilling: its `tp` devices, the uncached prompt lengths."""
    return PrefillStage(model, DeviceParams.named(kind.gpu, kind.tp), workload.prefill_len)


def decode_stage(kind: EngineKind, model: ModelParams, workload: LengthMoments) -> DecodeStage:
    """An engine of `kind` decoding (per device; the stage takes `tp` devices per call)."""
    return DecodeStage(model, DeviceParams.named(kind.gpu), workload.input_len,
                       workload.mean_output_len)


def split_stages(capacities: Sequence[EngineCapacity], counts: Sequence[int],
                 chosen: Sequence[int], kv_rps: float) -> dict[str, float]:
    """Capacity of each stage of the split where `chosen[i]` of `counts[i]` engines of
    `capacities[i]`'s kind prefill and the rest decode."""
    return {
        "prefill": sum(c.prefill_rps * p for c, p in zip(capacities, chosen, strict=True)),
        "kv": kv_rps,
        "decode": sum(c.decode_rps * (n - p)
                      for c, n, p in zip(capacities, counts, chosen, strict=True)),
    }


def engine_capacity(
    kind: EngineKind, model: ModelParams, workload: LengthMoments, slo: SloTargets,
    method: Method = Method.REFINED,
) -> EngineCapacity:
    """Per-stage capacity of one engine (0 where the SLO is out of reach even unloaded)."""
    prefill = prefill_stage(kind, model, workload)
    prefill_rps = 0.0
    if prefill.service.cdf(slo.ttft_s) >= slo.p_slo:
        prefill_rps = max_feasible_rate(
            lambda rate: prefill.meets_slo(rate, 1, slo.ttft_s, slo.p_slo, method),
            1.0 / prefill.service.mean,
        )
    decode = decode_stage(kind, model, workload)
    decode_rps = 0.0
    if kind.tp * decode.device.hbm_capacity_bytes > model.weight_bytes:
        caps: dict[int, tuple[int, int | None]] = {}
        top = math.inf if kind.max_num_seqs is None else kind.max_num_seqs

        def feasible(rate: float) -> bool:
            bounds = decode.batch_bounds(kind.tp, rate, slo, method, caps)
            return bounds.lower <= min(bounds.upper, top)

        decode_rps = max_feasible_rate(feasible, decode.p0 * decode.saturation_throughput(kind.tp))
    return EngineCapacity(kind, prefill_rps, decode_rps)


def kv_capacity(
    model: ModelParams, workload: LengthMoments, slo: SloTargets, link_gbps: float,
    method: Method = Method.REFINED,
) -> float:
    """Largest rate the link carries with P(T_KV <= tau_KV) >= p_slo."""
    if not link_gbps > 0:
        raise ValueError(f"KV link bandwidth must be > 0 GB/s, got {link_gbps}")
    link = KvStage(model, workload.input_len)
    bandwidth = link_gbps * 1e9
    if link.latency_cdf(0.0, bandwidth, slo.kv_s, method) < slo.p_slo:
        return 0.0
    return max_feasible_rate(
        lambda rate: link.latency_cdf(rate, bandwidth, slo.kv_s, method) >= slo.p_slo,
        bandwidth / link.transfer_bytes.mean,
    )


def prefill_counts(counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every choice of how many engines of each kind prefill that leaves at least one
    engine to each pool (`counts`: engines per kind)."""
    total = sum(counts)
    for chosen in itertools.product(*(range(n + 1) for n in counts)):
        if 0 < sum(chosen) < total:
            yield chosen


def split_inventory(
    inventory: Mapping[EngineKind, int],
    model: ModelParams,
    workload: LengthMoments,
    slo: SloTargets,
    kv_link_gbps: float | None,
    method: Method = Method.REFINED,
) -> PoolSplit:
    """Best prefill/decode split of a fixed inventory (engine kind -> count); a link of
    None is not a constraint.

    Ties (e.g. every split at zero goodput when no engine meets the TPOT SLO) go to
    the split whose weaker pool is strongest, then to the larger total capacity.
    """
    kinds = sorted(k for k, n in inventory.items() if n > 0)
    if len({k.name for k in kinds}) < len(kinds):
        raise ValueError("engine kinds of one GPU type and tp must share max_num_seqs")
    counts = [inventory[k] for k in kinds]
    if sum(counts) < 2:
        raise ValueError("a prefill/decode split needs at least two engines")
    if math.prod(n + 1 for n in counts) > MAX_SPLITS:
        raise ValueError(f"more than {MAX_SPLITS} candidate splits; group the engines into "
                         "fewer kinds")
    capacities = tuple(engine_capacity(k, model, workload, slo, method) for k in kinds)
    kv_rps = math.inf if kv_link_gbps is None else kv_capacity(model, workload, slo,
                                                               kv_link_gbps, method)
    best: tuple[tuple[float, float, float], PoolSplit] | None = None
    for chosen in prefill_counts(counts):
        stages = split_stages(capacities, counts, chosen, kv_rps)
        prefill_rps, decode_rps = stages["prefill"], stages["decode"]
        binding = min(stages, key=stages.__getitem__)
        rank = (stages[binding], min(prefill_rps, decode_rps), prefill_rps + decode_rps)
        if best is None or rank > best[0]:
            split = PoolSplit(
                prefill={k.name: p for k, p in zip(kinds, chosen, strict=True) if p},
                decode={k.name: n - p for k, n, p in zip(kinds, counts, chosen,
                                                         strict=True) if n - p},
                goodput_rps=stages[binding], prefill_rps=prefill_rps, kv_rps=kv_rps,
                decode_rps=decode_rps, binding=binding, capacities=capacities,
            )
            best = (rank, split)
    assert best is not None  # at least two engines give at least one split
    return best[1]
