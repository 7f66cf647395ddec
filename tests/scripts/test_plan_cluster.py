"""`goodserve plan cluster` end to end (plan, promise, simulated check) and the P/D
agentic benchmark's report."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.engines.config import load_cluster_config
from app.experiments.plan_check import Simulation, plan_for
from benchmarks.agentic import TRACE, MatrixSetup, make_workload
from benchmarks.goodput_experiments import REPO
from benchmarks.pd_agentic import report, run_unit

pytestmark = pytest.mark.scripts

RUNNER = CliRunner()
PAPER = str(REPO / "configs" / "paper-4gpu.yaml")


def test_plan_cluster_scores_and_simulates_every_layout_of_the_paper_cluster():
    result = RUNNER.invoke(cli, ["plan", "cluster", "--cluster", PAPER, "--rate", "0.2",
                                 "--duration", "30", "--slo-scale", "2", "--content",
                                 "chat-agent", "--verify", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    layouts = payload["layouts"]
    assert len(layouts) == 15 and len({c["layout"] for c in layouts}) == 15
    assert [c["recommended"] for c in layouts] == [True] + [False] * 14
    modelled = [c["model_goodput_rps"] for c in layouts]
    assert modelled == sorted(modelled, reverse=True)
    for c in layouts:
        assert 0 <= c["promised_attainment"] <= 1
        assert c["met"] <= c["requests"] and c["requests"] > 0
        assert c["simulated_goodput_rps"] == pytest.approx(c["met"] / 30.0, abs=1e-3)
    assert {c["mode"] for c in layouts} == {"unified", "disaggregated"}


def test_plan_cluster_without_verify_prints_a_table_of_modelled_layouts():
    result = RUNNER.invoke(cli, ["plan", "cluster", "--cluster", PAPER, "--rate", "0.2",
                                 "--duration", "30"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].startswith("*") and sum(line.startswith("*") for line in lines) == 2
    assert "unified" in result.stdout and "promised and simulated attainment" in lines[-1]


@pytest.mark.parametrize("args, message", [
    (["--cluster", "missing.yaml", "--rate", "1"], "missing.yaml"),
    (["--cluster", str(REPO / "configs" / "local-sim-pd.yaml"), "--rate", "1"],
     "must describe a unified cluster"),
    (["--cluster", PAPER, "--rate", "1", "--content", "trace"], "--trace"),
])
def test_plan_cluster_rejects_bad_input_with_one_line(args, message):
    result = RUNNER.invoke(cli, ["plan", "cluster", *args])
    assert result.exit_code == 2
    assert message in result.output and result.output.startswith("error:")
    assert len(result.output.strip().splitlines()) == 1


def _cells(load: float, goodputs: dict[str, float], pick: str, promised: float) -> list[dict]:
    return [{"workload": "chat-agent", "cluster": "small", "load_factor": load,
             "window_s": 500.0, "layout": name,
             "mode": "unified" if name == "unified" else "disaggregated",
             "recommended": str(name == pick), "simulated_goodput_rps": g,
             "promised_attainment": promised, "simulated_attainment": 0.9}
            for name, g in goodputs.items()]


def test_the_report_compares_pd_with_unified_and_scores_saras_pick():
    cells = (_cells(1.0, {"unified": 1.0, "H800": 1.2, "A800": 0.5}, "unified", 0.92)
             + _cells(1.5, {"unified": 1.0, "H800": 0.8, "A800": 0.97}, "A800", 0.5))
    text = report(cells, ["mooncake on small: skipped (why)"], {"seed": 0})
    assert "| chat-agent | small | 500 s | 1x | 1.000 | 1.200 (H800) | 1.20 | unified | 0.83 |" \
        in text
    assert "| 1.5x | 1.000 | 0.970 (A800) | 0.97 | A800 | 0.97 | 50.0% | 90.0% |" in text
    assert "within 5% of the best layout simulated in 1 of 2 units" in text
    assert "within 3% points of the simulated in 1 of 2" in text
    assert "- mooncake on small: skipped (why)" in text


def test_rescoring_keeps_each_layouts_simulation_and_simulates_only_a_missing_pick():
    """`benchmarks.pd_agentic --rescore`: the model's columns are scored again, every
    simulated layout keeps its measured counts, and a pick with none is simulated."""
    setup = MatrixSetup({"chat-agent": 30.0}, TRACE, ())
    config = load_cluster_config(PAPER)
    plan = plan_for(config, make_workload("chat-agent", config, 0.2, 0, setup), 2.0)
    pick = plan.recommended.layout.label
    measured = {e.layout.label: Simulation(1000, index, index / 30)
                for index, e in enumerate(plan.estimates) if e.layout.label != pick}
    rows = run_unit("chat-agent", "small", 1.0, 0.2, 0, 2.0, setup, measured)
    assert {r["layout"] for r in rows} == set(measured) | {pick}
    for r in rows:
        if r["layout"] == pick:
            assert r["recommended"] and 0 < r["requests"] < 1000 and r["met"] <= r["requests"]
        else:
            assert r["met"] == measured[r["layout"]].met and r["requests"] == 1000
            assert r["model_goodput_rps"] == plan.estimate(r["layout"]).goodput_rps
