"""Output-length prediction for GoodServe routing (docs/predictor.md).

Public names are imported lazily (PEP 562) so that `import predictor` stays cheap and
torch/transformers load only when a model is built or loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PredictionInput": "predictor.base",
    "Predictor": "predictor.base",
    "NotFittedError": "predictor.base",
    "MoEPredictor": "predictor.moe",
    "MLPPredictor": "predictor.neural",
    "HistoryPredictor": "predictor.history",
    "TaskHistoryPredictor": "predictor.history",
    "LLMEmbeddingPredictor": "predictor.llm_embedding",
    "PredictionBatcher": "predictor.batching",
    "PredictorKind": "predictor.registry",
    "make_predictor": "predictor.registry",
    "load_predictor": "predictor.registry",
    "load_predictors": "predictor.registry",
    "save_predictors": "predictor.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'predictor' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
