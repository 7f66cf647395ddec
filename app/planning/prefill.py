"""Prefill stage: an M/G/k_p queue with service T_p(L_i) = alpha_p L_i.

alpha_p = N_layer(2(1+g)N_mod^2 + (m N_hid + 1)N_mod) / F_p, with m FFN matrices
(m = 2 in the paper). The dropped L^2 attention term and the HBM floor
(Omega_LLM + g gamma L)/B_HBM stay available in `service_time_s` for plots; the
queue uses the linear form so that T_p inherits the distribution family of L_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams
from app.planning.queues import Method, MgkQueue
from app.planning.search import check_rate, first_true


@dataclass(frozen=True)
class PrefillSizing:
    """Minimum prefill pool for one arrival rate."""

    num_instances: int  # k_p
    binding: str  # "stability" (rho_p < 1 alone suffices) or "ttft_slo"
    utilization: float  # rho_p


@dataclass(frozen=True)
class PrefillStage:
    """k_p identical instances of `device` serving prompts of `input_len` tokens."""

    model: ModelParams
    device: DeviceParams
    input_len: LengthDist

    @property
    def seconds_per_token(self) -> float:
        """alpha_p."""
        return self.model.num_mults(1.0, quadratic=False) / self.device.mults_per_s

    @property
    def service(self) -> LengthDist:
        return self.input_len.scaled(self.seconds_per_token)

    def service_time_s(self, num_tokens: np.ndarray, quadratic: bool = True) -> np.ndarray:
        """Full T_p(L) = max(compute with L^2 term, HBM traffic) for one prompt."""
        tokens = np.asarray(num_tokens, dtype=float)
        compute = self.model.num_mults(tokens, quadratic) / self.device.mults_per_s
        memory = (self.model.weight_bytes + self.model.kv_bytes_per_token * tokens) / (
            self.device.hbm_bytes_per_s
        )
        return np.maximum(compute, memory)

    def queue(self, rate_rps: float, num_instances: int) -> MgkQueue:
        return MgkQueue(rate_rps, num_instances, self.service)

    def stability_floor(self, rate_rps: float) -> int:
        """Smallest k_p with rho_p < 1."""
        check_rate(rate_rps)
        return max(1, math.floor(rate_rps * self.service.mean) + 1)

    def meets_slo(
        self, rate_rps: float, num_instances: int, ttft_s: float, p_slo: float, method: Method
    ) -> bool:
        cdf = self.queue(rate_rps, num_instances).sojourn_cdf(ttft_s, method)
        return cdf >= p_slo

    def min_instances(
        self, rate_rps: float, ttft_s: float, p_slo: float, method: Method = Method.REFINED
    ) -> PrefillSizing | None:
        """Smallest k_p with P(TTFT <= ttft_s) >= p_slo; None if no k_p can (T_p alone)."""
        if self.service.cdf(ttft_s) < p_slo:
            return None
        floor = self.stability_floor(rate_rps)

        def ok(k: int) -> bool:
            return self.meets_slo(rate_rps, k, ttft_s, p_slo, method)

        if ok(floor):
            return PrefillSizing(floor, "stability", rate_rps * self.service.mean / floor)
        k = first_true(ok, floor)
        return PrefillSizing(k, "ttft_slo", rate_rps * self.service.mean / k)
