"""`goodserve replay --backend sim` end to end on small workloads."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.engines.config import load_cluster_config
from app.experiments.replay import Arrivals, ReplaySpec, build_workload, parse_policies, run_replay

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1].parent
PAPER_CLUSTER = REPO / "configs" / "paper-4gpu.yaml"


def small_trace(path: Path, n: int = 60) -> Path:
    rows = [
        {"timestamp": 500 * i, "input_length": 1000 + 37 * (i % 11),
         "output_length": 50 + 13 * (i % 7), "hash_ids": [0, i % 5, 100 + i]}
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def invoke(*args: str):
    return CliRunner().invoke(cli, ["replay", *args])


def test_replay_writes_summary_records_plots_and_report(tmp_path) -> None:
    out = tmp_path / "out"
    result = invoke(
        "--backend", "sim", "--trace", str(small_trace(tmp_path / "t.jsonl")),
        "--cluster", str(PAPER_CLUSTER), "--policies", "all", "--slo-scales", "1,2,3",
        "--rate", "4", "--seed", "1", "--out", str(out), "--no-progress",
    )
    assert result.exit_code == 0, result.output
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 14 * 3  # `all`: every policy of the issue, not the ablations
    for column in ("policy", "slo_scale", "requests", "met", "goodput_rps",
                   "slo_violation_ratio", "p50_e2e_s", "p99_e2e_s", "migrations", "rejected"):
        assert column in rows[0]
    assert {r["policy"] for r in rows} == {
        "goodserve", "goodserve-exact-lengths", "random", "p2c", "round-robin", "least-request",
        "prefix-cache",
        "lowest-tpm", "preble", "llumnix", "slo-pack", "llm-d", "session-affinity", "dynamo-kv"}
    for policy in ("random", "p2c", "round-robin", "least-request", "preble"):
        met = [int(r["met"]) for r in rows if r["policy"] == policy]
        assert met == sorted(met)  # looser SLOs never lose requests
        assert all(int(r["requests"]) == 60 for r in rows if r["policy"] == policy)
    table = pq.read_table(out / "requests.parquet")
    assert table.num_rows == 42 * 60
    assert {"policy", "slo_scale", "outcome", "deadline_s", "instance_ids"} <= set(
        table.column_names)
    assert (out / "goodput.png").stat().st_size > 1000
    assert (out / "slo_violation.png").stat().st_size > 1000
    assert "| least-request | 3 |" in (out / "report.md").read_text()
    with (out / "placement.csv").open() as f:
        placement = list(csv.DictReader(f))
    for row in rows:  # every request of every cell is placed somewhere exactly once
        cell = [p for p in placement
                if p["policy"] == row["policy"] and p["slo_scale"] == row["slo_scale"]]
        assert sum(int(p["placed"]) for p in cell) == int(row["requests"])
        assert sum(int(p["met"]) for p in cell) == int(row["met"])


def test_rescoring_equals_simulating_each_scale(tmp_path) -> None:
    """Deadline-unaware policies are simulated once; prove that is exact."""
    spec = ReplaySpec(load_cluster_config(PAPER_CLUSTER), parse_policies("p2c"), (1.0, 2.0))
    workload = build_workload(arrivals=Arrivals.TRACE, trace=small_trace(tmp_path / "t.jsonl"),
                              prompts=None, rate=4.0, duration_s=None, max_requests=None,
                              seed=0)
    shortcut = run_replay(spec, workload)
    honest = run_replay(dataclasses.replace(spec, rescore=False), workload)
    assert [c.summary["wall_s"] > 0 for c in shortcut] == [True, False]
    for cell, full in zip(shortcut, honest, strict=True):
        assert [r.outcome for r in cell.records] == [r.outcome for r in full.records]
        assert [r.deadline_s for r in cell.records] == pytest.approx(
            [r.deadline_s for r in full.records])
        assert cell.summary["met"] == full.summary["met"]


def test_poisson_arrivals_with_trace_content(tmp_path) -> None:
    out = tmp_path / "out"
    result = invoke(
        "--trace", str(small_trace(tmp_path / "t.jsonl")), "--arrivals", "poisson",
        "--rate", "2", "--duration", "20", "--cluster", str(PAPER_CLUSTER),
        "--policies", "least-request", "--slo-scales", "2", "--out", str(out), "--no-progress",
    )
    assert result.exit_code == 0, result.output
    (row,) = list(csv.DictReader((out / "summary.csv").open()))
    assert 20 <= int(row["requests"]) <= 65 and float(row["duration_s"]) == 20.0


def test_routing_knobs_reach_the_policy_and_the_report(tmp_path) -> None:
    """The knobs reach the report, and admission control reaches the policy: at an SLO
    scale no instance can meet, every request is rejected; at scale 3 most are served
    (admission turns away only what no instance meets, whatever the headroom)."""
    rejected = {}
    for reserve, scale in (("0", "3"), ("1000", "3"), ("0", "0.001")):
        out = tmp_path / f"{reserve}-{scale}"
        result = invoke(
            "--trace", str(small_trace(tmp_path / "t.jsonl")), "--cluster", str(PAPER_CLUSTER),
            "--policies", "goodserve-admission", "--slo-scales", scale, "--out", str(out),
            "--headroom", reserve, "--migration-margin", "0.25",
            "--migration-cost-quantile", "0.75", "--reservation-quantile", "0.8",
            "--stall-factor", "0.5", "--confidence-quantile", "0.75", "--no-progress",
        )
        assert result.exit_code == 0, result.output
        (row,) = list(csv.DictReader((out / "summary.csv").open()))
        rejected[(reserve, scale)] = int(row["rejected"])
        report = (out / "report.md").read_text()
        assert f"- headroom: {float(reserve):g}" in report and "- migration_margin: 0.25" in report
        assert "- migration_cost_quantile: 0.75" in report
        assert "- reservation_quantile: 0.8" in report and "- stall_factor: 0.5" in report
        assert "- confidence_quantile: 0.75" in report
    assert rejected[("0", "0.001")] == 60
    assert rejected[("0", "3")] < 30 and rejected[("1000", "3")] < 30


def test_deadline_priorities_are_simulated_at_every_scale(tmp_path) -> None:
    """Engines in priority mode with deadline priorities: even a deadline-unaware
    policy's run depends on the deadlines, so no scale is re-scored from another."""
    out = tmp_path / "out"
    result = invoke(
        "--trace", str(small_trace(tmp_path / "t.jsonl")), "--cluster", str(PAPER_CLUSTER),
        "--policies", "round-robin,goodserve", "--slo-scales", "1,3", "--out", str(out),
        "--scheduling-policy", "priority", "--request-priority", "deadline", "--no-progress",
    )
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert len(rows) == 4 and all(float(row["wall_s"]) > 0 for row in rows)
    report = (out / "report.md").read_text()
    assert "- scheduling_policy: priority" in report and "- request_priority: deadline" in report


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "live", "--policies", "oracle"], "sim backend only"),
        (["--cluster", "missing.yaml"], "config file not found"),
        (["--policies", "nope"], "unknown policy"),
        (["--slo-scales", "1,x"], "bad SLO scale"),
        (["--rate", "0"], "rate must be > 0"),
        (["--arrivals", "poisson"], "needs --rate and --duration"),
        (["--arrivals", "gamma", "--rate", "2", "--duration", "5", "--burstiness", "0"],
         "burstiness"),
        (["--arrivals", "batch", "--rate", "2", "--duration", "5", "--burst-size", "0.5"],
         "mean burst size"),
        (["--request-priority", "deadline"], "no engine has scheduling_policy priority"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message) -> None:
    base = {"--trace": str(small_trace(tmp_path / "t.jsonl")), "--cluster": str(PAPER_CLUSTER),
            "--out": str(tmp_path / "out")}
    for key, value in zip(args[::2], args[1::2], strict=True):
        base[key] = value
    result = invoke(*[x for kv in base.items() for x in kv], "--no-progress")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize(("process", "name"), [
    (["--arrivals", "gamma", "--burstiness", "4"], "gamma-cv4"),
    (["--arrivals", "batch", "--burst-size", "5", "--burst-distribution", "fixed"],
     "batch-fixed5"),
])
def test_bursty_arrivals_from_the_command_line(tmp_path, process, name) -> None:
    out = tmp_path / "out"
    result = invoke(
        "--trace", str(small_trace(tmp_path / "t.jsonl")), *process, "--rate", "3",
        "--duration", "20", "--cluster", str(PAPER_CLUSTER), "--policies", "round-robin",
        "--slo-scales", "2", "--out", str(out), "--no-progress",
    )
    assert result.exit_code == 0, result.output
    assert f"- arrivals: {name}" in (out / "report.md").read_text()
    requests = pq.read_table(out / "requests.parquet").column("arrival_s").to_pylist()
    if name.startswith("batch"):  # bursts of exactly five simultaneous arrivals
        assert len(requests) % 5 == 0 and len(set(requests)) == len(requests) // 5


def test_malformed_trace_line_is_reported(tmp_path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    trace.write_text(trace.read_text() + '\n{"timestamp": 1}\n')
    result = invoke("--trace", str(trace), "--cluster", str(PAPER_CLUSTER),
                    "--out", str(tmp_path / "o"), "--no-progress")
    assert result.exit_code == 2
    assert f"{trace}:61: field 'input_length': Field required" in result.output


def test_renamed_cells_carry_their_label_into_every_output(tmp_path) -> None:
    from app.experiments.replay import write_outputs

    workload = build_workload(
        arrivals=Arrivals.TRACE, trace=small_trace(tmp_path / "t.jsonl", 20), prompts=None,
        rate=4.0, duration_s=None, max_requests=None, seed=0,
    )
    spec = ReplaySpec(load_cluster_config(PAPER_CLUSTER), parse_policies("goodserve"), (2.0,))
    cells = [cell.renamed("goodserve tau=10") for cell in run_replay(spec, workload)]
    write_outputs(tmp_path / "out", {"note": "renamed"}, cells)
    (row,) = list(csv.DictReader((tmp_path / "out" / "summary.csv").open()))
    assert row["policy"] == "goodserve tau=10"
    assert "| goodserve tau=10 | 2 |" in (tmp_path / "out" / "report.md").read_text()
    policies = pq.read_table(tmp_path / "out" / "requests.parquet").column("policy")
    assert set(policies.to_pylist()) == {"goodserve tau=10"}
