"""Torch modules: sparse-input MLPs and the mixture of experts (paper Sec. 3.2).

Parameters are initialised from an explicit `torch.Generator`, never the global RNG,
so building a model has no hidden side effect and training is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from predictor.features import SparseRows

__all__ = [
    "MLP",
    "FusedMixture",
    "MixtureOfExperts",
    "SparseBatch",
    "for_inference",
    "resolve_device",
]


def resolve_device(device: str) -> torch.device:
    """'auto' means the GPU when this process has one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class SparseBatch:
    """CSR rows in embedding-bag form: column ids, row offsets, values."""

    indices: torch.Tensor  # int64, all non-zero column ids, row after row
    offsets: torch.Tensor  # int64, start of each row in `indices`
    values: torch.Tensor  # float32, one per index

    @classmethod
    def from_csr(cls, matrix: sp.csr_matrix, device: torch.device) -> SparseBatch:
        return cls.from_rows(SparseRows.from_csr(matrix), device)

    @classmethod
    def from_rows(cls, rows: SparseRows, device: torch.device) -> SparseBatch:
        """No copy on the CPU: `SparseRows` holds the dtypes the embedding bag takes."""
        return cls(
            torch.from_numpy(rows.indices).to(device),
            torch.from_numpy(rows.indptr[:-1]).to(device),
            torch.from_numpy(rows.data).to(device),
        )


def _init_linear(layer: nn.Linear | SparseLinear, fan_in: int, gen: torch.Generator) -> None:
    """PyTorch's default Linear init (uniform +-1/sqrt(fan_in)), from `gen`."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        nn.init.uniform_(layer.weight, -bound, bound, generator=gen)
        nn.init.uniform_(layer.bias, -bound, bound, generator=gen)


def make_linear(in_dim: int, out_dim: int, gen: torch.Generator) -> nn.Linear:
    layer = skip_init(nn.Linear, in_dim, out_dim)
    _init_linear(layer, in_dim, gen)
    return layer


class SparseLinear(nn.Module):
    """Linear layer over a SparseBatch: an embedding bag weighted by the feature values."""

    def __init__(self, in_dim: int, out_dim: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_dim, out_dim))  # transposed vs nn.Linear
        self.bias = nn.Parameter(torch.empty(out_dim))
        _init_linear(self, in_dim, gen)

    def forward(self, x: SparseBatch) -> torch.Tensor:
        out = F.embedding_bag(
            x.indices, self.weight, x.offsets, mode="sum", per_sample_weights=x.values
        )
        return out + self.bias


class MLP(nn.Module):
    """Sparse first layer, then ReLU hidden layers; `num_layers` linear layers in all."""

    def __init__(
        self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int, gen: torch.Generator
    ) -> None:
        super().__init__()
        self.input = SparseLinear(in_dim, hidden_dim, gen)
        dims = [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(
            make_linear(a, b, gen) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )

    def forward(self, x: SparseBatch) -> torch.Tensor:
        h = self.input(x)
        for layer in self.layers:
            h = layer(torch.relu(h))
        return h


class MixtureOfExperts(nn.Module):
    """y_hat = sum_k softmax(R(h))_k * E_k(h); R is 2 layers, each E_k is 4 layers."""

    def __init__(
        self,
        in_dim: int,
        num_experts: int,
        expert_hidden_dim: int,
        gate_hidden_dim: int,
        gen: torch.Generator,
    ) -> None:
        super().__init__()
        self.gate = MLP(in_dim, gate_hidden_dim, num_experts, num_layers=2, gen=gen)
        self.experts = nn.ModuleList(
            MLP(in_dim, expert_hidden_dim, 1, num_layers=4, gen=gen) for _ in range(num_experts)
        )

    def expert_outputs(self, x: SparseBatch) -> torch.Tensor:
        """(batch, K) predictions of every expert."""
        return torch.cat([expert(x) for expert in self.experts], dim=1)

    def forward(self, x: SparseBatch) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=1)
        return (weights * self.expert_outputs(x)).sum(dim=1)


class FusedMixture(nn.Module):
    """A trained MixtureOfExperts packed for inference: same outputs, fewer kernels.

    The gate's and every expert's sparse first layers become one embedding bag (the
    sparse gather dominates, and it then reads each input row once), and each later
    expert layer becomes one batched matmul over the experts. At batch 64 on one CPU
    thread this is about a third of the per-module forward's time.
    """

    def __init__(self, moe: MixtureOfExperts) -> None:
        super().__init__()
        experts = list(moe.experts)
        self.gate_width = moe.gate.input.weight.shape[1]
        self.num_experts = len(experts)
        with torch.no_grad():
            self.input_weight = torch.cat(
                [moe.gate.input.weight, *(e.input.weight for e in experts)], dim=1
            ).contiguous()
            self.input_bias = torch.cat([moe.gate.input.bias, *(e.input.bias for e in experts)])
            self.gate_layers = [
                (layer.weight.t().contiguous(), layer.bias) for layer in moe.gate.layers
            ]
            # (K, in, out) weights and (K, 1, out) biases, one pair per expert layer.
            self.expert_layers = [
                (
                    torch.stack([e.layers[i].weight.t() for e in experts]).contiguous(),
                    torch.stack([e.layers[i].bias for e in experts]).unsqueeze(1),
                )
                for i in range(len(experts[0].layers))
            ]

    def forward(self, x: SparseBatch) -> torch.Tensor:
        """Each layer after the first takes the ReLU of the previous one's output, taken
        in place here: this call made those tensors, and the values are the same."""
        first = F.embedding_bag(
            x.indices, self.input_weight, x.offsets, mode="sum", per_sample_weights=x.values
        )
        first.add_(self.input_bias).relu_()
        gate = first[:, : self.gate_width]
        for layer, (weight, bias) in enumerate(self.gate_layers):
            gate = torch.addmm(bias, gate.relu_() if layer else gate, weight)
        # (batch, K * hidden) -> (K, batch, hidden): one matmul per layer for all experts.
        hidden = first[:, self.gate_width :].reshape(first.shape[0], self.num_experts, -1)
        hidden = hidden.transpose(0, 1)
        for layer, (weight, bias) in enumerate(self.expert_layers):
            hidden = torch.baddbmm(bias, hidden.relu_() if layer else hidden, weight)
        expert_out = hidden.squeeze(2).t()  # (batch, K)
        return (torch.softmax(gate, dim=1) * expert_out).sum(dim=1)


def for_inference(net: nn.Module) -> nn.Module:
    """The module to predict with: a mixture is fused, anything else used as trained."""
    return FusedMixture(net) if isinstance(net, MixtureOfExperts) else net
