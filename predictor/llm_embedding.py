"""S3-style baseline: a frozen local language-model encoder plus a small MLP head.

The encoder is loaded only from a local directory (transformers AutoModel and
AutoTokenizer with `local_files_only=True`); nothing is downloaded from a hub.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from predictor.base import PredictionInput
from predictor.features import SparseRows, numeric_features
from predictor.nets import resolve_device
from predictor.neural import MLPPredictor

__all__ = ["EncoderFeaturizer", "LLMEmbeddingPredictor", "load_local_encoder", "mean_pooled"]

_UNPICKLED = ("encoder_", "tokenizer_")  # reloaded from encoder_path, never pickled


def mean_pooled(
    encoder: Any, tokenizer: Any, texts: list[str], max_length: int, device: torch.device
) -> torch.Tensor:
    """Mean of the encoder's last hidden states over real (non-padding) tokens; keeps
    the autograd graph, so it serves fine-tuning as well as frozen embedding."""
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt").to(device)
    states = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    return (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def load_local_encoder(encoder_path: str, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory; raises if anything would be downloaded."""
    from transformers import AutoModel, AutoTokenizer

    if not Path(encoder_path).is_dir():
        raise FileNotFoundError(f"encoder directory not found: {encoder_path}")
    tokenizer = AutoTokenizer.from_pretrained(encoder_path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    model = AutoModel.from_pretrained(encoder_path, local_files_only=True)
    return model.to(device).eval(), tokenizer


class EncoderFeaturizer(BaseEstimator):
    """Standardised mean-pooled encoder states | numeric counts | task one-hot, as CSR."""

    def __init__(
        self,
        encoder_path: str,
        max_length: int = 256,
        batch_size: int = 32,
        use_task: bool = True,
        device: str = "auto",
    ) -> None:
        self.encoder_path = encoder_path
        self.max_length = max_length
        self.batch_size = batch_size
        self.use_task = use_task
        self.device = device

    def load_encoder(self) -> Self:
        """(Re)load the encoder weights, e.g. after unpickling."""
        self.encoder_, self.tokenizer_ = load_local_encoder(
            self.encoder_path, resolve_device(self.device)
        )
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in _UNPICKLED}

    def fit(self, inputs: Sequence[PredictionInput]) -> Self:
        self.fit_transform(inputs)
        return self

    def fit_transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        """Fit and featurise in one encoder pass (the encoder is the expensive part)."""
        self.load_encoder()
        dense = self._dense(inputs)
        self.mean_ = dense.mean(axis=0)
        self.std_ = np.maximum(dense.std(axis=0), 1e-6)
        tasks = {inp.task for inp in inputs if inp.task is not None} if self.use_task else set()
        self.task_index_ = {task: i for i, task in enumerate(sorted(tasks))}
        self.num_features_ = dense.shape[1] + len(tasks)
        return self._assemble(dense, inputs)

    def transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        check_is_fitted(self)
        return self._assemble(self._dense(inputs), inputs)

    def sparse_rows(self, inputs: Sequence[PredictionInput]) -> SparseRows:
        return SparseRows.from_csr(self.transform(inputs))

    def _assemble(self, dense: np.ndarray, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        """Standardised dense features plus the task one-hot, as CSR."""
        one_hot = np.zeros((len(inputs), len(self.task_index_)), dtype=np.float32)
        for row, inp in enumerate(inputs):
            if inp.task in self.task_index_:
                one_hot[row, self.task_index_[inp.task]] = 1.0
        standardised = (dense - self.mean_) / self.std_
        return sp.csr_matrix(np.hstack([standardised, one_hot]), dtype=np.float32)

    def _dense(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        """Raw mean-pooled embeddings and numeric counts, one row per input."""
        texts = [inp.text for inp in inputs]
        unique = list(dict.fromkeys(texts))  # augmented rows repeat texts: embed each once
        by_text = dict(zip(unique, self._embed(unique), strict=True))
        rows = np.stack([by_text[t] for t in texts])
        return np.hstack([rows, numeric_features(inputs)]).astype(np.float32)

    def _embed(self, texts: list[str]) -> list[np.ndarray]:
        """Mean of the last hidden states over real (non-padding) tokens."""
        device = next(self.encoder_.parameters()).device
        out: list[np.ndarray] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                pooled = mean_pooled(self.encoder_, self.tokenizer_,
                                     texts[start : start + self.batch_size],
                                     self.max_length, device)
                out.extend(pooled.float().cpu().numpy())
        return out


class LLMEmbeddingPredictor(MLPPredictor):
    """Frozen encoder embeddings -> 3-layer MLP head on log length."""

    kind = "llm_embedding"
    num_layers = 3

    def __init__(
        self,
        encoder_path: str | None = None,
        hidden_dim: int = 64,
        epochs: int = 30,
        batch_size: int = 64,
        learning_rate: float = 1e-3,
        weight_decay: float = 1e-4,
        loss: str = "l1",
        max_length: int = 256,
        use_task: bool = True,
        num_augment: int = 1,
        device: str = "auto",
        random_state: int = 0,
        show_progress: bool = False,
        survival_floor: bool = True,
    ) -> None:
        self.encoder_path = encoder_path
        self.hidden_dim = hidden_dim
        self.epochs = epochs
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.loss = loss
        self.max_length = max_length
        self.use_task = use_task
        self.num_augment = num_augment
        self.device = device
        self.random_state = random_state
        self.show_progress = show_progress
        self.survival_floor = survival_floor

    def _make_featurizer(self) -> EncoderFeaturizer:
        if self.encoder_path is None:
            raise ValueError("llm_embedding needs encoder_path: a local encoder directory")
        return EncoderFeaturizer(
            self.encoder_path, self.max_length, use_task=self.use_task, device=self.device
        )

    def _load_state(self, directory: Path) -> None:
        """The encoder is not saved with the head: it is reloaded from `encoder_path`."""
        super()._load_state(directory)
        self.featurizer_.set_params(encoder_path=self.encoder_path, device=self.device)
        self.featurizer_.load_encoder()
