"""The predictor headroom benchmark: its reference points are ordered as they must be."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from benchmarks import predictor_headroom
from predictor.synthetic import make_synthetic_records

pytestmark = pytest.mark.unit


def test_reference_points_on_synthetic_prompts(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    with data.open("w") as f:
        for i, r in enumerate(make_synthetic_records(400, answers_per_prompt=2, seed=3)):
            f.write(json.dumps({
                "prompt_id": r.prompt_id, "prompt": r.prompt, "output_tokens": r.output_tokens,
                "task": r.task, "source": r.task, "model": f"m{i % 2}",
            }) + "\n")
    import typer

    app = typer.Typer()
    app.command()(predictor_headroom.main)
    result = CliRunner().invoke(app, ["--data", str(data), "--seeds", "0"])
    assert result.exit_code == 0, result.output
    mae = {m[0]: float(m[1]) for m in re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|", result.output,
                                                  re.M)}
    assert set(mae) == {
        "global median", "per-task median", "per-(task, model) median",
        "per-prompt median (floor)", "kNN (k=20, same task)", "gradient boosting",
        "moe (project default)",
    }
    # the text sets the length here: the floor and the text learners beat the task median
    assert mae["per-prompt median (floor)"] < mae["moe (project default)"]
    for learner in ("kNN (k=20, same task)", "gradient boosting", "moe (project default)"):
        assert mae[learner] < mae["per-task median"] < mae["global median"], learner


def test_missing_data_is_a_clear_error(tmp_path) -> None:
    import typer

    app = typer.Typer()
    app.command()(predictor_headroom.main)
    result = CliRunner().invoke(app, ["--data", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
