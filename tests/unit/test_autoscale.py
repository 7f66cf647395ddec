"""The autoscaling experiment: load shapes, the controller config, the command line."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from app.cli import cli
from app.control.config import ControllerConfig
from app.experiments.autoscale import (
    DEFAULT_CONFIG,
    STRATEGIES,
    AutoscaleConfig,
    load_autoscale_config,
)
from app.planning.inventory import DECODE, PREFILL, UNIFIED
from app.workloads.sessions import (
    iter_session_rows,
    preset_sessions,
    shaped_file_workload,
    shaped_preset_workload,
)
from app.workloads.workload import (
    Content,
    ContentMode,
    LoadShape,
    RateProfile,
    TraceRow,
    WorkloadRequest,
    shaped_trace_workload,
)

pytestmark = pytest.mark.unit

AGENTS_CONFIG = DEFAULT_CONFIG.parent / "autoscale-agents-sim.yaml"


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


def test_each_shape_s_rate_and_expected_arrivals():
    low, peak, duration = 10.0, 40.0, 300.0
    t = np.array([0.0, 75.0, 150.0, 225.0, 300.0])
    phases = RateProfile(LoadShape.PHASES, low, peak, duration)
    assert phases.rate_at(t).tolist() == [10, 10, 40, 10, 10]
    assert phases.expected_total == pytest.approx(100 * (10 + 40 + 10), rel=1e-3)
    ramp = RateProfile(LoadShape.RAMP, low, peak, duration)
    assert ramp.rate_at(t).tolist() == [10, 17.5, 25, 32.5, 40]
    assert ramp.expected_arrivals(t).tolist() == pytest.approx(10 * t + 30 * t**2 / 600)
    diurnal = RateProfile(LoadShape.DIURNAL, low, peak, duration)
    assert diurnal.rate_at(t).tolist() == pytest.approx([10, 25, 40, 25, 10])
    exact = low * t + (peak - low) / 2 * (t - duration / (2 * np.pi)
                                          * np.sin(2 * np.pi * t / duration))
    assert diurnal.expected_arrivals(t).tolist() == pytest.approx(exact, rel=1e-4, abs=1e-3)
    assert diurnal.mean_rps == pytest.approx(25.0, rel=1e-3)
    bursty = RateProfile(LoadShape.BURSTY, low, peak, duration)
    assert bursty.rate_at(t).tolist() == [20.0] * 5  # the phases' mean, flat
    assert bursty.expected_total == pytest.approx(phases.expected_total, rel=1e-3)
    assert bursty.imposes_arrivals and not diurnal.imposes_arrivals
    with pytest.raises(ValueError, match="burstiness"):
        RateProfile(LoadShape.BURSTY, low, peak, duration, burstiness=0.0)


def test_a_diurnal_load_warps_the_trace_to_a_smooth_day():
    profile = RateProfile(LoadShape.DIURNAL, 10.0, 40.0, 300.0)
    times = np.array([r.arrival_s for r in shaped_trace_workload(trace_rows(), profile)
                      .requests])
    edges = (times < 50).sum(), (times >= 250).sum()
    middle = ((times >= 125) & (times < 175)).sum()
    assert middle > 2.5 * max(edges)
    assert len(times) == pytest.approx(profile.expected_total, rel=0.05)


def test_bursty_arrivals_keep_the_mean_rate_with_gaps_of_cv_four_seeded():
    profile = RateProfile(LoadShape.BURSTY, 10.0, 40.0, 3000.0)
    times = np.array([r.arrival_s for r in shaped_trace_workload(trace_rows(), profile,
                                                                 seed=3).requests])
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() > 3.5  # CV 4 by construction; clustered
    assert len(times) == pytest.approx(profile.expected_total, rel=0.25)
    again = shaped_trace_workload(trace_rows(), profile, seed=3)
    other = shaped_trace_workload(trace_rows(), profile, seed=4)
    assert [r.arrival_s for r in again.requests] == times.tolist()
    assert [r.arrival_s for r in other.requests] != times.tolist()
    smooth = np.diff([r.arrival_s for r in shaped_trace_workload(
        trace_rows(), RateProfile(LoadShape.PHASES, 20.0, 20.0, 3000.0)).requests])
    assert smooth.std() / smooth.mean() < 1.5  # the Poisson-like trace, for contrast


@pytest.mark.parametrize("shape", [LoadShape.PHASES, LoadShape.BURSTY])
def test_session_starts_follow_the_profile_and_their_steps_stay_closed_loop(shape):
    profile = RateProfile(shape, 0.5, 2.0, 300.0)
    workload = shaped_preset_workload("chat-agent", profile, 131_072, seed=2)
    graph = workload.graph
    assert graph is not None and len(graph.roots) < len(workload)
    starts = np.array([workload.requests[i].arrival_s for i in graph.roots])
    assert len(starts) == pytest.approx(profile.expected_total, rel=0.3)
    if shape is LoadShape.PHASES:
        thirds = [((starts >= a) & (starts < a + 100)).sum() for a in (0, 100, 200)]
        assert thirds[1] > 2 * max(thirds[0], thirds[2])
    else:
        gaps = np.diff(starts)
        assert gaps.std() / gaps.mean() > 2.5  # 500 sessions: the CV-4 process, sampled
    # a later step waits for its parent and a tool: issued at its session's start until then
    later = [i for i, parents in enumerate(graph.parents) if parents]
    assert all(workload.requests[i].arrival_s == workload.requests[graph.parents[i][0]]
               .arrival_s for i in later)
    assert shaped_preset_workload("chat-agent", profile, 131_072, seed=2) == workload


def test_a_session_log_repeats_under_the_profile_with_renamed_sessions(tmp_path):
    sessions = preset_sessions("chat-agent", [float(i) for i in range(20)], 131_072, seed=0)
    path = tmp_path / "sessions.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in iter_session_rows(sessions)))
    profile = RateProfile(LoadShape.RAMP, 1.0, 3.0, 30.0)  # 60 starts from 20 sessions
    shaped = shaped_file_workload(path, profile)
    ids = {r.session_id for r in shaped.requests}
    assert len(ids) == pytest.approx(profile.expected_total, rel=0.1)
    assert {i for i in ids if "~" not in i} == {s.session_id for s in sessions}
    assert any(i.endswith("~2") for i in ids) and shaped.graph is not None


def test_the_agents_config_gives_each_session_kind_its_own_rates_in_sessions_per_second():
    config = load_autoscale_config(AGENTS_CONFIG)
    coding, chat = (config.load_for(c) for c in (ContentMode.CODING_AGENT,
                                                  ContentMode.CHAT_AGENT))
    assert coding.peak_rps < chat.peak_rps and coding.low_rps < coding.peak_rps
    assert config.load_for(ContentMode.TRACE) == config.load
    with pytest.raises(ValueError, match="low_rps must be <= peak_rps"):
        AutoscaleConfig.model_validate({
            **yaml.safe_load(AGENTS_CONFIG.read_text()),
            "content_load": {"coding-agent": {"low_rps": 2, "peak_rps": 1, "duration_s": 9}}})


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


@pytest.mark.parametrize("args, message", [
    ([], "--content trace needs --trace"),
    (["--content", "sessions"], "needs --sessions"),
    (["--content", "sessions", "--sessions", "/none.jsonl"], "does not exist"),
])
def test_autoscale_content_errors_are_one_line(args, message):
    result = CliRunner().invoke(cli, ["autoscale", "--config", str(AGENTS_CONFIG), *args])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def _calibration_pool() -> list[Content]:
    return [Content(300 + 40 * (i % 10), 60 + 20 * (i % 7), (i,)) for i in range(200)]


def test_calibration_finds_the_rate_an_engine_sustains_within_its_deadlines():
    """The measured rate is sustained in the simulator and a third more is not (or the
    search hit its cap); the factors are the measured rate over each model's."""
    from app.experiments.calibrate import (
        MAX_FACTOR,
        Calibrator,
        Traffic,
        factors,
        sara_factors,
    )

    config = load_autoscale_config(DEFAULT_CONFIG).model_copy(update={"mode": "unified"})
    controller = config.controller.model_copy(update={"inventory": [
        config.controller.inventory[1]]})  # A800 only
    config = config.model_copy(update={"controller": controller})
    calibrator = Calibrator(config, Traffic(pool=_calibration_pool()), seed=5, duration_s=20.0)
    (row,) = calibrator.run()
    assert row.role == "unified" and row.kind.name == "A800"
    assert row.served_rps > 0 and row.sara_rps > 0 and row.measured_rps > 0
    p_slo = calibrator.settings.slo.p_slo
    assert calibrator.measure(row.role, row.kind, row.offered).sustains(p_slo)
    assert (row.offered * 2 > MAX_FACTOR * row.served_rps
            or not calibrator.measure(row.role, row.kind, 1.34 * row.offered).sustains(p_slo))
    assert factors([row]) == {"unified:A800": round(row.measured_rps / row.served_rps, 3)}
    assert sara_factors([row]) == {"unified:A800": round(row.measured_rps / row.sara_rps, 3)}


def test_calibration_skips_a_stage_whose_helpers_would_be_the_bottleneck():
    """Small decode batches (the live config's max_num_seqs 8) cannot keep up with a fast
    prefill engine: the prefill measurement would be of the decoders, so it is skipped;
    the large-batch experiment's decoders keep up."""
    from app.experiments.calibrate import Calibrator, Traffic

    traffic = Traffic(pool=_calibration_pool())
    live = load_autoscale_config(DEFAULT_CONFIG.parent / "autoscale-live.yaml")
    small = Calibrator(live, traffic, seed=5)
    h800 = live.controller.inventory[0].kind
    assert not small._helpers_suffice(PREFILL, 2 * small.sizer.rate_of(PREFILL, h800, 1))
    assert small._helpers_suffice(DECODE, 2 * small.sizer.rate_of(DECODE, h800, 1))
    large = Calibrator(load_autoscale_config(DEFAULT_CONFIG), traffic, seed=5)
    assert large._helpers_suffice(PREFILL, 2 * large.sizer.rate_of(PREFILL, h800, 1))


def test_an_engine_whose_queue_grows_does_not_keep_up_however_many_deadlines_it_meets():
    """Second-half finishes against second-half arrivals: a prefill that falls behind
    fails even when every request still meets its (long) deadline."""
    from app.experiments.calibrate import keeps_up, late_rate
    from app.sim.records import RequestRecord

    def record(arrival: float, first_token: float) -> RequestRecord:
        return RequestRecord(f"r{arrival}", arrival, arrival + 100.0, 100.0, 10, 10,
                             first_token_s=first_token, finish_s=first_token + 1.0)

    steady = [record(t / 10, t / 10 + 0.1) for t in range(200)]
    behind = [record(t / 10, 2 * t / 10) for t in range(200)]  # served at half the rate
    assert keeps_up(steady, PREFILL, 20.0)
    assert not keeps_up(behind, PREFILL, 20.0)
    assert keeps_up(steady, DECODE, 20.0)
    assert late_rate(steady, 20.0) == pytest.approx(10.0)  # 100 arrivals in [10, 20)


def test_only_the_steady_half_of_a_window_counts_towards_attainment():
    """Misses in the warm-up half and in the sessions' tails after the window do not
    count: the second half's requests alone decide."""
    from app.experiments.calibrate import steady_attainment
    from app.sim.records import RequestRecord

    def record(arrival: float, met: bool) -> RequestRecord:
        done = RequestRecord(f"r{arrival}", arrival, arrival + 1.0, 1.0, 10, 10,
                             first_token_s=arrival + 0.1,
                             finish_s=arrival + (0.5 if met else 2.0))
        done.outcome = done.decide()
        return done

    warm_up = [record(t, met=False) for t in range(10)]
    steady = [record(10 + t, met=t % 4 != 0) for t in range(10)]  # 7 of 10 met
    tail = [record(20 + t, met=False) for t in range(5)]
    assert steady_attainment(warm_up + steady + tail, 20.0) == pytest.approx(0.7)
    assert steady_attainment(warm_up, 40.0) == 1.0  # nothing arrived in [20, 40)


def session_steps(*sessions: tuple[str, int]) -> tuple[WorkloadRequest, ...]:
    """Requests of sessions (id, steps), each step 100 prompt and 10 output tokens, all
    arriving with their sessions at 0 s."""
    from app.workloads.workload import WorkloadRequest

    return tuple(WorkloadRequest(f"{sid}/{i}", 0.0, 100, 10, session_id=sid, step_index=i)
                 for sid, num_steps in sessions for i in range(num_steps))


def test_a_session_span_is_its_longest_chain_of_tool_waits_and_solo_times():
    from app.experiments.calibrate import mean_session_span_s
    from app.workloads.session_graph import SessionGraph
    from app.workloads.workload import Workload

    # a: 0 -> (1, 2) fan-out -> 3 joins them; b: one step
    requests = session_steps(("a", 4), ("b", 1))
    graph = SessionGraph(parents=((), (0,), (0,), (1, 2), ()),
                         tool_wait_s=(0.0, 2.0, 5.0, 1.0, 0.0))
    solo = [1.0, 1.0, 3.0, 1.0, 4.0]
    # a: 0 ends at 1; 1 at 1+2+1 = 4; 2 at 1+5+3 = 9; 3 at max(4, 9)+1+1 = 11
    span = mean_session_span_s(Workload(requests, 10.0, graph=graph), solo)
    assert span == pytest.approx((11.0 + 4.0) / 2)
    # step 2 arrives at 12 s, after its tool wait: it ends at 15, the join at 17
    arriving = replace(graph, earliest_s=(0.0, 0.0, 12.0, 0.0, 0.0))
    span = mean_session_span_s(Workload(requests, 10.0, graph=arriving), solo)
    assert span == pytest.approx((17.0 + 4.0) / 2)


def test_context_is_held_until_a_step_is_issued_by_its_tool_wait_or_its_arrival():
    from app.experiments.autoscale import held_token_seconds
    from app.workloads.session_graph import SessionGraph
    from app.workloads.workload import Workload

    requests = session_steps(("a", 2), ("b", 2))
    graph = SessionGraph(parents=((), (0,), (), (2,)), tool_wait_s=(0.0, 2.0, 0.0, 3.0))
    # each step waits with its parent's 110 tokens held: 2 s and 3 s over four steps
    assert held_token_seconds(Workload(requests, 10.0, graph=graph)) == pytest.approx(
        110 * (2.0 + 3.0) / 4)
    # a's second step arrives at 5 s: the context waits 5 s, not its 2 s tool wait
    arriving = replace(graph, earliest_s=(0.0, 5.0, 0.0, 0.0))
    assert held_token_seconds(Workload(requests, 10.0, graph=arriving)) == pytest.approx(
        110 * (5.0 + 3.0) / 4)


def test_static_pools_on_the_served_models_spread_parked_context_over_their_engines():
    """Chat sessions park megatokens of context in tool waits: laid on one unified engine
    they would leave it no slot, so the static sizing spreads them over as many engines
    as it buys, and the pool it buys carries the rate with them spread so."""
    from app.control.controller import CapacityModel
    from app.experiments.autoscale import build_workload, load_profile, observed, sized_pools
    from app.workloads.workload import LoadShape

    config = load_autoscale_config(AGENTS_CONFIG).model_copy(update={"mode": "unified"})
    config = config.model_copy(update={"controller": config.controller.model_copy(
        update={"capacity_model": CapacityModel.SERVED, "capacity_factors": {}})})
    profile = load_profile(config, LoadShape.PHASES, ContentMode.CHAT_AGENT, 60.0)
    workload = build_workload(config, profile, None, None, 1, ContentMode.CHAT_AGENT, None)
    assert observed(workload).held_kv_tokens > 0
    settings = config.controller.settings(config.model, config.roles)
    rate = observed(workload).rate_rps
    targets = sized_pools(settings, workload, rate)
    assert targets.total(UNIFIED) >= 1 and targets.meets_slo
    engines = targets.total(UNIFIED)
    spread = settings.sizer(observed(workload), engines)
    assert spread.carried(UNIFIED, targets.engines[UNIFIED]) >= rate * (1 + settings.headroom)
