"""LLM-embedding baseline on a tiny random encoder built locally (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from predictor.base import PredictionInput
from predictor.cli import app
from predictor.llm_embedding import LLMEmbeddingPredictor
from predictor.registry import load_predictor, save_predictors
from predictor.synthetic import make_synthetic_records
from tests.unit.torch_utils import build_tiny_encoder

pytestmark = pytest.mark.unit



@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def data():
    records = make_synthetic_records(40, seed=5)
    return [r.to_input() for r in records], [r.output_tokens for r in records]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory, data):
    inputs, _ = data
    return build_tiny_encoder(tmp_path_factory.mktemp("encoder"), [i.prompt for i in inputs])


def small(encoder_path: Path | None) -> LLMEmbeddingPredictor:
    path = str(encoder_path) if encoder_path is not None else None
    return LLMEmbeddingPredictor(path, hidden_dim=8, epochs=3, max_length=64, device="cpu")


def test_fit_predict_save_load_round_trip(tmp_path, encoder_dir, data):
    inputs, lengths = data
    predictor = small(encoder_dir).fit(inputs, lengths)
    probe = [
        PredictionInput(i.prompt, "", k, i.task)
        for k, i in zip((0, 5, 900), inputs[:3], strict=True)
    ]
    got = predictor.predict(probe)
    assert got.shape == (3,) and np.all(got >= [1, 6, 901])
    save_predictors({"llm_embedding": predictor}, tmp_path)
    assert not list(tmp_path.rglob("*.safetensors"))  # the encoder is referenced, not copied
    loaded = load_predictor(tmp_path, "llm_embedding")
    np.testing.assert_allclose(loaded.predict(probe), got, rtol=1e-6)


def test_encoder_path_is_required_and_must_exist(tmp_path, data):
    inputs, lengths = data
    with pytest.raises(ValueError, match="needs encoder_path"):
        small(None).fit(inputs, lengths)
    with pytest.raises(FileNotFoundError, match="encoder directory not found"):
        small(tmp_path / "missing").fit(inputs, lengths)


def test_cli_scores_llm_embedding_only_with_encoder(tmp_path, encoder_dir):
    rows = [
        {"prompt": r.prompt, "output_tokens": r.output_tokens, "task": r.task}
        for r in make_synthetic_records(30, seed=6)
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    models, runner = tmp_path / "m", CliRunner()
    common = ["--data", str(data), "--encoder", str(encoder_dir)]
    trained = runner.invoke(app, ["train", *common, "--out", str(models), "--experts", "4"])
    assert trained.exit_code == 0, trained.output
    with_encoder = runner.invoke(app, ["eval", *common, "--model", str(models), "--json"])
    assert with_encoder.exit_code == 0, with_encoder.output
    assert "llm_embedding" in json.loads(with_encoder.stdout)
    plain = runner.invoke(app, ["eval", "--data", str(data), "--model", str(models), "--json"])
    assert "llm_embedding" not in json.loads(plain.stdout)
