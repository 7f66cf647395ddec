"""SARA's model inputs, read from the hardware catalog (`app.hardware.specs`).

Symbols (paper -> here): N_layer -> num_layers, N_mod -> model_dim, N_hid -> ffn_dim,
g -> kv_ratio, gamma -> gamma_bytes, Omega_LLM -> weight_bytes, F -> mults_per_s,
B_HBM -> hbm_bytes_per_s, Omega_HBM -> hbm_capacity_bytes, C_p/C_d -> price_per_hour.

Two choices the paper leaves open, documented in README.md:
- F counts multiplications per second: effective FLOP/s / 2 (one multiply-accumulate
  is two FLOPs), with the catalog's MFU/MBU derating.
- Gated MLPs (Llama, Qwen) have three N_mod x N_hid matrices; N_mul counts
  `ffn_matrices` of them (2 reproduces the paper's formula for GPT-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.hardware.specs import BYTES_PER_GB, GpuSpec, ModelSpec, get_gpu, get_model

FLOPS_PER_MULT = 2.0
WEIGHT_FIT_FRACTION = 0.8  # weights may use this share of an instance's HBM


@dataclass(frozen=True)
class ModelParams:
    """The transformer shape in the paper's symbols."""

    name: str
    num_layers: int
    model_dim: int
    ffn_dim: int
    kv_ratio: float  # g = N_kv / N_head
    bits: int  # N_bits per KV element
    weight_bytes: float  # Omega_LLM
    ffn_matrices: int = 2

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelParams:
        return cls(
            name=spec.name,
            num_layers=spec.num_layers,
            model_dim=spec.hidden_size,
            ffn_dim=spec.intermediate_size,
            kv_ratio=spec.kv_group_ratio,
            bits=8 * spec.bytes_per_param,
            weight_bytes=float(spec.weight_bytes),
            ffn_matrices=3 if spec.gated_mlp else 2,
        )

    @classmethod
    def named(cls, name: str) -> ModelParams:
        return cls.from_spec(get_model(name))

    @property
    def gamma_bytes(self) -> float:
        """gamma = N_layer N_mod N_bits / 4: bytes of K and V per token for full MHA."""
        return self.num_layers * self.model_dim * self.bits / 4.0

    @property
    def kv_bytes_per_token(self) -> float:
        """g * gamma."""
        return self.kv_ratio * self.gamma_bytes

    @property
    def linear_mults_per_token(self) -> float:
        """Projections + FFN multiplications per token (no attention scores)."""
        d = self.model_dim
        per_layer = (2.0 + 2.0 * self.kv_ratio) * d * d + self.ffn_matrices * d * self.ffn_dim
        return self.num_layers * per_layer

    def num_mults(self, num_tokens: float, quadratic: bool = True) -> float:
        """N_mul(L) for a prompt of L tokens; `quadratic=False` keeps only linear terms."""
        attention = (num_tokens**2 if quadratic else 0.0) + num_tokens
        return self.linear_mults_per_token * num_tokens + (
            self.num_layers * attention * self.model_dim
        )

    def quadratic_share(self, num_tokens: float) -> float:
        """Fraction of N_mul(L) due to the L^2 term (paper: below 2.6%)."""
        quad = self.num_layers * num_tokens**2 * self.model_dim
        return quad / self.num_mults(num_tokens)

    def decode_mults(self, num_requests: float, context_tokens: float) -> float:
        """Multiplications of one decode iteration: per-token GEMMs + 2 L N_mod attention."""
        attention = 2.0 * self.num_layers * self.model_dim * context_tokens
        return self.linear_mults_per_token * num_requests + attention


@dataclass(frozen=True)
class DeviceParams:
    """One prefill instance or decode device: `devices` GPUs of one catalog type."""

    gpu: str  # catalog name
    mults_per_s: float  # F
    hbm_bytes_per_s: float  # B_HBM (effective)
    hbm_capacity_bytes: float  # Omega_HBM
    price_per_hour: float  # C_p or C_d, for all `devices` GPUs
    devices: int = 1

    @classmethod
    def from_spec(cls, gpu: GpuSpec, devices: int = 1) -> DeviceParams:
        if devices < 1:
            raise ValueError(f"devices per instance must be >= 1, got {devices}")
        return cls(
            gpu=gpu.name,
            mults_per_s=devices * gpu.effective_flops / FLOPS_PER_MULT,
            hbm_bytes_per_s=devices * gpu.effective_bandwidth,
            hbm_capacity_bytes=devices * gpu.hbm_capacity_gb * BYTES_PER_GB,
            price_per_hour=devices * gpu.price_per_hour,
            devices=devices,
        )

    @property
    def name(self) -> str:
        return self.gpu if self.devices == 1 else f"{self.devices}x{self.gpu}"

    @classmethod
    def named(cls, gpu: str, devices: int = 1) -> DeviceParams:
        return cls.from_spec(get_gpu(gpu), devices)

    @classmethod
    def instance_for(cls, gpu: str, model: ModelParams) -> DeviceParams:
        """Smallest power-of-two group of `gpu` whose HBM holds the weights."""
        spec = get_gpu(gpu)
        per_gpu = spec.hbm_capacity_gb * BYTES_PER_GB * WEIGHT_FIT_FRACTION
        devices = 1 << max(0, math.ceil(math.log2(model.weight_bytes / per_gpu)))
        return cls.from_spec(spec, devices)


@dataclass(frozen=True)
class SloTargets:
    """Stage latency thresholds, met with probability p_slo (paper Eqs. 20c-20e)."""

    ttft_s: float  # tau_pre
    kv_s: float  # tau_KV
    tpot_s: float  # tau_dec
    p_slo: float
    p_mem: float = 0.99  # C2: HBM not exhausted with this probability
    p_join: float = 0.95  # C4: a request joins the batch without waiting

    def __post_init__(self) -> None:
        for name in ("ttft_s", "kv_s", "tpot_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be positive, got {value}")
        for name in ("p_slo", "p_mem", "p_join"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
