"""The controller's decision loop: observation windows, forecasts, plan diffs with
hysteresis, cool-down and draining (no Ray, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.control.controller import (
    Controller,
    ControllerSettings,
    ControlStep,
    StageSlo,
    committed_rps,
)
from app.control.observe import (
    LoadReport,
    LoadWindow,
    RatePredictor,
    SessionEventKind,
    SessionTracker,
)
from app.control.plan import EngineRecord, EngineState, PoolPlanner, ScalingRules
from app.control.strategies import QueueLengthScaler, SaturationScaler, ThroughputScaler
from app.hardware.specs import make_instance
from app.planning.inventory import DECODE, PREFILL, UNIFIED, PoolTargets, Stock
from app.planning.split import EngineKind

pytestmark = pytest.mark.unit

H800, A800 = EngineKind("H800", 1, 256), EngineKind("A800", 1, 256)
RULES = ScalingRules(scale_down_after_s=60.0, cooldown_s=120.0, drain_deadline_s=30.0)


def targets(prefill: int, decode: int) -> PoolTargets:
    return PoolTargets(10.0, {PREFILL: {H800: prefill}, DECODE: {A800: decode}}, 0.0, True)


def engine(engine_id: str, role: str = DECODE, kind: EngineKind = A800,
           state: EngineState = EngineState.ACTIVE, since_s: float = 0.0,
           running: int = 0, kv_usage: float = 0.0, waiting: int = 0) -> EngineRecord:
    return EngineRecord(engine_id, role, kind, state, since_s, running, waiting, kv_usage)


def test_window_stats_and_carry_over_of_length_moments():
    window = LoadWindow(0.0)
    for n in (100, 300):
        window.arrival(n)
    window.finished(50, True)
    window.finished(150, False)
    stats = window.close(10.0)
    assert stats.rate_rps == pytest.approx(0.2)
    assert stats.mean_input_len == 200 and stats.cv_input_len == pytest.approx(0.5)
    assert stats.mean_output_len == 100 and stats.slo_attainment == 0.5
    idle = window.close(20.0)
    assert idle.arrivals == 0 and idle.rate_rps == 0 and idle.slo_attainment == 1.0
    assert (idle.mean_input_len, idle.mean_output_len) == (200, 100)
    with pytest.raises(ValueError, match="after its start"):
        window.close(20.0)


def test_a_few_long_stragglers_do_not_stand_for_the_output_length():
    """1,000 completions of 100 tokens, then a draining window of 10 at 2,000: the mean
    is weighted by completions, the older window at half weight."""
    window = LoadWindow(0.0, output_memory=0.5)
    for _ in range(1000):
        window.finished(100, True)
    assert window.close(30.0).mean_output_len == 100
    for _ in range(10):
        window.finished(2000, False)
    expected = (0.5 * 1000 * 100 + 10 * 2000) / (0.5 * 1000 + 10)
    assert window.close(60.0).mean_output_len == pytest.approx(expected)  # about 137
    assert LoadWindow(0.0, output_memory=0.0)._output_memory == 0.0
    with pytest.raises(ValueError, match="output_memory"):
        LoadWindow(0.0, output_memory=1.0)


def test_forecast_follows_a_ramp_and_never_goes_negative():
    predictor = RatePredictor()
    forecasts = [predictor.update(r) for r in (10, 20, 30, 40, 50)]
    assert forecasts[-1] > 50  # the trend carries it past the last observation
    falling = RatePredictor()
    assert min(falling.update(r) for r in (100, 10, 0, 0)) >= 0.0
    with pytest.raises(ValueError, match="level_weight"):
        RatePredictor(level_weight=0.0)


def test_scale_up_is_immediate_and_starting_engines_count_as_present():
    planner = PoolPlanner(RULES)
    diff = planner.diff(0.0, targets(1, 3), [engine("d0"), engine("p0", PREFILL, H800)])
    assert sorted(diff.start) == [(DECODE, A800), (DECODE, A800)]
    booting = [engine("d0"), engine("p0", PREFILL, H800),
               engine("d1", state=EngineState.STARTING), engine("d2", state=EngineState.STARTING)]
    assert planner.diff(10.0, targets(1, 3), booting).is_empty


def test_scale_down_waits_for_hysteresis_and_cool_down_then_drains_the_emptiest():
    planner = PoolPlanner(RULES)
    pool = [engine("d0", running=5), engine("d1", running=0), engine("d2", running=2),
            engine("p0", PREFILL, H800)]
    planner.diff(0.0, targets(1, 3), pool[:1] + pool[3:])  # a scale-up at t = 0
    assert planner.diff(10.0, targets(1, 1), pool).is_empty  # below target since 10 s
    assert planner.diff(69.0, targets(1, 1), pool).is_empty  # 59 s: hysteresis holds
    assert planner.diff(100.0, targets(1, 1), pool).is_empty  # cool-down (up at 0) holds
    diff = planner.diff(120.0, targets(1, 1), pool)
    assert diff.drain == ("d1", "d2") and not diff.stop and diff.changes_membership


def test_a_short_dip_below_target_does_not_scale_down():
    planner = PoolPlanner(ScalingRules(60.0, 0.0, 30.0))
    pool = [engine("d0"), engine("d1"), engine("p0", PREFILL, H800)]
    planner.diff(0.0, targets(1, 1), pool)
    planner.diff(30.0, targets(1, 2), pool)  # back at target: the clock resets
    assert planner.diff(70.0, targets(1, 1), pool).is_empty
    assert planner.diff(130.0, targets(1, 1), pool).drain == ("d0",)


def test_draining_engines_stop_when_empty_migrate_after_the_deadline_or_come_back():
    planner = PoolPlanner(RULES)
    draining = [engine("d0"), engine("d1", state=EngineState.DRAINING, since_s=0.0, running=0),
                engine("d2", state=EngineState.DRAINING, since_s=0.0, running=4),
                engine("p0", PREFILL, H800)]
    early = planner.diff(10.0, targets(1, 1), draining)
    assert early.stop == ("d1",) and early.migrate == ()
    late = planner.diff(31.0, targets(1, 1), draining)
    assert late.migrate == ("d2",)
    back = planner.diff(40.0, targets(1, 2), draining)
    assert back.reactivate == ("d2",) and back.start == ()  # the busier one returns
    assert "d2" not in back.migrate


def test_starting_engines_leave_before_serving_ones():
    planner = PoolPlanner(ScalingRules(0.0, 0.0, 30.0))
    pool = [engine("d0"), engine("d1", state=EngineState.STARTING, since_s=5.0),
            engine("p0", PREFILL, H800)]
    diff = planner.diff(10.0, targets(1, 1), pool)
    assert diff.stop == ("d1",) and diff.drain == ()


def test_a_kind_no_longer_wanted_is_drained():
    planner = PoolPlanner(ScalingRules(0.0, 0.0, 30.0))
    pool = [engine("d0"), engine("d9", kind=H800), engine("p0", PREFILL, H800)]
    assert planner.diff(0.0, targets(1, 1), pool).drain == ("d9",)


def test_rules_reject_negative_times():
    with pytest.raises(ValueError, match="cooldown_s"):
        ScalingRules(cooldown_s=-1.0)


def settings(**overrides) -> ControllerSettings:
    base = dict(model="llama-3.1-8b", roles=(PREFILL, DECODE),
                stock=(Stock(H800, 4, 3.5), Stock(A800, 8, 2.0)),
                slo=StageSlo(make_instance("A800", "llama-3.1-8b"), 2.0), rules=RULES,
                interval_s=30.0, startup_s=30.0)
    return ControllerSettings(**{**base, **overrides})


def feed(controller: Controller, rate: float, seconds: float = 30.0) -> None:
    for _ in range(int(rate * seconds)):
        controller.window.arrival(300)
        controller.window.finished(250, True)


def test_controller_grows_the_pools_with_the_load_and_shrinks_them_after():
    controller = Controller(settings(), 0.0)
    feed(controller, 10.0)
    low = controller.step(30.0, [])
    feed(controller, 100.0)
    high = controller.step(60.0, [])
    assert high.targets.total(DECODE) > low.targets.total(DECODE)
    assert high.forecast_rps > low.forecast_rps and high.targets.meets_slo
    engines = [engine(f"d{i}", since_s=60.0) for i in range(high.targets.total(DECODE))]
    engines += [engine(f"p{i}", PREFILL, H800, since_s=60.0)
                for i in range(high.targets.total(PREFILL))]
    drained: list[str] = []
    for t in range(90, 400, 30):
        feed(controller, 10.0)
        drained += controller.step(float(t), engines).diff.drain
    assert drained and all(e.startswith("d") or e.startswith("p") for e in drained)


def test_controller_sizes_ahead_of_a_ramp_by_the_start_up_time():
    slow, fast = Controller(settings(startup_s=120.0), 0.0), Controller(settings(), 0.0)
    for t, rate in ((30.0, 20.0), (60.0, 40.0), (90.0, 60.0)):
        for controller in (slow, fast):
            feed(controller, rate)
        slow_step, fast_step = slow.step(t, []), fast.step(t, [])
    assert slow_step.targets.rate_rps > fast_step.targets.rate_rps


def test_a_damped_trend_adds_fewer_intervals_of_it_over_the_start_up():
    full = settings(startup_s=60.0)  # two intervals
    assert full.trend_intervals == 2.0
    assert settings(startup_s=60.0, trend_damping=0.5).trend_intervals == pytest.approx(0.75)
    assert settings(startup_s=60.0, trend_damping=0.0).trend_intervals == 0.0
    steps = {}
    for phi in (1.0, 0.5, 0.0):
        controller = Controller(settings(startup_s=60.0, trend_damping=phi), 0.0)
        for t, rate in ((30.0, 20.0), (60.0, 40.0), (90.0, 60.0)):
            feed(controller, rate)
            steps[phi] = controller.step(t, [])
    assert steps[1.0].targets.rate_rps > steps[0.5].targets.rate_rps > steps[0.0].targets.rate_rps
    # damped to 0: the look-ahead is the forecast itself, never below the rate seen
    assert steps[0.0].targets.rate_rps == pytest.approx(
        max(steps[0.0].forecast_rps, 60.0) * 1.1, rel=1e-6)


def test_settings_errors():
    with pytest.raises(ValueError, match="interval"):
        settings(interval_s=0.0)
    with pytest.raises(ValueError, match="trend damping"):
        settings(trend_damping=1.5)


# ---- the strategies SARA is compared with ---------------------------------------------

A40 = EngineKind("A40", 1, 256)
STOCK = (Stock(H800, 4, 3.5), Stock(A800, 8, 2.0), Stock(A40, 8, 0.8))


def counting(cls, roles=(PREFILL, DECODE), **knobs):
    return cls(30.0, ScalingRules(0.0, 0.0, 30.0), model="llama-3.1-8b", roles=roles,
               stock=STOCK, **knobs)


def closed_window(scaler, rate: float = 0.0, seconds: float = 30.0):
    for _ in range(int(rate * seconds)):
        scaler.window.arrival(300)
        scaler.window.finished(200, True)
    return scaler.window.close(seconds)


def test_counting_pools_keep_their_engines_and_grow_from_the_preferred_kind():
    scaler = counting(QueueLengthScaler)
    decode_order = [s.kind for s in scaler.preferred_kinds(DECODE)]
    assert sorted(k.name for k in decode_order) == ["A40", "A800", "H800"]
    engines = [engine("d0", kind=A40), engine("p0", PREFILL, H800)]
    grown = scaler.fill({PREFILL: 1, DECODE: 3}, engines)
    assert grown.engines[DECODE][A40] >= 1  # the engine it has stays
    assert grown.total(DECODE) == 3 and grown.count(PREFILL, H800) == 1
    kept = scaler.fill({PREFILL: 1, DECODE: 1},
                       engines + [engine("d1", kind=decode_order[0])])
    assert kept.engines[DECODE] == {decode_order[0]: 1}  # the least preferred leaves
    greedy = scaler.fill({PREFILL: 1, DECODE: 40}, engines)
    assert not greedy.meets_slo and "stock holds" in greedy.reason
    assert greedy.total(DECODE) + greedy.total(PREFILL) == 20


def test_queue_length_wants_two_ongoing_requests_per_engine():
    scaler = counting(QueueLengthScaler)
    engines = [engine(f"d{i}", running=3) for i in range(3)] + [
        engine("p0", PREFILL, H800, running=0)]
    _, targets = scaler.targets(closed_window(scaler), engines)
    assert targets.total(DECODE) == 5 and targets.total(PREFILL) == 1  # ceil(9 / 2); floor 1


def test_throughput_planner_divides_the_predicted_demand_by_an_engines_throughput():
    low, high = counting(ThroughputScaler, tpot_s=0.03), counting(ThroughputScaler, tpot_s=0.03)
    _, few = low.targets(closed_window(low, 20.0), [])
    _, many = high.targets(closed_window(high, 200.0), [])
    assert many.total(DECODE) > few.total(DECODE) >= 1
    prefill, decode = high.per_engine(DECODE, closed_window(counting(QueueLengthScaler), 1.0))
    assert prefill > 0 and decode > 0
    unified = counting(ThroughputScaler, roles=(UNIFIED,), tpot_s=0.03)
    _, both = unified.targets(closed_window(unified, 200.0), [])
    assert both.total(UNIFIED) >= many.total(DECODE)


def test_saturation_adds_one_when_saturated_and_removes_one_when_redistribution_is_safe():
    scaler = counting(SaturationScaler, roles=(DECODE,))
    hot = [engine(f"d{i}", kv_usage=0.85) for i in range(3)]
    cool = [engine(f"d{i}", kv_usage=0.1) for i in range(3)]
    warm = [engine(f"d{i}", kv_usage=0.55) for i in range(3)]
    assert scaler.wanted(hot) == 4
    assert scaler.wanted(cool) == 2  # 0.3 over two engines keeps 0.1 spare
    assert scaler.wanted(warm) == 3  # spare 0.25 holds, but 1.65 over two would not
    booting = cool + [engine("d9", state=EngineState.STARTING)]
    _, targets = scaler.targets(closed_window(scaler), booting)
    assert targets.total(DECODE) == 4  # no change while an engine boots


def test_requests_queued_beyond_what_the_serving_engines_clear_raise_the_sized_rate():
    """The queue must drain within one start-up (30 s here); the serving engines' spare
    capacity clears part of it, and only the rest buys engines."""
    def step(waiting: int) -> ControlStep:
        controller = Controller(settings(), 0.0)
        feed(controller, 20.0)
        return controller.step(30.0, [engine("d0", running=600, waiting=waiting),
                                      engine("p0", PREFILL, H800)])

    calm, cleared, behind, further = step(0), step(30), step(6000), step(6600)
    assert cleared.targets.rate_rps == pytest.approx(calm.targets.rate_rps)
    assert behind.targets.rate_rps > calm.targets.rate_rps
    # past the spare capacity, each 600 more queued adds 600 / 30 s = 20 req/s
    assert further.targets.rate_rps == pytest.approx(behind.targets.rate_rps + 20.0)
    assert (further.targets.cost_per_hour >= behind.targets.cost_per_hour
            > calm.targets.cost_per_hour)

# ---- agent sessions: held context and committed steps ----------------------------------

def test_the_context_held_in_tool_waits_is_a_time_mean_over_the_window():
    """s1: a step 0-10 s (context 1,000 then held 10-20 s), a second 20-30 s that ends
    it; s2: a step 0-5 s, then waits on a tool to the window's end (500 held 35 s)."""
    tracker = SessionTracker(0.0, horizon_s=60.0)
    tracker.step_issued("s1", 0.0)
    tracker.step_issued("s2", 0.0)
    tracker.step_done("s2", 5.0, 500, ends_session=False)
    tracker.step_done("s1", 10.0, 1000, ends_session=False)
    tracker.step_issued("s1", 20.0)
    tracker.step_done("s1", 30.0, 1200, ends_session=True)
    stats = tracker.close(40.0)
    assert stats.held_kv_tokens == pytest.approx((1000 * 10 + 500 * 35) / 40)
    assert (stats.starts, stats.open) == (2, 1)
    # one finished session of 2 steps: s2 (1 step, waiting) has E[n - 1 | n >= 1] = 1
    # step left; one later step per 70 open session-seconds lets it send 60 / 70 of it
    assert tracker.pace_per_s() == pytest.approx(1 / 70)
    assert stats.committed_rps == pytest.approx(60 / 70 / 60)
    assert tracker.close(50.0).held_kv_tokens == pytest.approx(500)


def test_committed_steps_come_from_finished_sessions_conditioned_on_the_steps_issued():
    tracker = SessionTracker(0.0, horizon_s=100.0)
    lengths = (2, 4, 6)  # finished sessions, a step every 10 s (reported in time order)
    for k in range(6):
        for i in (i for i, steps in enumerate(lengths) if k < steps):
            tracker.step_issued(f"f{i}", 10.0 * k)
        for i in (i for i, steps in enumerate(lengths) if k < steps):
            tracker.step_done(f"f{i}", 10.0 * k + 1, 100, ends_session=k == lengths[i] - 1)
    assert tracker.committed_rps() == 0.0  # nothing open
    for _ in range(3):  # an open session with its third step in flight
        tracker.step_issued("o", 70.0)
        if tracker._open["o"].num_steps < 3:
            tracker.step_done("o", 70.0, 100, ends_session=False)
    # E[n - 3 | n >= 3] = (4 + 6) / 2 - 3 = 2 steps, within what the pace lets it send
    # (11 later steps, o's two included, in 93 open session-seconds, x 100 s)
    assert tracker.pace_per_s() == pytest.approx((1 + 3 + 5 + 2) / (11 + 31 + 51))
    assert tracker.committed_rps() == pytest.approx(2 / 100)
    tracker.step_issued("long", 70.0)  # 7 steps issued: beyond every finished session
    for _ in range(6):
        tracker.step_done("long", 70.0, 100, ends_session=False)
        tracker.step_issued("long", 70.0)
    tracker.step_done("long", 71.0, 100, ends_session=False)
    assert tracker.committed_rps() == pytest.approx((2 + 1) / 100)  # waiting: at least one
    assert SessionTracker(0.0, 60.0).committed_rps() is None  # nothing to estimate from


def test_parallel_calls_hold_nothing_until_the_last_ends_and_silent_sessions_time_out():
    tracker = SessionTracker(0.0, horizon_s=30.0, idle_timeout_s=100.0)
    tracker.step_issued("s", 0.0)
    tracker.step_issued("s", 0.0)  # a fan-out: two calls at once
    tracker.step_done("s", 5.0, 800, ends_session=False)
    tracker.step_done("s", 10.0, 900, ends_session=False)  # waiting from 10 s on
    assert tracker.close(20.0).held_kv_tokens == pytest.approx(900 * 10 / 20)
    closed = tracker.close(200.0)  # silent since 10 s: finished after this window
    assert closed.open == 0 and closed.held_kv_tokens == pytest.approx(900)
    assert tracker.close(210.0).held_kv_tokens == 0.0
    with pytest.raises(ValueError, match="no step in flight"):
        tracker.step_done("s", 220.0, 100, ends_session=True)


def test_window_reports_uncached_lengths_and_scales_the_held_context_with_the_rate():
    window = LoadWindow(0.0)
    window.arrival(10_000, 500)
    window.arrival(20_000, 1500)
    window.sessions.step_issued("s", 0.0)
    window.sessions.step_done("s", 1.0, 12_000, ends_session=False)
    stats = window.close(10.0)
    assert (stats.mean_uncached_len, stats.cv_uncached_len) == (1000, pytest.approx(0.5))
    assert stats.held_kv_tokens == pytest.approx(12_000 * 0.9)
    observation = stats.observation(2 * stats.rate_rps)
    assert observation.mean_uncached_len == 1000
    assert observation.held_kv_tokens == pytest.approx(2 * 12_000 * 0.9)
    assert stats.observation(0.1 * stats.rate_rps).held_kv_tokens == stats.held_kv_tokens
    plain = LoadWindow(0.0)
    plain.arrival(300)
    bare = plain.close(10.0)
    assert bare.mean_uncached_len is None and bare.held_kv_tokens is None
    assert bare.committed_rps is None and committed_rps(bare) == 0.0


def test_session_events_of_two_routers_merge_into_what_one_tracker_fed_directly_sees():
    """Session s: step 1 on router a (0-10 s, context 1,000), step 2 on b (20-30 s,
    1,500, then a tool wait); f: a step on a (1-2 s, 300), its last on b (3-4 s); t: a
    step on a (5-8 s, 600, then a tool wait). b reports before a."""
    a, b = LoadReport(), LoadReport()
    a.step_issued("s", 0.0)
    a.step_issued("f", 1.0)
    a.step_done("f", 2.0, 300, ends_session=False)
    a.step_issued("t", 5.0)
    a.step_done("t", 8.0, 600, ends_session=False)
    a.step_done("s", 10.0, 1000, ends_session=False)
    b.step_issued("f", 3.0)
    b.step_done("f", 4.0, 400, ends_session=True)
    b.step_issued("s", 20.0)
    b.step_done("s", 30.0, 1500, ends_session=False)
    assert [e.kind for e in b.session_events] == [SessionEventKind.ISSUED,
                                                  SessionEventKind.DONE] * 2
    assert (b.session_events[1].context_tokens, b.session_events[1].ends_session) == (400, True)
    window = LoadWindow(0.0, commit_horizon_s=30.0)
    window.merge(b)
    window.merge(a)
    merged = window.close(40.0)
    direct = SessionTracker(0.0, horizon_s=30.0)
    for event in sorted(a.session_events + b.session_events, key=lambda e: e.sort_key):
        if event.kind is SessionEventKind.ISSUED:
            direct.step_issued(event.session_id, event.time_s)
        else:
            direct.step_done(event.session_id, event.time_s, event.context_tokens,
                             event.ends_session)
    once = direct.close(40.0)
    assert (merged.session_starts, merged.open_sessions) == (once.starts, once.open) == (3, 2)
    # held: s 1,000 over 10-20 s and 1,500 over 30-40 s, f 300 over 2-3 s, t 600 over 8-40 s
    held = (1000 * 10 + 1500 * 10 + 300 * 1 + 600 * 32) / 40
    assert merged.held_kv_tokens == pytest.approx(held) == once.held_kv_tokens
    # f finished after 2 steps; s (2 issued) and t (1) wait on a tool: at least one step
    # each, at 2 later steps per 78 open session-seconds (s 40, f 3, t 35) x 30 s
    assert merged.committed_rps == pytest.approx(2 * (2 / 78 * 30) / 30) == once.committed_rps


def test_session_events_after_the_close_wait_and_an_end_never_issued_is_left_out():
    report = LoadReport()
    assert report.is_empty
    report.step_done("before-restart", 1.0, 100, ends_session=False)
    report.step_issued("late", 12.0)
    assert not report.is_empty and report.arrivals == report.finished == 0
    window = LoadWindow(0.0)
    window.merge(report)
    first = window.close(10.0)
    assert (first.session_starts, first.open_sessions, first.held_kv_tokens) == (0, 0, None)
    second = window.close(20.0)
    assert (second.session_starts, second.open_sessions) == (1, 1)
    assert window.sessions.num_in_flight("late") == 1
    assert window.sessions.num_in_flight("before-restart") == 0


def test_a_final_answer_after_the_step_ends_its_session_and_frees_its_context():
    """The API layer reads the reply after the step's end: the answer event, at the
    same time as the end, sorts after it, and ends the session in its tool wait; an
    answer while another call of the session still runs ends nothing."""
    report = LoadReport()
    report.step_issued("s", 0.0)
    report.session_answered("s", 4.0)  # recorded last, stamped with the end's time
    report.step_done("s", 4.0, 1000, ends_session=False)
    report.step_issued("p", 0.0)
    report.step_issued("p", 0.0)
    report.step_done("p", 2.0, 500, ends_session=False)
    report.session_answered("p", 2.0)  # its other call still runs
    window = LoadWindow(0.0)
    window.merge(report)
    stats = window.close(10.0)
    assert (stats.session_starts, stats.open_sessions) == (2, 1)
    assert window.sessions.num_in_flight("p") == 1
    assert stats.held_kv_tokens == 0.0  # s ended at its answer; p never waited on a tool


def test_controller_sizes_for_the_steps_open_sessions_have_committed():
    """Two controllers see the same 150 steps in 30 s; one is told they belong to ten
    finished five-step sessions and a hundred sessions that have just started: those
    have four steps left each, of which they send what the sessions' pace fits into the
    horizon, so it sizes for more."""
    told, blind = Controller(settings(), 0.0), Controller(settings(), 0.0)
    for controller in (told, blind):
        for _ in range(150):
            controller.window.arrival(3000, 300)
            controller.window.finished(250, True)
    sessions = told.window.sessions
    for k in range(5):
        for i in range(10):
            sessions.step_issued(f"f{i}", 2.0 * k)
        for i in range(10):
            sessions.step_done(f"f{i}", 2.0 * k + 1, 3000, ends_session=k == 4)
    for i in range(100):
        sessions.step_issued(f"o{i}", 25.0)
    for i in range(100):
        sessions.step_done(f"o{i}", 26.0, 3000, ends_session=False)
    told_step, blind_step = told.step(30.0, []), blind.step(30.0, [])
    pace = 40 / (10 * 9 + 100 * 5)  # later steps per open session-second
    assert told_step.stats.committed_rps == pytest.approx(
        100 * min(4, pace * told.horizon_s) / told.horizon_s)
    assert told_step.targets.rate_rps > 1.5 * blind_step.targets.rate_rps


def test_a_kind_switch_drains_the_old_engines_only_as_the_new_ones_serve():
    """Three A800 decoders, a target of one H800: two drain at once, the third serves
    until the H800 has started; a role is never left without a serving engine."""
    planner = PoolPlanner(ScalingRules(0.0, 0.0, 30.0))
    switch = PoolTargets(10.0, {PREFILL: {H800: 1}, DECODE: {H800: 1}}, 0.0, True)
    prefill = engine("p0", PREFILL, H800)
    old = [engine(f"d{i}", running=i) for i in range(3)]
    first = planner.diff(0.0, switch, [prefill, *old])
    assert first.start == ((DECODE, H800),) and first.drain == ("d0", "d1")
    leaving = [replace(e, state=EngineState.DRAINING) for e in old[:2]]
    booting = engine("h0", kind=H800, state=EngineState.STARTING, since_s=0.0)
    assert planner.diff(10.0, switch, [prefill, old[2], *leaving, booting]).drain == ()
    served = replace(booting, state=EngineState.ACTIVE)
    assert planner.diff(60.0, switch, [prefill, old[2], served]).drain == ("d2",)
