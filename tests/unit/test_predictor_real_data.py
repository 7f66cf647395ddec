"""The shared prompt/output-length data loads and splits cleanly (skipped without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from predictor.data import load_records, split_by_prompt_id
from predictor.history import HistoryPredictor, TaskHistoryPredictor
from predictor.pipeline import evaluate_predictor, shuffled_training_data

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts" / "prompt_lengths.jsonl"


@pytest.fixture(scope="module")
def records():
    if not DATA.is_file():
        pytest.skip(f"shared prompt data not found at {DATA} (it is not part of the repo)")
    return load_records(DATA)


def test_shared_data_loads_and_splits_by_prompt(records):
    assert len(records) == 7746
    train, test = split_by_prompt_id(records, 0.2, seed=0)
    assert {r.prompt_id for r in train}.isdisjoint({r.prompt_id for r in test})
    assert 0.15 < len(test) / len(records) < 0.25


def test_declared_task_helps_history_on_shared_data(records):
    train, test = split_by_prompt_id(records, 0.2, seed=0)
    inputs, lengths = shuffled_training_data(train, seed=0)
    history = evaluate_predictor(HistoryPredictor().fit(inputs, lengths), test)
    task_history = evaluate_predictor(TaskHistoryPredictor().fit(inputs, lengths), test)
    assert task_history.mae < 0.8 * history.mae
