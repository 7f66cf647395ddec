"""GoodServe's Mixture-of-Experts output-length predictor (paper Sec. 3.2).

Two-phase training, as in the paper: phase 1 splits one half of the requests into K
subsets by input-length tier x output-length tier (sqrt(K) quantile tiers each) and
trains expert k on subset k only; phase 2 freezes the experts and trains the gate on
the other half, so the gate learns which experts generalise to unseen prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from predictor.base import PredictionInput
from predictor.nets import MixtureOfExperts
from predictor.neural import TextNetPredictor, TrainingSet, init_output_bias
from predictor.text_counts import COUNT_NAMES, count_prompts
from predictor.training import log_length_loss, train_loop

__all__ = ["MoEPredictor", "TierAssignment", "assign_tiers", "split_halves"]


def split_halves(inputs: Sequence[PredictionInput], rng: np.random.Generator) -> np.ndarray:
    """Boolean mask of phase-1 requests; requests with the same prompt stay together."""
    prompts = sorted({inp.prompt for inp in inputs})
    if len(prompts) < 2:
        raise ValueError("the MoE needs at least 2 distinct prompts (one per training phase)")
    shuffled = rng.permutation(len(prompts))
    phase_one = {prompts[i] for i in shuffled[: len(prompts) // 2]}
    return np.array([inp.prompt in phase_one for inp in inputs])


@dataclass(frozen=True)
class TierAssignment:
    """Quantile tiers of input and output length and the resulting expert subsets."""

    input_edges: np.ndarray  # prompt-word thresholds between input tiers
    output_edges: np.ndarray  # output-token thresholds between output tiers
    subsets: np.ndarray  # expert id per request: input_tier * num_tiers + output_tier


def assign_tiers(
    prompt_words: np.ndarray, output_lengths: np.ndarray, num_tiers: int
) -> TierAssignment:
    """Split requests into num_tiers**2 subsets by quantile tiers of both lengths."""
    quantiles = np.arange(1, num_tiers) / num_tiers
    input_edges = np.quantile(prompt_words, quantiles)
    output_edges = np.quantile(output_lengths, quantiles)
    input_tier = np.searchsorted(input_edges, prompt_words, side="right")
    output_tier = np.searchsorted(output_edges, output_lengths, side="right")
    return TierAssignment(input_edges, output_edges, input_tier * num_tiers + output_tier)


def tiers_per_axis(num_experts: int) -> int:
    num_tiers = math.isqrt(num_experts)
    if num_tiers < 1 or num_tiers * num_tiers != num_experts:
        raise ValueError(f"num_experts must be a perfect square (4, 9, 16...), got {num_experts}")
    return num_tiers


class MoEPredictor(TextNetPredictor):
    """Gate (2-layer MLP) -> softmax over K experts (4-layer MLPs), on log length."""

    kind = "moe"

    def __init__(
        self,
        num_experts: int = 9,
        expert_hidden_dim: int = 64,
        gate_hidden_dim: int = 64,
        expert_epochs: int = 30,
        gate_epochs: int = 15,
        batch_size: int = 64,
        learning_rate: float = 1e-3,
        weight_decay: float = 1e-4,
        loss: str = "l1",
        max_features: int = 8192,
        use_task: bool = True,
        num_augment: int = 1,
        device: str = "auto",
        random_state: int = 0,
        show_progress: bool = False,
        survival_floor: bool = True,
    ) -> None:
        self.num_experts = num_experts
        self.expert_hidden_dim = expert_hidden_dim
        self.gate_hidden_dim = gate_hidden_dim
        self.expert_epochs = expert_epochs
        self.gate_epochs = gate_epochs
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.loss = loss
        self.max_features = max_features
        self.use_task = use_task
        self.num_augment = num_augment
        self.device = device
        self.random_state = random_state
        self.show_progress = show_progress
        self.survival_floor = survival_floor

    def _build_net(self, in_dim: int, gen: torch.Generator) -> nn.Module:
        tiers_per_axis(self.num_experts)  # reject a non-square K before any training
        return MixtureOfExperts(
            in_dim, self.num_experts, self.expert_hidden_dim, self.gate_hidden_dim, gen
        )

    def _train_net(self, data: TrainingSet, rng: np.random.Generator, gen: torch.Generator) -> None:
        phase_one = split_halves(data.augmented.inputs, rng)
        phase_one_rows = np.flatnonzero(phase_one)
        words = count_prompts([inp.prompt for inp in data.augmented.inputs])[
            :, COUNT_NAMES.index("prompt_words")]
        tiers = assign_tiers(
            words[phase_one_rows],
            data.augmented.output_lengths[phase_one_rows],
            tiers_per_axis(self.num_experts),
        )
        self.tier_edges_ = {
            "input_words": tiers.input_edges.tolist(),
            "output_tokens": tiers.output_edges.tolist(),
        }
        for k in range(self.num_experts):
            rows = phase_one_rows[tiers.subsets == k]
            if len(rows) == 0:  # tiny data: an untrained expert that predicts the median
                init_output_bias(self.net_.experts[k].layers[-1], data.targets[phase_one_rows])
                continue
            self._train_expert(k, rows, data, gen)
        self._train_gate(np.flatnonzero(~phase_one), data, gen)

    def _train_expert(
        self, k: int, rows: np.ndarray, data: TrainingSet, gen: torch.Generator
    ) -> None:
        """Phase 1: expert k sees only its own subset."""
        expert = self.net_.experts[k]
        init_output_bias(expert.layers[-1], data.targets[rows])

        def batch_loss(batch_rows: np.ndarray) -> torch.Tensor:
            ids = rows[batch_rows]
            pred = expert(self.batch(data.features, ids)).reshape(-1)
            return log_length_loss(pred, data.targets[ids], self.loss)

        config = self._train_config(self.expert_epochs)
        train_loop(expert.parameters(), len(rows), batch_loss, config, gen, f"moe expert {k}")

    def _train_gate(self, rows: np.ndarray, data: TrainingSet, gen: torch.Generator) -> None:
        """Phase 2: experts frozen (outputs precomputed once), gate trained on the rest."""
        self.net_.experts.requires_grad_(False)
        with torch.inference_mode():
            expert_out = self.net_.expert_outputs(self.batch(data.features, rows))
        expert_out = expert_out.clone()  # leave inference mode so autograd may read it

        def batch_loss(batch_rows: np.ndarray) -> torch.Tensor:
            logits = self.net_.gate(self.batch(data.features, rows[batch_rows]))
            pred = (torch.softmax(logits, dim=1) * expert_out[batch_rows]).sum(dim=1)
            return log_length_loss(pred, data.targets[rows[batch_rows]], self.loss)

        config = self._train_config(self.gate_epochs)
        train_loop(self.net_.gate.parameters(), len(rows), batch_loss, config, gen, "moe gate")

    def _meta(self) -> dict[str, object]:
        return {"tier_edges": self.tier_edges_}

    def _restore_meta(self, meta: dict[str, object]) -> None:
        self.tier_edges_ = meta["tier_edges"]
