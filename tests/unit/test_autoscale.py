"""The autoscaling experiment: load shapes, the controller config, the command line."""

from __future__ import annotations

import csv
import json
import random

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from app.cli import cli
from app.control.config import ControllerConfig
from app.experiments.autoscale import DEFAULT_CONFIG, STRATEGIES, load_autoscale_config
from app.planning.inventory import DECODE, PREFILL
from app.workload import Content, LoadShape, RateProfile, TraceRow, shaped_trace_workload

pytestmark = pytest.mark.unit


def trace_rows(n: int = 2000, rate: float = 5.0) -> list[TraceRow]:
    rng = random.Random(0)
    t, rows = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        rows.append(TraceRow(t, Content(200, 50, (1,))))
    return rows


def test_the_shaped_load_follows_the_profile_and_repeats_the_trace():
    profile = RateProfile(LoadShape.PHASES, 10.0, 40.0, 300.0)
    workload = shaped_trace_workload(trace_rows(), profile)
    times = np.array([r.arrival_s for r in workload.requests])
    thirds = [((times >= a) & (times < a + 100)).sum() / 100 for a in (0, 100, 200)]
    assert thirds[0] == pytest.approx(10, rel=0.25) and thirds[2] == pytest.approx(10, rel=0.25)
    assert thirds[1] == pytest.approx(40, rel=0.15)
    assert len(workload) > 2000  # 6,000 expected arrivals from a 2,000-row trace
    ramp = shaped_trace_workload(trace_rows(), RateProfile(LoadShape.RAMP, 10.0, 40.0, 300.0))
    ramp_times = np.array([r.arrival_s for r in ramp.requests])
    assert (ramp_times < 100).sum() < (ramp_times >= 200).sum()
    assert profile.mean_rps == pytest.approx(20.0, rel=0.01)
    with pytest.raises(ValueError, match="low <= peak"):
        RateProfile(LoadShape.RAMP, 50.0, 10.0, 100.0)


def test_the_default_experiment_config_loads_and_its_peak_needs_more_than_its_mean():
    config = load_autoscale_config(DEFAULT_CONFIG)
    assert config.roles == (PREFILL, DECODE)
    assert config.load.peak_rps > 2 * config.load.low_rps
    settings = config.controller.settings(config.model, config.roles)
    assert settings.limits.budget_per_hour is not None and len(settings.stock) >= 3


def test_controller_config_errors_name_the_field():
    base = {"inventory": [{"gpu_type": "A800", "count": 2}]}
    assert ControllerConfig.model_validate(base).inventory[0].stock.price_per_hour == 2.0
    for bad, match in (({"inventory": [{"gpu_type": "B300", "count": 1}]}, "unknown GPU"),
                       ({**base, "min_engines": {"both": 1}}, "unknown roles"),
                       ({"inventory": [{"gpu_type": "A800", "count": 1}] * 2}, "twice"),
                       ({"inventory": []}, "empty")):
        with pytest.raises(ValueError, match=match):
            ControllerConfig.model_validate(bad)


def small_experiment(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({
        "timestamp": int(r.arrival_s * 1000), "input_length": 200, "output_length": 300,
        "hash_ids": [i]}) for i, r in enumerate(trace_rows(600))))
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["load"] = {"low_rps": 5.0, "peak_rps": 80.0, "duration_s": 150.0}
    config["controller"].update(interval_s=10, startup_s=10, cooldown_s=20,
                                scale_down_after_s=10)
    path = tmp_path / "autoscale.yaml"
    path.write_text(yaml.safe_dump(config))
    return trace, path


def test_autoscale_prints_one_json_object_keyed_by_strategy(tmp_path):
    trace, config = small_experiment(tmp_path)
    result = CliRunner().invoke(cli, ["autoscale", "--trace", str(trace), "--config", str(config),
                                      "--strategies", "static-peak,saturation,sara", "--json",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert list(summary) == ["static-peak", "saturation", "sara"]
    for figures in summary.values():
        assert set(figures) >= {"goodput_rps", "slo_attainment", "gpu_hours", "cost_usd",
                                "met_per_dollar", "lost", "migrations"}
        assert figures["lost"] == 0 and figures["cost_usd"] > 0
    assert summary["sara"]["engines_started"] > 0 == summary["static-peak"]["engines_started"]
    for name in ("summary.json", "timeline.csv", "goodput.csv", "autoscale.png"):
        assert (tmp_path / "out" / name).exists()
    with (tmp_path / "out" / "timeline.csv").open() as f:
        held: dict[float, int] = {}
        for row in csv.DictReader(f):
            if row["strategy"] == "sara":
                t = float(row["time_s"])
                held[t] = held.get(t, 0) + int(row["serving"]) + int(row["starting"])
    sizes = [held[t] for t in sorted(held)]
    assert sizes[0] < max(sizes) and sizes[-1] < max(sizes)  # grew for the peak, shrank after


@pytest.mark.parametrize("args, message", [
    (["--strategies", "karpenter"], "unknown strategy"),
    (["--backend", "live", "--strategies", "sara,queue-length"], "sara strategy only"),
    (["--config", "/nonexistent.yaml"], "does not exist"),
])
def test_autoscale_input_errors_are_one_line(tmp_path, args, message):
    trace, config = small_experiment(tmp_path)
    result = CliRunner().invoke(cli, ["autoscale", "--trace", str(trace), "--config", str(config),
                                      *args])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output
    assert set(STRATEGIES) >= {"sara", "static-peak"}


def test_calibration_finds_the_rate_an_engine_sustains_within_its_deadlines():
    """The measured rate meets p_slo in the simulator and a third more does not (or the
    search hit its cap); the factor is their ratio."""
    from app.experiments.calibrate import MAX_FACTOR, Calibrator, factors

    config = load_autoscale_config(DEFAULT_CONFIG).model_copy(update={"mode": "unified"})
    controller = config.controller.model_copy(update={"inventory": [
        config.controller.inventory[1]]})  # A800 only
    config = config.model_copy(update={"controller": controller})
    pool = [Content(300 + 40 * (i % 10), 60 + 20 * (i % 7), (i,)) for i in range(200)]
    calibrator = Calibrator(config, pool, seed=5, duration_s=20.0)
    (row,) = calibrator.run()
    assert row.role == "unified" and row.kind.name == "A800" and row.modelled_rps > 0
    p_slo = calibrator.settings.slo.p_slo
    assert calibrator.attainment(row.role, row.kind, row.measured_rps) >= p_slo
    assert (row.measured_rps * 2 > MAX_FACTOR * row.modelled_rps
            or calibrator.attainment(row.role, row.kind, 1.34 * row.measured_rps) < p_slo)
    assert factors([row]) == {"unified:A800": round(row.measured_rps / row.modelled_rps, 3)}


def test_calibration_skips_a_stage_whose_helpers_would_be_the_bottleneck():
    """Small decode batches (the live config's max_num_seqs 8) cannot keep up with a fast
    prefill engine: the prefill measurement would be of the decoders, so it is skipped;
    the large-batch experiment's decoders keep up."""
    from app.experiments.calibrate import Calibrator

    pool = [Content(300 + 40 * (i % 10), 60 + 20 * (i % 7), (i,)) for i in range(200)]
    live = load_autoscale_config(DEFAULT_CONFIG.parent / "autoscale-live.yaml")
    small = Calibrator(live, pool, seed=5)
    h800 = live.controller.inventory[0].kind
    assert not small._helpers_suffice(PREFILL, 2 * small.sizer.rate_of(PREFILL, h800, 1))
    assert small._helpers_suffice(DECODE, 2 * small.sizer.rate_of(DECODE, h800, 1))
    large = Calibrator(load_autoscale_config(DEFAULT_CONFIG), pool, seed=5)
    assert large._helpers_suffice(PREFILL, 2 * large.sizer.rate_of(PREFILL, h800, 1))


def test_calibration_also_models_each_stage_with_the_deadlines_whole_slack():
    """The measurement leaves the stage under test the whole slack (its helpers keep the
    other stage near its solo time); the model at those targets is set beside it, and
    gives each stage at least the controller's rate."""
    from app.experiments.calibrate import Calibrator

    pool = [Content(300 + 40 * (i % 10), 60 + 20 * (i % 7), (i,)) for i in range(200)]
    calibrator = Calibrator(load_autoscale_config(DEFAULT_CONFIG), pool, seed=5)
    kinds = [stock.kind for stock in calibrator.settings.stock]
    for role in (PREFILL, DECODE):
        proportional = [calibrator.sizer.rate_of(role, kind, 1) for kind in kinds]
        whole = [calibrator.whole_slack[role].rate_of(role, kind, 1) for kind in kinds]
        assert all(w >= p > 0 for w, p in zip(whole, proportional, strict=True))
        if role == PREFILL:
            assert all(w > p for w, p in zip(whole, proportional, strict=True))
            assert sum(whole) > 1.3 * sum(proportional)
