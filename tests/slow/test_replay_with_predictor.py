"""`goodserve replay --predictor`: GoodServe routes with a trained MoE end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from app.cli import cli

pytestmark = pytest.mark.slow

PAPER_CLUSTER = Path(__file__).resolve().parents[2] / "configs" / "paper-4gpu.yaml"


def test_replay_uses_the_saved_moe_for_goodserve(tmp_path):
    from predictor.pipeline import train_predictors
    from predictor.registry import save_predictors
    from predictor.synthetic import make_synthetic_records

    records = make_synthetic_records(200, seed=1)
    save_predictors(train_predictors(records, num_experts=4, seed=0), tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_id": r.prompt_id, "source": "synthetic", "task": r.task,
                    "model": "m", "prompt_tokens": 8 * len(r.prompt.split()),
                    "output_tokens": r.output_tokens, "prompt": r.prompt}) + "\n"
        for r in records
    ))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, [
        "replay", "--backend", "sim", "--cluster", str(PAPER_CLUSTER), "--prompts", str(prompts),
        "--arrivals", "poisson", "--rate", "2", "--duration", "20", "--policies", "goodserve",
        "--slo-scales", "2", "--predictor", str(tmp_path / "model"), "--out", str(out),
        "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "requests.parquet").to_pylist()
    assert table and all(row["predicted_output_tokens"] for row in table)
    # predictions follow the text: "long report" prompts are predicted far longer
    long_ = [r["predicted_output_tokens"] for r in table if r["num_output_tokens"] > 500]
    short = [r["predicted_output_tokens"] for r in table if r["num_output_tokens"] < 50]
    assert long_ and short
    assert sum(long_) / len(long_) > 2 * sum(short) / len(short)


def test_replay_reports_a_bad_predictor_dir_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, [
        "replay", "--backend", "sim", "--cluster", str(PAPER_CLUSTER), "--arrivals", "poisson",
        "--rate", "1", "--duration", "5", "--predictor", str(tmp_path / "missing"),
        "--out", str(tmp_path / "out"), "--no-progress",
    ])
    assert result.exit_code == 2
    assert "cannot load predictor" in result.output
