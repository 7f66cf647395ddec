"""`goodserve plan` CLI: JSON output, validation report, one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.planning.cli import app

pytestmark = pytest.mark.unit

RUNNER = CliRunner()
PLAN_ARGS = [
    "--model",
    "llama-3.1-8b",
    "--gpu-prefill",
    "H800",
    "--gpu-decode",
    "A800",
    "--rate",
    "20",
    "--slo-ttft",
    "1.5",
    "--slo-kv",
    "0.2",
    "--slo-tpot",
    "0.02",
    "--p-slo",
    "0.9",
]


def test_plan_json_has_sizing_and_goodput() -> None:
    result = RUNNER.invoke(app, [*PLAN_ARGS, "--budget", "30", "--heavy", "2", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["input_len"] == {"mean": 1024.0, "cv": 2.0, "kind": "lognormal"}
    sizing = payload["sizing"]
    assert {
        "num_prefill",
        "num_decode",
        "max_batch_size",
        "kv_bandwidth_gbps",
        "cost_per_hour",
        "slo_tax_per_hour",
        "stage_constraints",
    } <= set(sizing)
    goodput = payload["goodput"]
    assert goodput["feasible"] and goodput["goodput_rps"] > 20
    assert goodput["cost_per_hour"] <= 30
    assert {
        "binding_constraint",
        "num_prefill",
        "kv_bandwidth_gbps",
        "num_decode",
        "max_batch_size",
        "slo_tax_per_hour",
    } <= set(goodput)


def test_plan_light_and_auto_gpus() -> None:
    result = RUNNER.invoke(
        app, ["--light", "--gpu-prefill", "auto", "--gpu-decode", "H800,A800", "--json"]
    )
    assert result.exit_code == 0, result.output
    sizing = json.loads(result.stdout)["sizing"]
    assert sizing["decode_gpu"] in {"H800", "A800"}
    assert "goodput" not in json.loads(result.stdout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "-3"], "arrival rate"),
        (["--gpu-prefill", "X100"], "unknown GPU"),
        (["--light", "--heavy", "2"], "mutually exclusive"),
        (["--p-slo", "1.5"], "p_slo"),
        (["--model", "nope"], "unknown model"),
    ],
)
def test_bad_parameters_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = RUNNER.invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_validate_json_reports_every_stage_and_case() -> None:
    result = RUNNER.invoke(
        app, ["validate", "--json", "--num-requests", "20000", "--decode-iterations", "4000"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["p_slo_range"] == [0.5, 0.98]
    for stage in ("prefill", "kv", "decode"):
        for case in ("light", "heavy_cv1.5", "heavy_cv2"):
            summary = payload["stages"][stage][case]
            for key in ("mean_rel_err", "max_rel_err", "paper_mean_rel_err"):
                assert 0.0 <= summary[key] < 10.0
