"""`goodserve overhead`: the router-thread replay, micro-batches and the command's JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from benchmarks.overhead import RouterThread, WorkLog, micro_batches, mixed_cluster

pytestmark = pytest.mark.unit


def test_work_waits_for_the_router_thread():
    """Two decisions 1 ms apart each taking 3 ms: the second waits 2 ms; a status update
    due in between delays it by its own cost too."""
    log = WorkLog()
    log.add(0.000, 0.003, "choose", arrival=0.000)
    log.add(0.001, 0.003, "choose", arrival=0.001)
    log.add(0.0005, 0.001, "status")
    thread = RouterThread.replay(log)
    assert thread.latency_s.tolist() == pytest.approx([0.003, 0.006])  # 0 -> 3, 1 -> 7 ms
    assert thread.busy_s == pytest.approx(0.007)
    assert thread.span_s == pytest.approx(0.007)
    late = RouterThread.replay(log, measured_from_s=0.0008)  # the first is warm-up
    assert late.latency_s.tolist() == pytest.approx([0.006])
    with pytest.raises(ValueError, match="no routing decision"):
        RouterThread.replay(log, measured_from_s=1.0)


def test_micro_batches_flush_when_full_or_after_the_wait():
    arrivals = [0.0, 0.001, 0.0015, 0.010, 0.0101, 0.0102, 0.0103]
    batches = micro_batches(arrivals, max_batch_size=3, max_wait_s=0.002)
    assert [(a, b) for a, b, _ in batches] == [(0, 3), (3, 6), (6, 7)]
    assert [t for _, _, t in batches] == pytest.approx([0.0015, 0.0102, 0.0123])


def test_mixed_cluster_takes_the_gpu_kinds_in_turn():
    config = mixed_cluster(6)
    assert [(g.engine.gpu_type, g.count) for g in config.groups] == [
        ("H800", 2), ("A800", 2), ("A40", 1), ("V100", 1)]
    with pytest.raises(ValueError, match="instances"):
        mixed_cluster(0)


def test_the_overhead_command_prints_its_figures():
    result = CliRunner().invoke(cli, ["overhead", "--instances", "8", "--rps", "200",
                                      "--duration", "0.5", "--warmup", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    for key in ("p50_ms", "p99_ms", "max_ms", "decisions_per_s", "cpu_ms_per_decision"):
        assert figures[key] > 0
    assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert figures["decisions"] > 50 and figures["breakdown_ms_per_decision"]["choose"] > 0
    bad = CliRunner().invoke(cli, ["overhead", "--rps", "0"])
    assert bad.exit_code != 0 and "rps" in bad.output


def test_predictions_ride_in_micro_batches_and_routing_waits_for_them():
    """Each request is predicted in the batch the micro-batcher would put it in; its
    decision is due at that batch's flush, and the batch's time is on the log."""
    from app.workload import Content, poisson_workload
    from benchmarks.overhead import predict_in_batches
    from predictor.base import PredictionInput
    from predictor.history import HistoryPredictor

    predictor = HistoryPredictor().fit([PredictionInput(prompt="x")] * 4, [10, 20, 30, 40])
    workload = poisson_workload(5000.0, 0.05, [Content(100, 20, (1,))], seed=3)
    log = WorkLog()
    predicted, ready = predict_in_batches(workload, predictor, log)
    batches = micro_batches([r.arrival_s for r in workload.requests])
    assert log.what == ["predict"] * len(batches) and len(batches) < len(workload)
    assert all(r.predicted_output_tokens and r.predicted_output_tokens >= 1
               for r in predicted.requests)
    for first, end, flush in batches:
        for request in workload.requests[first:end]:
            assert ready[request.request_id] == flush >= request.arrival_s
