"""MoE and baselines: determinism, accuracy on text-dependent data, the progress floor."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from predictor.base import NotFittedError, PredictionInput
from predictor.data import split_by_prompt_id
from predictor.history import HistoryPredictor, LengthWindow, TaskHistoryPredictor
from predictor.moe import MoEPredictor, assign_tiers, split_halves
from predictor.neural import MLPPredictor
from predictor.pipeline import evaluate_predictor
from predictor.synthetic import make_synthetic_records
from tests.unit.torch_utils import one_torch_thread  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.unit

FAST = {
    "max_features": 256,
    "batch_size": 32,
    "learning_rate": 1e-2,
    "device": "cpu",
    "random_state": 0,
}


def fast_moe(**overrides: object) -> MoEPredictor:
    params = {"num_experts": 4, "expert_hidden_dim": 16, "gate_hidden_dim": 16}
    params |= {"expert_epochs": 20, "gate_epochs": 10, **FAST, **overrides}
    return MoEPredictor(**params)


def fast_mlp() -> MLPPredictor:
    return MLPPredictor(hidden_dim=16, epochs=20, **FAST)


@pytest.fixture(scope="module")
def split():
    train, test = split_by_prompt_id(make_synthetic_records(200, seed=0), 0.25, seed=0)
    return [r.to_input() for r in train], [r.output_tokens for r in train], test


@pytest.fixture(scope="module")
def moe(split):
    inputs, lengths, _ = split
    with torch.random.fork_rng():  # prove fitting does not depend on the global RNG
        torch.manual_seed(123)
        return fast_moe().fit(inputs, lengths)


def test_training_is_deterministic_for_a_seed(split, moe):
    inputs, lengths, test = split
    again = fast_moe().fit(inputs, lengths)
    probe = [r.to_input() for r in test]
    np.testing.assert_array_equal(moe.predict(probe), again.predict(probe))
    other_seed = fast_moe(random_state=1).fit(inputs, lengths)
    assert not np.array_equal(moe.predict(probe), other_seed.predict(probe))


def test_text_models_beat_history_on_held_out_prompts(split, moe):
    inputs, lengths, test = split
    history = evaluate_predictor(HistoryPredictor().fit(inputs, lengths), test)
    task_history = evaluate_predictor(TaskHistoryPredictor().fit(inputs, lengths), test)
    moe_result = evaluate_predictor(moe, test)
    mlp_result = evaluate_predictor(fast_mlp().fit(inputs, lengths), test)
    # History ignores the text, so it is a constant per task: the text models must
    # cut its error at least in half on this data.
    assert moe_result.mae < 0.5 * history.mae
    assert moe_result.mae < 0.5 * task_history.mae
    assert mlp_result.mae < 0.5 * history.mae
    assert moe_result.nmae == pytest.approx(
        moe_result.mae / np.mean([r.output_tokens for r in test])
    )


def test_prediction_never_at_or_below_generated_tokens(split, moe):
    inputs, lengths, _ = split
    predictors = [moe, HistoryPredictor().fit(inputs, lengths)]
    predictors.append(TaskHistoryPredictor().fit(inputs, lengths))
    for k in (0, 1, 7, 300, 5000, 10**6):
        probe = [PredictionInput(inp.prompt, "", k, inp.task) for inp in inputs[:20]]
        for predictor in predictors:
            assert np.all(predictor.predict(probe) >= k + 1), type(predictor).__name__


def test_re_prediction_grows_with_progress(moe):
    prompt = "Please write a paragraph about topic 7: alpha beta."
    totals = moe.predict([PredictionInput(prompt, "", k, "chat") for k in (0, 200, 800)])
    assert totals[0] < totals[1] < totals[2]


def test_survival_floor_applies_only_after_generation_starts(split, moe):
    inputs, lengths, _ = split
    survival = TaskHistoryPredictor(window_size=len(lengths)).fit(inputs, lengths)
    no_floor = copy.copy(moe).set_params(survival_floor=False)  # shares the fitted net
    probe = [PredictionInput(inp.prompt, "", k, inp.task) for inp in inputs[:30] for k in (5, 60)]
    assert np.all(moe.predict(probe) >= survival.predict(probe))
    assert np.any(no_floor.predict(probe) < survival.predict(probe))  # the floor binds
    at_start = [PredictionInput(inp.prompt, "", 0, inp.task) for inp in inputs[:30]]
    np.testing.assert_array_equal(moe.predict(at_start), no_floor.predict(at_start))


def test_estimator_contract():
    moe = fast_moe()
    assert moe.get_params()["num_experts"] == 4
    assert moe.set_params(num_experts=9) is moe and moe.num_experts == 9
    assert not any(name.endswith("_") for name in vars(moe))  # __init__ learns nothing
    with pytest.raises(NotFittedError):
        moe.predict([PredictionInput("hello")])
    with pytest.raises(NotFittedError):
        HistoryPredictor().predict([PredictionInput("hello")])


def test_bad_fit_arguments_are_rejected(split):
    inputs, lengths, _ = split
    with pytest.raises(ValueError, match="perfect square"):
        fast_moe(num_experts=5).fit(inputs, lengths)
    with pytest.raises(ValueError, match="2 inputs but 1"):
        HistoryPredictor().fit(inputs[:2], lengths[:1])
    with pytest.raises(ValueError, match=">= 1 token"):
        HistoryPredictor().fit(inputs[:1], [0])
    with pytest.raises(ValueError, match="num_generated_tokens"):
        PredictionInput("hi", num_generated_tokens=-1)


def test_tiers_are_quantiles_of_both_lengths():
    words = np.array([1, 2, 3, 10, 20, 30, 100, 200, 300])
    outputs = np.array([5, 50, 500, 5, 50, 500, 5, 50, 500])
    tiers = assign_tiers(words, outputs, num_tiers=3)
    np.testing.assert_array_equal(tiers.subsets, [0, 1, 2, 3, 4, 5, 6, 7, 8])


def test_halves_keep_each_prompt_on_one_side():
    inputs = [PredictionInput(f"prompt {i % 10}") for i in range(40)]
    mask = split_halves(inputs, np.random.default_rng(0))
    by_prompt = {}
    for inp, side in zip(inputs, mask, strict=True):
        assert by_prompt.setdefault(inp.prompt, side) == side
    assert 0 < mask.sum() < len(mask)


def test_length_window_conditional_median():
    window = LengthWindow(size=5, lengths=[10, 20, 30, 40, 50])
    got = window.predict(np.array([0.0, 25.0, 45.0, 60.0]), quantile=0.5)
    np.testing.assert_array_equal(got, [30.0, 40.0, 50.0, 120.0])  # outlived all: 2k
    window.observe(1000)  # evicts 10
    assert window.predict(np.array([0.0]), quantile=0.5)[0] == 40.0


def test_task_history_uses_task_window_and_falls_back_to_global():
    inputs = [PredictionInput("q", task="short")] * 30 + [PredictionInput("q", task="long")] * 30
    lengths = [10] * 30 + [1000] * 30
    predictor = TaskHistoryPredictor(min_task_samples=20).fit(inputs, lengths)
    probe = [PredictionInput("q", task=t) for t in ("short", "long", None, "unseen")]
    np.testing.assert_array_equal(predictor.predict(probe), [10.0, 1000.0, 10.0, 10.0])
    for _ in range(31):
        predictor.observe(5000, task="long")
    assert predictor.predict([PredictionInput("q", task="long")])[0] == 5000.0
