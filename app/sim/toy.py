"""Toy hardware with textbook service times, for checking the simulator against theory.

`linear_prefill_instance` costs exactly `seconds_per_token` per prompt token (no
overhead, negligible attention and memory terms), so a one-token request whose
prompt length is geometric has (to 0.1%) exponential service: an M/M/c server.
"""

from __future__ import annotations

import math
import random

from app.engines.config import SchedulerConfig
from app.hardware.specs import GpuSpec, InstanceSpec, ModelSpec
from app.sim.instance import InstanceSetup

_TOY_MODEL = ModelSpec(
    "toy-linear", num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1,
    intermediate_size=1_000_000, vocab_size=16, max_context_tokens=1_000_000,
)


def linear_prefill_instance(seconds_per_token: float) -> InstanceSpec:
    """One compute-bound GEMM layer: iteration time = tokens x seconds_per_token."""
    flops_per_token = 2.0 * _TOY_MODEL.params_per_layer
    gpu = GpuSpec(
        "toy-linear", peak_tflops=flops_per_token / seconds_per_token / 1e12,
        hbm_bandwidth_gbps=1e12, hbm_capacity_gb=1e4, price_per_hour=0.0,
        mfu=1.0, mbu=1.0, iteration_overhead_s=0.0, allreduce_hop_latency_s=0.0,
        layer_kernel_floor_s=0.0,
    )
    return InstanceSpec(gpu, _TOY_MODEL)


def single_server_setup(seconds_per_token: float) -> InstanceSetup:
    """A batch-size-1 FCFS server whose service time is the prompt length x the rate."""
    scheduler = SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=10_000_000, enable_prefix_caching=False
    )
    return InstanceSetup(linear_prefill_instance(seconds_per_token), scheduler)


def geometric_lengths(mean: float, n: int, seed: int) -> list[int]:
    """Geometric on {1, 2, ...} with the given mean: the discrete exponential."""
    rng = random.Random(seed)
    scale = -math.log1p(-1.0 / mean)  # P(X > k) = (1 - 1/mean)^k
    return [1 + int(rng.expovariate(1.0) // scale) for _ in range(n)]
