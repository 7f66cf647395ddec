"""Predictor kinds, construction by kind, and saving/loading a set of predictors.

A model directory holds one sub-directory per predictor plus `manifest.json`:
`{"format_version": 1, "predictors": {name: {"kind": ..., "path": ...}}}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

from predictor.base import Predictor

__all__ = [
    "PredictorKind",
    "load_predictor",
    "load_predictors",
    "make_predictor",
    "predictor_class",
    "save_predictors",
    "saved_predictor_names",
]

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class PredictorKind(StrEnum):
    MOE = "moe"
    HISTORY = "history"
    HISTORY_TASK = "history_task"
    MLP = "mlp"
    LLM_EMBEDDING = "llm_embedding"


def predictor_class(kind: str | PredictorKind) -> type[Predictor]:
    """The class for `kind`; imported lazily so history users need no torch import."""
    try:
        kind = PredictorKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in PredictorKind)
        raise ValueError(f"unknown predictor kind {kind!r}; expected one of {known}") from None
    if kind is PredictorKind.MOE:
        from predictor.moe import MoEPredictor

        return MoEPredictor
    if kind is PredictorKind.MLP:
        from predictor.neural import MLPPredictor

        return MLPPredictor
    if kind is PredictorKind.LLM_EMBEDDING:
        from predictor.llm_embedding import LLMEmbeddingPredictor

        return LLMEmbeddingPredictor
    from predictor.history import HistoryPredictor, TaskHistoryPredictor

    return HistoryPredictor if kind is PredictorKind.HISTORY else TaskHistoryPredictor


def make_predictor(kind: str | PredictorKind, **params: object) -> Predictor:
    """An unfitted predictor of `kind` with the given hyperparameters."""
    return predictor_class(kind)(**params)


def save_predictors(predictors: Mapping[str, Predictor], directory: str | Path) -> Path:
    """Save fitted predictors under `directory`, one sub-directory each, plus a manifest."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, predictor in predictors.items():
        predictor.save(root / name)
        entries[name] = {"kind": predictor.kind, "path": name}
    manifest = {"format_version": FORMAT_VERSION, "predictors": entries}
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return root


def _read_manifest(root: Path) -> dict[str, dict[str, str]]:
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no predictor manifest at {path}; run `predictor train` first")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format_version {manifest.get('format_version')}")
    return manifest["predictors"]


def load_predictor(
    directory: str | Path, name: str = "moe", **param_overrides: object
) -> Predictor:
    """Load one saved predictor (the MoE by default); e.g. `device="cpu"` to override."""
    root = Path(directory)
    entries = _read_manifest(root)
    if name not in entries:
        raise KeyError(f"{root} has no predictor {name!r}; it has {sorted(entries)}")
    entry = entries[name]
    return predictor_class(entry["kind"]).load(root / entry["path"], **param_overrides)


def load_predictors(directory: str | Path) -> dict[str, Predictor]:
    """Load every predictor listed in the manifest."""
    root = Path(directory)
    return {name: load_predictor(root, name) for name in _read_manifest(root)}


def saved_predictor_names(directory: str | Path) -> list[str]:
    """Names in a model directory's manifest, without loading anything."""
    return list(_read_manifest(Path(directory)))
