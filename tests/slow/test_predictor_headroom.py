"""The predictor headroom benchmark: its reference points are ordered as they must be."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks import predictor_headroom
from predictor.synthetic import make_synthetic_records
from tests.unit.torch_utils import build_tiny_encoder

pytestmark = pytest.mark.slow


def write_synthetic_prompts(path: Path) -> list[str]:
    """400 synthetic rows, two answering models; returns the prompts."""
    records = make_synthetic_records(400, answers_per_prompt=2, seed=3)
    with path.open("w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({
                "prompt_id": r.prompt_id, "prompt": r.prompt, "output_tokens": r.output_tokens,
                "task": r.task, "source": r.task, "model": f"m{i % 2}",
            }) + "\n")
    return [r.prompt for r in records]


def run_headroom(*args: str) -> tuple[int, str, dict[str, float]]:
    """(exit code, output, reference -> MAE over all rows)."""
    import typer

    app = typer.Typer()
    app.command()(predictor_headroom.main)
    result = CliRunner().invoke(app, list(args))
    mae = {m[0]: float(m[1]) for m in re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|", result.output,
                                                  re.M)}
    return result.exit_code, result.output, mae


def test_reference_points_on_synthetic_prompts(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    write_synthetic_prompts(data)
    code, output, mae = run_headroom("--data", str(data), "--seeds", "0")
    assert code == 0, output
    assert set(mae) == {
        "global median", "per-task median", "per-(task, model) median",
        "per-prompt median (floor)", "kNN (k=20, same task)", "gradient boosting",
        "moe (project default)",
    }
    # the text sets the length here: the floor and the text learners beat the task median
    assert mae["per-prompt median (floor)"] < mae["moe (project default)"]
    for learner in ("kNN (k=20, same task)", "gradient boosting", "moe (project default)"):
        assert mae[learner] < mae["per-task median"] < mae["global median"], learner


def test_a_local_encoder_is_fine_tuned_into_its_own_row(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    encoder = build_tiny_encoder(tmp_path / "tiny-encoder", write_synthetic_prompts(data))
    code, output, mae = run_headroom("--data", str(data), "--seeds", "0", "--encoder",
                                     str(encoder), "--encoder-epochs", "0.2")
    assert code == 0, output
    assert 0 < mae["fine-tuned tiny-encoder"] < mae["global median"] * 10


def test_missing_inputs_are_clear_errors(tmp_path) -> None:
    code, output, _ = run_headroom("--data", str(tmp_path / "none.jsonl"))
    assert code == 2 and "no such file" in output
    data = tmp_path / "prompts.jsonl"
    data.write_text("")
    code, output, _ = run_headroom("--data", str(data), "--encoder", str(tmp_path / "none"))
    assert code == 2 and "no such encoder directory" in output
