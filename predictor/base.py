"""The predictor contract shared by the MoE model and every baseline.

The router and the simulator only see `Predictor`: `predict` a batch of
`PredictionInput`s, `observe` finished lengths, `save`/`load`. Estimators follow the
scikit-learn contract: `__init__` stores hyperparameters verbatim, `fit`
returns `self`, learned state lives in trailing-underscore attributes.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

__all__ = ["NotFittedError", "PredictionInput", "Predictor", "validate_training_data"]

PARAMS_FILE = "params.json"


@dataclass(frozen=True, slots=True)
class PredictionInput:
    """What the router knows about a request when it asks for its output length.

    There is no output text in the training data nor in the simulator, so
    `generated_text` is usually empty and `num_generated_tokens` carries the progress.
    """

    prompt: str
    generated_text: str = ""
    num_generated_tokens: int = 0
    task: str | None = None  # declared task type (request metadata), if any

    def __post_init__(self) -> None:
        if self.num_generated_tokens < 0:
            raise ValueError(f"num_generated_tokens must be >= 0, got {self.num_generated_tokens}")

    @property
    def text(self) -> str:
        """The token window seen so far: prompt plus generated tokens."""
        if not self.generated_text:
            return self.prompt
        return f"{self.prompt} {self.generated_text}"


def validate_training_data(
    inputs: Sequence[PredictionInput], output_lengths: Sequence[int]
) -> np.ndarray:
    """Check `fit` arguments and return the lengths as an int64 array."""
    lengths = np.asarray(output_lengths, dtype=np.int64)
    if lengths.ndim != 1 or len(lengths) != len(inputs):
        raise ValueError(f"got {len(inputs)} inputs but {lengths.size} output lengths")
    if len(lengths) == 0:
        raise ValueError("cannot fit on zero requests")
    if np.any(lengths < 1):
        raise ValueError("output lengths must be >= 1 token")
    generated = np.array([inp.num_generated_tokens for inp in inputs])
    if np.any(lengths <= generated):
        raise ValueError("an output length must exceed its input's num_generated_tokens")
    return lengths


class Predictor(BaseEstimator, ABC):
    """Predicts the total output length (tokens) of requests.

    A prediction is never below `num_generated_tokens + 1`: a request that has produced
    k tokens and is still running will produce at least one more.
    """

    kind: ClassVar[str]  # registry key, e.g. "moe"

    @abstractmethod
    def fit(self, inputs: Sequence[PredictionInput], output_lengths: Sequence[int]) -> Self:
        """Learn from finished requests; replaces any previous fit."""

    @abstractmethod
    def _predict_lengths(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        """Raw predicted total lengths, before the progress floor."""

    @abstractmethod
    def _save_state(self, directory: Path) -> None:
        """Write learned state (not hyperparameters) into `directory`."""

    @abstractmethod
    def _load_state(self, directory: Path) -> None:
        """Restore learned state written by `_save_state`."""

    def predict(self, inputs: Sequence[PredictionInput]) -> np.ndarray:
        """Predicted total output lengths (float64, one per input)."""
        check_is_fitted(self)
        if len(inputs) == 0:
            return np.zeros(0, dtype=np.float64)
        raw = np.asarray(self._predict_lengths(inputs), dtype=np.float64)
        floor = np.array([inp.num_generated_tokens + 1 for inp in inputs], dtype=np.float64)
        return np.maximum(raw, floor)

    def observe(self, output_length: int, task: str | None = None) -> None:
        """Record a finished request's length; only history predictors use it. No
        fitted check: the router calls it at every finish, where scikit-learn's check
        costs more than the recording (`predict` checks)."""

    def save(self, directory: str | Path) -> Path:
        """Write hyperparameters and learned state to `directory` (created if absent)."""
        check_is_fitted(self)
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / PARAMS_FILE).write_text(json.dumps(self.get_params(), indent=2, sort_keys=True))
        self._save_state(path)
        return path

    @classmethod
    def load(cls, directory: str | Path, **param_overrides: object) -> Self:
        """Rebuild a fitted predictor from `save` output; no training data needed."""
        path = Path(directory)
        params = json.loads((path / PARAMS_FILE).read_text())
        params.update(param_overrides)
        predictor = cls(**params)
        predictor._load_state(path)
        return predictor
