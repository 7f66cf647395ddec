"""Data loading errors, save/load round trips, and the `predictor` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from predictor.base import PredictionInput
from predictor.cli import app
from predictor.data import DataError, load_records, split_by_prompt_id
from predictor.history import HistoryPredictor, TaskHistoryPredictor
from predictor.moe import MoEPredictor
from predictor.neural import MLPPredictor
from predictor.registry import load_predictor, load_predictors, make_predictor, save_predictors
from predictor.synthetic import make_synthetic_records
from tests.unit.torch_utils import one_torch_thread  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.unit

SMALL = {"max_features": 128, "batch_size": 32, "learning_rate": 1e-2, "device": "cpu"}


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def synthetic_rows(num_prompts: int) -> list[dict[str, object]]:
    return [
        {
            "prompt_id": r.prompt_id,
            "task": r.task,
            "prompt": r.prompt,
            "output_tokens": r.output_tokens,
        }
        for r in make_synthetic_records(num_prompts, seed=1)
    ]


GOOD = {"prompt": "hi", "output_tokens": 3}


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"prompt": "", "output_tokens": 3}, r":2: 'prompt' must be a non-empty string"),
        ({"prompt": "   ", "output_tokens": 3}, r":2: 'prompt' must be a non-empty string"),
        ({"output_tokens": 3}, r":2: missing field 'prompt'"),
        ({"prompt": "hi"}, r":2: missing field 'output_tokens'"),
        ({"prompt": "hi", "output_tokens": 2.5}, r":2: 'output_tokens' must be an integer"),
        ({"prompt": "hi", "output_tokens": "7"}, r":2: 'output_tokens' must be an integer"),
        ({"prompt": "hi", "output_tokens": 0}, r":2: 'output_tokens' must be >= 1"),
        ("{not json", r":2: invalid JSON"),
        ("[1, 2]", r":2: expected a JSON object"),
    ],
)
def test_bad_rows_name_their_line(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, bad_row])
    with pytest.raises(DataError, match=message):
        load_records(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_records(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="no records"):
        load_records(write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_split_never_separates_a_prompt(tmp_path):
    records = load_records(write_jsonl(tmp_path / "d.jsonl", synthetic_rows(50)))
    train, test = split_by_prompt_id(records, 0.2, seed=3)
    assert {r.prompt_id for r in train}.isdisjoint({r.prompt_id for r in test})
    assert len(train) + len(test) == len(records) and len({r.prompt_id for r in test}) == 10


def fitted_predictors() -> dict[str, object]:
    records = make_synthetic_records(60, seed=2)
    inputs, lengths = [r.to_input() for r in records], [r.output_tokens for r in records]
    moe = MoEPredictor(
        num_experts=4,
        expert_hidden_dim=8,
        gate_hidden_dim=8,
        expert_epochs=2,
        gate_epochs=2,
        **SMALL,
    )
    mlp = MLPPredictor(hidden_dim=8, epochs=2, **SMALL)
    return {
        "moe": moe.fit(inputs, lengths),
        "mlp": mlp.fit(inputs, lengths),
        "history": HistoryPredictor().fit(inputs, lengths),
        "history_task": TaskHistoryPredictor().fit(inputs, lengths),
    }


def test_save_load_round_trip_gives_identical_predictions(tmp_path):
    predictors = fitted_predictors()
    save_predictors(predictors, tmp_path / "models")
    loaded = load_predictors(tmp_path / "models")
    probe = [PredictionInput("Please write a paragraph on gardens", "", k, "chat") for k in (0, 50)]
    probe.append(PredictionInput("never seen words entirely", "and some output", 3, None))
    assert set(loaded) == set(predictors)
    for name, predictor in predictors.items():
        assert type(loaded[name]) is type(predictor)
        assert loaded[name].get_params() == predictor.get_params()
        np.testing.assert_array_equal(loaded[name].predict(probe), predictor.predict(probe))
    assert load_predictor(tmp_path / "models").kind == "moe"


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no predictor manifest"):
        load_predictor(tmp_path)
    save_predictors({"history": fitted_predictors()["history"]}, tmp_path)
    with pytest.raises(KeyError, match="has no predictor 'moe'"):
        load_predictor(tmp_path, "moe")
    with pytest.raises(ValueError, match="unknown predictor kind"):
        make_predictor("oracle")


def test_cli_train_then_eval_json(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", synthetic_rows(40))
    runner = CliRunner()
    models = tmp_path / "m"
    train_args = ["train", "--data", str(data), "--out", str(models), "--experts", "4"]
    trained = runner.invoke(app, [*train_args, "--seed", "1", "--no-progress"])
    assert trained.exit_code == 0, trained.output
    result = runner.invoke(app, ["eval", "--data", str(data), "--model", str(models), "--json"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    assert set(scores) == {"moe", "history", "history_task", "mlp"}
    mean_length = np.mean([r["output_tokens"] for r in synthetic_rows(40)])
    for score in scores.values():
        assert score["mae"] >= 0 and score["latency_ms_per_request"] > 0
        assert score["nmae"] == pytest.approx(score["mae"] / mean_length)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([GOOD, {"prompt": "", "output_tokens": 3}], "d.jsonl:2: 'prompt' must be a non-empty"),
        ([GOOD, GOOD, {"prompt": "x", "output_tokens": "many"}], "d.jsonl:3: 'output_tokens'"),
        ([{"output_tokens": 3}], "d.jsonl:1: missing field 'prompt'"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, rows, message):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    result = CliRunner().invoke(app, ["train", "--data", str(data), "--out", str(tmp_path / "m")])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_cli_missing_file_and_model_dir(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--data", str(tmp_path / "nope.jsonl"), "--out", "x"])
    assert result.exit_code == 2 and "no such file" in result.output
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    result = runner.invoke(app, ["eval", "--data", str(data), "--model", str(tmp_path)])
    assert result.exit_code == 2 and "no predictor manifest" in result.output
