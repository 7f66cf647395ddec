"""Torch predictors on TF-IDF features: shared plumbing and the single-MLP baseline."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import joblib
import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from predictor.base import PredictionInput, Predictor, validate_training_data
from predictor.features import (
    AugmentedData,
    Featurizer,
    SparseRows,
    TextFeaturizer,
    augment_truncated,
)
from predictor.history import TaskHistoryPredictor
from predictor.nets import MLP, SparseBatch, for_inference, resolve_device
from predictor.training import TrainConfig, log_length_loss, train_loop

__all__ = ["MLPPredictor", "TextNetPredictor"]

FEATURIZER_FILE = "featurizer.joblib"
WEIGHTS_FILE = "weights.pt"
META_FILE = "meta.json"
SURVIVAL_DIR = "survival"
INFERENCE_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class TrainingSet:
    """Featurised, augmented rows with log-length targets."""

    augmented: AugmentedData
    features: sp.csr_matrix
    targets: torch.Tensor  # log(total output length) per row, on the training device


class TextNetPredictor(Predictor):
    """A torch network over featurised rows that outputs log(total output length).

    Subclasses build the network and train it; this class owns featurising,
    augmentation, inference and persistence.

    `survival_floor`: once a request has generated k > 0 tokens, the prediction is at
    least the median of the training lengths (of its task) that exceed k. On the shared
    data the text nets, trained on truncated-output rows, under-predict requests that
    outlive their text-based estimate (they memorise training prompts, so the learnt
    conditional is over-confident); the empirical survival median is calibrated there.
    """

    # Hyperparameters every subclass takes in __init__.
    batch_size: int
    learning_rate: float
    weight_decay: float
    loss: str
    max_features: int
    use_task: bool
    num_augment: int
    device: str
    random_state: int
    show_progress: bool
    survival_floor: bool

    def _make_featurizer(self) -> Featurizer:
        """An unfitted featurizer (TF-IDF here; the LLM baseline swaps in an encoder)."""
        return TextFeaturizer(self.max_features, use_task=self.use_task)

    @abstractmethod
    def _build_net(self, in_dim: int, gen: torch.Generator) -> nn.Module:
        """A fresh network for `in_dim` input features."""

    @abstractmethod
    def _train_net(self, data: TrainingSet, rng: np.random.Generator, gen: torch.Generator) -> None:
        """Train `self.net_` on `data`."""

    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        lengths = validate_training_data(inputs, output_lengths)
        rng = np.random.default_rng(self.random_state)
        gen = torch.Generator().manual_seed(self.random_state)
        self.device_ = resolve_device(self.device)
        augmented = augment_truncated(inputs, lengths, self.num_augment, rng)
        # Fit on augmented rows so the num_generated_tokens column has a real spread.
        self.featurizer_ = self._make_featurizer()
        features = self.featurizer_.fit_transform(augmented.inputs)
        targets = np.log(augmented.output_lengths)
        data = TrainingSet(
            augmented, features, torch.tensor(targets, dtype=torch.float32, device=self.device_)
        )
        self.max_log_length_ = float(np.log(lengths.max()))
        self.net_ = self._build_net(self.featurizer_.num_features_, gen).to(self.device_)
        self.net_.train()
        self._train_net(data, rng, gen)
        self.net_.eval()
        self.inference_net_ = for_inference(self.net_)
        self.survival_ = TaskHistoryPredictor(window_size=len(lengths)).fit(inputs, lengths)
        return self

    def observe(self, output_length: int, task: str | None = None) -> None:
        """Finished lengths keep the survival floor current."""
        super().observe(output_length, task)
        self.survival_.observe(output_length, task)

    def batch(self, features: sp.csr_matrix, rows: np.ndarray | None = None) -> SparseBatch:
        """Rows of a feature matrix as a SparseBatch on this predictor's device."""
        return SparseBatch.from_csr(features if rows is None else features[rows], self.device_)

    def predict_log(self, features: SparseRows) -> np.ndarray:
        """Network output (log length) for already featurised rows, in chunks."""
        outputs = []
        with torch.inference_mode():
            for start in range(0, features.num_rows, INFERENCE_CHUNK_ROWS):
                rows = features.rows(start, min(start + INFERENCE_CHUNK_ROWS, features.num_rows))
                chunk = SparseBatch.from_rows(rows, self.device_)
                outputs.append(self.inference_net_(chunk).reshape(-1).float().cpu().numpy())
        return np.concatenate(outputs)

    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        """The net's median, capped at the longest training length; past k = 0, never
        below the task's survival median (see `survival_floor`)."""
        log_lengths = self.predict_log(self.featurizer_.sparse_rows(inputs))
        lengths = np.exp(np.clip(log_lengths, 0.0, self.max_log_length_))
        rechecked = [i for i, inp in enumerate(inputs) if inp.num_generated_tokens > 0]
        if self.survival_floor and rechecked:
            floor = self.survival_.predict([inputs[i] for i in rechecked])
            lengths[rechecked] = np.maximum(lengths[rechecked], floor)
        return lengths

    def _save_state(self, directory: Path) -> None:
        joblib.dump(self.featurizer_, directory / FEATURIZER_FILE)
        torch.save(self.net_.state_dict(), directory / WEIGHTS_FILE)
        self.survival_.save(directory / SURVIVAL_DIR)
        meta = {"max_log_length": self.max_log_length_, **self._meta()}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))

    def _load_state(self, directory: Path) -> None:
        """Note: the featurizer is a pickle; load only model directories you trust."""
        self.device_ = resolve_device(self.device)
        self.featurizer_ = joblib.load(directory / FEATURIZER_FILE)
        meta = json.loads((directory / META_FILE).read_text())
        self.max_log_length_ = float(meta["max_log_length"])
        self.survival_ = TaskHistoryPredictor.load(directory / SURVIVAL_DIR)
        self._restore_meta(meta)
        gen = torch.Generator().manual_seed(self.random_state)
        net = self._build_net(self.featurizer_.num_features_, gen)
        state = torch.load(directory / WEIGHTS_FILE, map_location="cpu", weights_only=True)
        net.load_state_dict(state)
        self.net_ = net.to(self.device_).eval()
        self.inference_net_ = for_inference(self.net_)

    def _meta(self) -> dict[str, object]:
        """Learned values besides featurizer and weights, as JSON."""
        return {}

    def _restore_meta(self, meta: dict[str, object]) -> None:
        """Inverse of `_meta`."""

    def _train_config(self, epochs: int) -> TrainConfig:
        return TrainConfig(
            epochs=epochs,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            weight_decay=self.weight_decay,
            loss=self.loss,
            show_progress=self.show_progress,
        )


def init_output_bias(layer: nn.Linear, targets: torch.Tensor) -> None:
    """Start the output at the median log length so early epochs are not wasted."""
    with torch.no_grad():
        layer.bias.fill_(float(targets.median()))


class MLPPredictor(TextNetPredictor):
    """STAR-style baseline: one 4-layer MLP on the same features as the MoE."""

    kind = "mlp"
    num_layers = 4  # linear layers, as in STAR

    def __init__(
        self,
        hidden_dim: int = 128,
        epochs: int = 6,
        batch_size: int = 128,
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
        self.hidden_dim = hidden_dim
        self.epochs = epochs
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
        return MLP(in_dim, self.hidden_dim, 1, num_layers=self.num_layers, gen=gen)

    def _train_net(self, data: TrainingSet, rng: np.random.Generator, gen: torch.Generator) -> None:
        init_output_bias(self.net_.layers[-1], data.targets)

        def batch_loss(rows: np.ndarray) -> torch.Tensor:
            pred = self.net_(self.batch(data.features, rows)).reshape(-1)
            return log_length_loss(pred, data.targets[rows], self.loss)

        num_rows = len(data.targets)
        config = self._train_config(self.epochs)
        train_loop(self.net_.parameters(), num_rows, batch_loss, config, gen, self.kind)
