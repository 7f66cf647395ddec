"""GoodServe decision logic: EMA status, latency estimate, just-enough, watchdog."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from app.engines.messages import EngineStatus
from app.routing.base import ActiveRequest, Reject
from app.routing.budgets import SlackBudgets
from app.routing.goodserve import (
    DEFAULT_STALL_FACTOR,
    TRAINED_PREDICTOR_STALL_FACTOR,
    GoodServeConfig,
    JustEnoughPolicy,
    JustEnoughVariant,
    LengthReestimate,
    RecentAdmissions,
    SloWatchdog,
    capability_s_per_token,
    make_goodserve,
    stall_factor_label,
)
from app.routing.goodserve.scoring import InstanceScorer
from app.routing.length import (
    PredictorLength,
    RunningHistoryLength,
    TrueLength,
)
from app.routing.quantiles import kaplan_meier_quantile
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.routing.status import StatusEstimator, catalog_prior
from app.routing.view import ClusterView, FinishReport, RouteRequest
from tests.unit.routing_utils import (
    SPECS,
    Row,
    fixed_length_predictor,
    make_cluster,
    make_request,
    make_view,
    record_arrival,
    rows_by_id,
    scored_rows,
)

pytestmark = pytest.mark.unit

def set_speed(status: StatusEstimator, gpu: str, decode_s: float, prefill_s: float = 1e-4):
    """Feed one pure-decode and one pure-prefill iteration with alpha=1."""
    status.observe_iterations(gpu, (decode_s,), 0, 4)
    status.observe_iterations(gpu, (prefill_s * 1000,), 1000, 0)


# ---- status estimator ----------------------------------------------------------
def test_ema_update_weights_new_samples_by_alpha():
    status = StatusEstimator(alpha=0.25)
    view = make_view("A40")
    status.observe_iterations("A40", (0.040,), 0, 8)
    assert status.estimate(view).decode_s_per_token == pytest.approx(0.040)
    status.observe_iterations("A40", (0.080,), 0, 8)
    assert status.estimate(view).decode_s_per_token == pytest.approx(0.050)


def test_prefill_per_token_is_ratio_of_emas():
    status = StatusEstimator(alpha=1.0)
    status.observe_iterations("A40", (0.5,), 2000, 0)
    assert status.estimate(make_view("A40")).prefill_s_per_token == pytest.approx(0.5 / 2000)


def test_unseen_and_idle_instances_use_catalog_speed():
    status = StatusEstimator(alpha=1.0)
    prior = catalog_prior(SPECS["A800"])
    assert status.estimate(make_view("A800")) == prior
    status.observe_iterations("A800", (1.0,), 0, 64)  # a heavy burst in the past
    status.observe_queue_wait("A800", 5.0, 0.0)
    idle = status.estimate(make_view("A800", running=0))
    assert idle.decode_s_per_token == prior.decode_s_per_token and idle.queue_delay_s == 0.0
    busy = status.estimate(make_view("A800", running=3, waiting=2))
    assert busy.decode_s_per_token == 1.0 and busy.queue_delay_s == 5.0


def test_polled_status_only_counts_new_window_entries():
    status = StatusEstimator(alpha=1.0)

    def poll(iterations: tuple[float, ...], count: int) -> None:
        status.on_status(EngineStatus("A40", "A40", "unified", 0, 3, iterations, (), 0, 10, 0,
                                      num_iterations=count), 0.0)

    view = make_view("A40", running=2)  # + the request being routed = the polled batch of 3
    poll((0.03, 0.04), 2)
    assert status.estimate(view).num_samples == 2
    poll((0.03, 0.04), 2)  # same report again: nothing new
    assert status.estimate(view).num_samples == 2
    poll((0.04, 0.09), 3)
    est = status.estimate(view)
    assert est.num_samples == 3 and est.decode_s_per_token == pytest.approx(0.09)


def test_decode_estimate_grows_with_the_batch_it_will_run_in():
    status = StatusEstimator(alpha=1.0)
    status.observe_iterations("A800", (0.020,), 0, 10)  # measured with 10 sequences
    same = status.estimate(make_view("A800", running=9)).decode_s_per_token
    bigger = status.estimate(make_view("A800", running=209)).decode_s_per_token
    assert same == pytest.approx(0.020)
    intercept, slope = SPECS["A800"].decode_batch_line
    assert bigger == pytest.approx(0.020 * (intercept + 210 * slope) / (intercept + 10 * slope))
    assert bigger > 1.5 * same
    # a queue does not slow the batch (the engine already runs all it can): q_g covers it
    queued = status.estimate(make_view("A800", running=9, waiting=200))
    assert queued.decode_s_per_token == pytest.approx(same)
    # the watchdog asks for requests already there: no one joins
    assert status.estimate(make_view("A800", running=10), joining=0).decode_s_per_token == (
        pytest.approx(same))


def test_forget_drops_an_instance():
    status = StatusEstimator(alpha=1.0)
    status.observe_iterations("A40", (9.0,), 0, 1)
    status.forget("A40")
    assert status.estimate(make_view("A40")) == catalog_prior(SPECS["A40"])


def test_bad_alpha_is_rejected():
    with pytest.raises(ValueError, match="alpha"):
        StatusEstimator(alpha=0.0)


# ---- latency estimate ---------------------------------------------------------
def test_latency_estimate_is_paper_equation_2():
    status = StatusEstimator(alpha=1.0)
    set_speed(status, "A800", 0.02)  # 4 decoding, as the 3 running and the newcomer
    status.observe_queue_wait("A800", 0.5, 0.0)
    cluster = make_cluster(make_view("A800", running=3, waiting=1), hits={"A800": 62})
    request = make_request(10.0, prompt=3000, block_hashes=tuple(range(100)))
    policy = JustEnoughPolicy(status, TrueLength(),
                              GoodServeConfig(long_context_estimates=False))
    _, scored = policy.placer.score(request, cluster.instances, cluster, 0.0).place(200)
    # q + (L_in - H) p + L_out d = 0.5 + (3000 - 62 x 16) x 1e-4 + 200 x 0.02
    assert scored.latency_s[0] == pytest.approx(0.5 + 2008 * 1e-4 + 4.0)


def test_capability_ranks_by_unloaded_speed():
    caps = {g: capability_s_per_token(s) for g, s in SPECS.items()}
    assert caps["H800"] < caps["A800"] < caps["A40"]


# ---- confident placement --------------------------------------------------------
def bimodal_history() -> RunningHistoryLength:
    """Finished lengths: six short chats (50 tokens) and four long generations (600)."""
    length = RunningHistoryLength()
    for n in [50] * 6 + [600] * 4:
        length.observe_length(n)
    return length


def test_running_history_gives_a_confident_conditional_quantile():
    length, request = bimodal_history(), make_request(10.0)
    assert length.predict_total(request, 0) == 50  # the median sits in the short mode
    assert length.confident_output(request, 0.5) == 50
    assert length.confident_output(request, 0.9) == 600
    assert length.conditional_quantile(60, 0.5) == 600  # past 60 tokens: long mode only
    assert length.conditional_quantile(700, 0.9) == 701  # outlived all: about to end
    assert RunningHistoryLength().confident_output(request, 0.9) == 256  # nothing seen yet
    assert TrueLength().confident_output(request, 0.1) == 200  # exact: no spread


def test_kaplan_meier_quantile_counts_running_requests_as_at_least_their_progress():
    assert kaplan_meier_quantile([10, 10, 10, 100], [], 0.75) == 10  # no censoring: empirical
    # three requests still running past 50 tokens: 10 no longer covers three quarters
    assert kaplan_meier_quantile([10, 10, 10, 100], [50, 50, 50], 0.75) == 100
    assert kaplan_meier_quantile([10, 10, 10, 100], [50, 50, 50], 0.25) == 10
    assert kaplan_meier_quantile([10], [50, 60], 0.9) is None  # censored tail: not reached
    assert kaplan_meier_quantile([], [50], 0.5) is None


def test_confident_history_length_sees_long_generations_still_running():
    """Warm-up: only short chats have finished, four long generations are running.
    Their progress, reported by the watchdog, lifts the confident length; the median
    still comes from finished lengths alone."""
    length, request = RunningHistoryLength(), make_request(10.0)
    for n in [50] * 6:
        length.observe_length(n)
    dog = SloWatchdog(StatusEstimator(alpha=1.0), length)
    running = [ActiveRequest(make_request(60.0, rid=f"long{i}"), "A40", 200 + i, True)
               for i in range(4)]
    dog.check("A40", running, make_cluster(make_view("A40")), 1.0)
    assert length.confident_output(request, 0.9) == 203  # at least that long, 4 in 10
    assert not length.warm(0.9) and length.warm(0.5)  # the 0.9 quantile is not reached yet
    assert length.predict_total(request, 0) == 50
    fresh = RunningHistoryLength()
    for n in [50] * 6:
        fresh.observe_length(n)
    fresh.on_progress({"long0": 200})
    fresh.on_drop(make_request(60.0, rid="long0"), 1.0)  # forgotten: nothing left running
    assert fresh.confident_output(request, 0.9) == 50 and fresh.warm(0.9)


def test_only_a_label_free_history_starts_cold():
    assert not RunningHistoryLength().warm(0.9)  # nothing finished yet
    assert TrueLength().warm(0.9)
    assert trained_length().warm(0.9)  # trained offline, calibrated or not


def trained_length() -> PredictorLength:
    """A trained predictor that says 100 tokens for anything."""
    return PredictorLength(fixed_length_predictor(100))


def test_a_trained_predictors_confident_length_comes_from_its_finished_errors():
    length = trained_length()
    request = make_request(10.0, out=100)  # predicted 100 tokens at arrival
    finished = [50 + 2 * i for i in range(100)]  # true / predicted from 0.5 to 2.48
    for n in finished[:-1]:
        length.on_finish(FinishReport(request, "A40", n, 0.1, 1.0), 1.0)
    assert length.confident_output(request, 0.9) is None  # 99 finished: not yet trusted
    length.on_finish(FinishReport(request, "A40", finished[-1], 0.1, 1.0), 1.0)
    assert length.confident_output(request, 0.9) == pytest.approx(100 * 2.28)
    assert length.confident_output(request, 0.5) == pytest.approx(100 * 1.48)
    assert length.confident_output(replace(request, num_generated_tokens=5), 0.9) is None


class CountingLength(PredictorLength):
    """A trained predictor saying 100 tokens, counting its calls."""

    def __init__(self) -> None:
        super().__init__(fixed_length_predictor(100))
        self.num_predictions = 0

    def predict_totals(self, requests, num_generated):
        self.num_predictions += 1
        return super().predict_totals(requests, num_generated)


def calibrated(length: PredictorLength) -> PredictorLength:
    """Finished at 0.5, 0.52, ..., 2.48 x their arrival prediction of 100 tokens."""
    request = replace(make_request(10.0, out=100), predicted_output_tokens=100)
    for n in range(50, 250, 2):
        length.on_finish(FinishReport(request, "A40", n, 0.1, 1.0), 1.0)
    return length


def test_conditional_totals_condition_the_arrival_spread_on_the_tokens_generated():
    """The total given n tokens out: p x the median ratio above n / p over the median
    ratio (1.48 here), no new call."""
    length = CountingLength()
    request = replace(make_request(10.0, out=100), predicted_output_tokens=100)
    # before 100 finishes the spread is unknown: the arrival prediction, at least n + 1
    assert length.conditional_totals([request] * 2, [0, 140]) == [100, 141]
    calibrated(length)
    totals = length.conditional_totals([request] * 5, [0, 120, 150, 247, 300])
    # medians (the lower of the two middle ones) of 0.5-2.48 (1.48) and of 1.22-2.48
    # (1.84); above 1.5 the median, 2.0, gives 135 tokens where 150 are out: n + 1; past
    # 2.47 only 2.48 is left, then nothing
    assert totals == pytest.approx([100, 100 * 1.84 / 1.48, 151, 248, 301])
    assert length.num_predictions == 0
    unpredicted = replace(make_request(10.0, out=100), predicted_output_tokens=None)
    assert length.conditional_totals([unpredicted], [30]) == length.predict_totals(
        [unpredicted], [30])
    assert length.num_predictions == 2  # predicted again, as asked just above


def test_conditional_totals_take_the_spread_of_predictions_of_the_same_scale():
    """Short predictions ran 0.2-3x their length, long ones 0.9-1.1x: having reached its
    prediction, a request predicted 40 tokens is conditioned on the short ones' ratios
    (in the same power of two), one predicted 400 on the long ones'; one predicted
    3,000 (none near) with nothing generated is its prediction."""
    length = CountingLength()
    short, long_ = (replace(make_request(10.0, out=100), predicted_output_tokens=p)
                    for p in (40, 400))
    for k in range(113):  # 8-120 tokens: ratios 0.2-3.0, median 1.6
        length.on_finish(FinishReport(short, "A40", 8 + k, 0.1, 1.0), 1.0)
    for k in range(162):  # 360-440 tokens: ratios 0.9-1.1, median 1.0
        length.on_finish(FinishReport(long_, "A40", 360 + k // 2, 0.1, 1.0), 1.0)
    huge = replace(long_, predicted_output_tokens=3000)
    totals = length.conditional_totals([short, long_, huge], [40, 400, 0])
    # above 1: medians (the lower of the two middle ones) 2.0 (short) and 1.05 (long)
    assert totals == pytest.approx([40 * 2.0 / 1.6, 400 * 1.05, 3000])
    assert length.num_predictions == 0


@pytest.mark.parametrize("reestimate, deadline_s, calls", [
    (LengthReestimate.CONDITIONAL, 17.0, 0), (LengthReestimate.REPREDICT, 17.0, 1),
    (LengthReestimate.AT_RISK, 17.0, 0), (LengthReestimate.AT_RISK, 5.0, 1)])
def test_watchdog_reestimates_without_the_predictor_unless_told_to(reestimate, deadline_s,
                                                                    calls):
    """At t=4 on an A40 (0.04 s a token) the conditional totals (150, 200 tokens) leave
    time to spare by 17 s and are late by 5 s: at-risk predicts again only then."""
    status = StatusEstimator(alpha=1.0)
    set_speed(status, "A40", 0.04)
    length = calibrated(CountingLength())
    dog = SloWatchdog(status, length, GoodServeConfig(reestimate=reestimate))
    request = replace(make_request(deadline_s, prompt=500, out=400),
                      predicted_output_tokens=100)
    items = [ActiveRequest(replace(request, request_id=f"r{n}"), "A40", n, True)
             for n in (10, 120)]
    dog.check("A40", items, make_cluster(make_view("A40")), 4.0)
    assert length.num_predictions == calls


def confident_policy(quantile: float, fast_while_cold: bool = True) -> JustEnoughPolicy:
    status = StatusEstimator(alpha=1.0)
    set_speed(status, "H800", 0.01)
    set_speed(status, "A40", 0.04)
    return JustEnoughPolicy(status, bimodal_history(),
                            GoodServeConfig(headroom=0.0, confidence_quantile=quantile,
                                             fast_while_cold=fast_while_cold))


def test_just_enough_places_by_the_confident_length_when_an_instance_meets_it():
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    # 50 tokens fit the A40 in 10 s (~2.1 s), 600 only the H800 (~6.1 s; A40 ~24 s)
    assert confident_policy(0.5).choose(make_request(10.0, rid="a"), cluster, 0.0) == "A40"
    assert confident_policy(0.9).choose(make_request(10.0, rid="b"), cluster, 0.0) == "H800"


def test_confidence_half_is_the_point_estimate_alone():
    """With long generations running, even the history's censored median says 700
    tokens; 0.5 still means the point estimate (50 tokens fit the A40; that the history
    is cold then is the next test's concern)."""
    policy = confident_policy(0.5, fast_while_cold=False)
    policy.length.on_progress({f"long{i}": 700 for i in range(20)})
    assert policy.length.confident_output(make_request(10.0), 0.5) == 700
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    assert policy.choose(make_request(10.0), cluster, 0.0) == "A40"


def test_a_cold_history_places_on_the_fastest_instance_with_capacity_to_spare():
    """Long generations still running keep the history cold: its 50-token estimate is a
    lower bound, so the H800 takes what the A40 would when warm - unless the H800 has
    lately turned arrivals away, when the weakest feasible instance is back."""
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    warm = confident_policy(0.9)
    assert warm.length.warm(0.9)
    assert warm.choose(make_request(3.0, rid="short"), cluster, 0.0) == "A40"
    policy = confident_policy(0.9)
    policy.length.on_progress({f"long{i}": 700 for i in range(20)})
    assert not policy.length.warm(0.9)
    assert policy.choose(make_request(3.0, rid="cold"), cluster, 0.0) == "H800"
    # max_tokens bounds the length: the cap is a safe estimate, placed weakest-first
    capped = make_request(3.0, rid="capped", max_output_tokens=50)
    assert policy.choose(capped, cluster, 0.0) == "A40"
    point_only = confident_policy(0.5)  # even with point estimates alone
    point_only.length.on_progress({f"long{i}": 700 for i in range(20)})
    assert point_only.choose(make_request(3.0, rid="cold"), cluster, 0.0) == "H800"
    assert point_only.choose(capped, cluster, 0.0) == "A40"
    record_arrival(policy.admissions, make_request(3.0), [turned_away("H800")], headroom=0.0)
    assert policy.choose(make_request(3.0, rid="contended"), cluster, 0.0) == "A40"
    unset = confident_policy(0.9, fast_while_cold=False)
    unset.length.on_progress({f"long{i}": 700 for i in range(20)})
    assert unset.choose(make_request(3.0, rid="cold"), cluster, 0.0) == "A40"


def test_point_estimate_places_when_no_instance_meets_the_confident_length():
    policy = confident_policy(0.9)
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    # 600 tokens miss 3 s everywhere; 50 tokens still fit the A40 (~2.1 s)
    assert policy.choose(make_request(3.0), cluster, 0.0) == "A40"
    assert policy.budgets.shortest_stall_s("A40") == pytest.approx(0.9, abs=0.05)


def test_confidence_quantile_reaches_goodserve_but_not_slo_pack():
    options = RoutingOptions(goodserve=GoodServeConfig(confidence_quantile=0.75))
    assert build_routing(PolicyKind.GOODSERVE, options).policy.config.confidence_quantile == 0.75
    assert build_routing(PolicyKind.SLO_PACK, options).policy.config.confidence_quantile == 0.5
    # the cold-start rule is GoodServe's, not the baseline's
    assert build_routing(PolicyKind.GOODSERVE, options).policy.config.fast_while_cold
    assert not build_routing(PolicyKind.SLO_PACK, options).policy.config.fast_while_cold
    # so is triage, long contexts included
    slo_pack = build_routing(PolicyKind.SLO_PACK, options).policy
    assert not slo_pack.triages(RouteRequest("r", 0.0, 1.0, 100_000))
    assert build_routing(PolicyKind.GOODSERVE, options).policy.triages(
        RouteRequest("r", 0.0, 1.0, 100_000))
    off = RoutingOptions(goodserve=GoodServeConfig(fast_while_cold=False))
    assert not build_routing(PolicyKind.GOODSERVE, off).policy.config.fast_while_cold
    with pytest.raises(ValueError, match="confidence_quantile"):
        GoodServeConfig(confidence_quantile=0.4)


# ---- just-enough --------------------------------------------------------------
def policy_with_speeds(variant=JustEnoughVariant.WEAKEST, admission=False, triage=True,
                       **decode_s):
    status = StatusEstimator(alpha=1.0)
    for gpu, d in decode_s.items():
        set_speed(status, gpu, d)
    config = GoodServeConfig(variant=variant, headroom=0.0, admission_control=admission,
                             triage=triage)
    return JustEnoughPolicy(status, TrueLength(), config)


def test_just_enough_picks_weakest_instance_that_meets_the_deadline():
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # 200 tokens: A40 needs ~8.1 s, A800 ~3.1 s, H800 ~2.1 s
    assert policy.choose(make_request(20.0), cluster, 0.0) == "A40"
    assert policy.choose(make_request(5.0), cluster, 0.0) == "A800"
    assert policy.choose(make_request(2.5), cluster, 0.0) == "H800"


def test_just_enough_ranks_by_capability_not_current_load():
    # the A800 is loaded so much that it is momentarily slower than the A40
    policy = policy_with_speeds(H800=0.01, A800=0.03, A40=0.025)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    assert policy.choose(make_request(20.0), cluster, 0.0) == "A40"
    # both weak ones feasible -> A40 (weakest by catalog) even though A800 is slower now
    assert policy.choose(make_request(7.0), cluster, 0.0) == "A40"


def test_least_slack_variant_finishes_closest_to_deadline():
    policy = policy_with_speeds(JustEnoughVariant.LEAST_SLACK, H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    assert policy.choose(make_request(8.5), cluster, 0.0) == "A40"
    assert policy.choose(make_request(8.0), cluster, 0.0) == "A800"


def test_no_feasible_instance_falls_back_to_min_latency():
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04, triage=False)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    assert policy.choose(make_request(0.5), cluster, 0.0) == "H800"


def test_triage_sends_a_hopeless_request_to_the_most_backlogged_instance():
    """Late everywhere even with its optimistic length: it goes where it takes least
    from requests that can still make it (the largest T), not to the fastest."""
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # exact length 200: the H800 needs ~2.1 s; 0.5 s is hopeless -> A40 (~8.1 s)
    assert policy.choose(make_request(0.5, rid="late"), cluster, 0.0) == "A40"
    # a backlog on the A800 makes it the sink instead
    backlogged = make_cluster(make_view("H800"), make_view("A800", running=60),
                              make_view("A40"))
    set_speed(policy.status, "A800", 0.5)
    assert policy.choose(make_request(0.5, rid="late2"), backlogged, 0.0) == "A800"


def test_a_hopeless_session_step_is_triaged_unless_told_not_to():
    """Under overload the sink sheds hopeless steps of sessions too (the default); with
    `triage_session_steps` off such a step is placed best effort (the fastest, H800),
    where its session's next steps would fare better."""
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    step = make_request(0.5, rid="step", session_id="s")
    assert policy_with_speeds(H800=0.01, A800=0.015, A40=0.04).choose(
        step, cluster, 0.0) == "A40"
    spread = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    spread.config = spread.config.model_copy(update={"triage_session_steps": False})
    assert spread.choose(replace(step, request_id="step2"), cluster, 0.0) == "H800"


def test_a_late_session_step_goes_only_where_a_drained_queue_would_meet_it():
    """Nothing meets 12 s: the H800 has 30 s of queue, the A40 none but needs ~23 s to
    prefill the 100k-token context it does not cache and decode 200 tokens. Min T alone
    picks the A40, which no drained queue makes fast enough: the session's next steps
    would follow their context there. Its home is the H800, which would meet it once
    drained; a lone request, or `session_homes` off, still takes the A40."""
    status = StatusEstimator(alpha=1.0)
    for gpu, d in (("H800", 0.01), ("A40", 0.04)):
        set_speed(status, gpu, d)
    status.observe_queue_wait("H800", 30.0, 0.0)
    config = GoodServeConfig(headroom=0.0, triage=False, protect_admitted=False,
                             long_context_estimates=False)
    cluster = make_cluster(make_view("H800", waiting=4), make_view("A40", running=0),
                           hits={"H800": 6000})
    step = make_request(12.0, prompt=100_000, rid="step", session_id="s",
                        block_hashes=tuple(range(6250)))
    candidates = rows_by_id(JustEnoughPolicy(status, TrueLength(), config).placer.score(
        step, cluster.instances, cluster, 0.0).place(200)[1])
    assert not any(c.meets_deadline() for c in candidates.values())
    assert candidates["A40"].latency_s < candidates["H800"].latency_s
    assert candidates["H800"].capable() and not candidates["A40"].capable()
    assert JustEnoughPolicy(status, TrueLength(), config).choose(step, cluster, 0.0) == "H800"
    lone = replace(step, request_id="lone", session_id=None)
    assert JustEnoughPolicy(status, TrueLength(), config).choose(lone, cluster, 0.0) == "A40"
    off = config.model_copy(update={"session_homes": False})
    assert JustEnoughPolicy(status, TrueLength(), off).choose(step, cluster, 0.0) == "A40"


def test_triage_spares_a_request_that_a_short_output_would_still_let_meet():
    """A trained predictor that has not yet learned its error spread offers no
    optimistic length, so triage assumes one token: a deadline that one token meets
    on the H800 is not hopeless, and the request gets the fastest instance."""
    status = StatusEstimator(alpha=1.0)
    for gpu, d in (("H800", 0.01), ("A800", 0.015), ("A40", 0.04)):
        set_speed(status, gpu, d)
    policy = JustEnoughPolicy(status, PredictorLength(fixed_length_predictor(200)),
                              GoodServeConfig(headroom=0.0))
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # 200 predicted tokens miss 0.5 s everywhere; 1 token (~0.11 s) meets it on the H800
    assert policy.choose(make_request(0.5, rid="maybe"), cluster, 0.0) == "H800"
    # a prompt whose prefill alone overruns the deadline everywhere is hopeless
    assert policy.choose(make_request(0.5, prompt=60_000, rid="late"), cluster, 0.0) == "A40"


def test_admission_control_rejects_early_with_reason():
    policy = policy_with_speeds(admission=True, H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    decision = policy.choose(make_request(0.5), cluster, 0.0)
    assert isinstance(decision, Reject) and "deadline" in decision.reason
    assert policy.choose(make_request(math.inf), cluster, 0.0) == "A40"


def test_admission_control_admits_a_session_at_its_first_step_only():
    """A session is turned away at its first step; a later step that no instance can
    meet is served best effort, since rejecting it would end a session already
    admitted."""
    policy = policy_with_speeds(admission=True, H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    first = policy.choose(make_request(0.5, rid="s/0", session_id="s"), cluster, 0.0)
    assert isinstance(first, Reject) and "deadline" in first.reason
    later = make_request(0.5, rid="t/3", session_id="t", step_index=3)
    assert policy.choose(later, cluster, 0.0) == "A40"  # hopeless: the triage sink
    assert isinstance(policy.choose(make_request(0.5, rid="lone"), cluster, 0.0), Reject)


def test_admission_control_admits_what_meets_the_deadline_without_headroom():
    """Placement keeps half of T in reserve; admission control turns away only requests
    no instance meets even with none to spare (long prompts under overload, where a
    stricter rule turned away requests that would have met)."""
    status = StatusEstimator(alpha=1.0)
    for gpu, d in {"H800": 0.01, "A40": 0.04}.items():
        set_speed(status, gpu, d)
    policy = JustEnoughPolicy(status, TrueLength(), GoodServeConfig(
        headroom=0.5, admission_control=True, triage=True))
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    # 200 tokens on the H800 take ~2.1 s: met at 2.5 s, but with less than 0.5 x T spare
    assert policy.choose(make_request(2.5, rid="tight"), cluster, 0.0) == "H800"
    assert isinstance(policy.choose(make_request(1.5, rid="late"), cluster, 0.0), Reject)


def test_prefix_hit_makes_a_weaker_instance_feasible():
    policy = policy_with_speeds(H800=0.01, A40=0.02)
    policy.status.observe_iterations("A40", (0.01 * 1000,), 1000, 0)  # 10 ms per prompt token
    request = make_request(7.0, prompt=600)
    no_hit = make_cluster(make_view("H800"), make_view("A40"))
    assert policy.choose(request, no_hit, 0.0) == "H800"
    with_hit = make_cluster(make_view("H800"), make_view("A40"), hits={"A40": 36})  # 576 tokens
    request = make_request(7.0, prompt=600, block_hashes=tuple(range(36)))
    assert policy.choose(request, with_hit, 0.0) == "A40"


@pytest.mark.parametrize("affinity, chosen", [(2048, "A800"), (None, "A40")])
def test_cache_affinity_keeps_a_cached_long_context_where_it_is_cached(affinity, chosen):
    """Both weaker GPUs meet the deadline; the A800 holds 9,600 of the 10,000 context
    tokens. Just-enough alone takes the weakest (A40) and recomputes the context there;
    with cache affinity only instances within 2,048 uncached tokens of the best count."""
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.02)
    config = policy.config.model_copy(update={"cache_affinity_tokens": affinity})
    policy = JustEnoughPolicy(policy.status, TrueLength(), config)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"),
                           hits={"A800": 600})  # 600 blocks x 16 tokens
    request = make_request(60.0, prompt=10_000, block_hashes=tuple(range(625)))
    assert policy.choose(request, cluster, 0.0) == chosen


def test_no_memory_room_makes_instance_infeasible():
    policy = policy_with_speeds(H800=0.01, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A40", free_blocks=10))
    assert policy.choose(make_request(20.0), cluster, 0.0) == "H800"


def test_placing_is_a_pure_probe_and_only_the_acted_on_choice_is_admitted():
    """`place` may be asked any number of times (confident length, point estimate, the
    watchdog's targets) without leaving budgets behind; the policy admits once."""
    policy = policy_with_speeds(H800=0.01, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    request = make_request(20.0, prompt=200, out=100, rid="probe")
    for _ in range(3):
        chosen, _ = policy.placer.score(request, cluster.instances, cluster, 0.0).place(100)
        assert chosen is not None and chosen.instance_id == "A40"
        assert len(policy.budgets) == 0
    assert policy.choose(request, cluster, 0.0) == "A40"
    assert len(policy.budgets) == 1
    assert policy.budgets.shortest_stall_s("A40") == pytest.approx(chosen.slack_s)


def test_policy_forwards_finishes_to_the_length_estimator():
    length = RunningHistoryLength()
    policy = JustEnoughPolicy(StatusEstimator(), length)
    for n in (100, 200, 300):
        policy.on_finish(FinishReport(make_request(1.0), "A40", n, 0.1, 1.0), 1.0)
    assert length.predict_total(make_request(1.0), 0) == 200
    assert length.predict_total(make_request(1.0), 250) == 300


# ---- watchdog -----------------------------------------------------------------
def make_watchdog(**decode_s) -> SloWatchdog:
    status = StatusEstimator(alpha=1.0)
    for gpu, d in decode_s.items():
        set_speed(status, gpu, d)
    # budgets refreshed at each move check (every tau), as these tests count in taus
    return SloWatchdog(status, TrueLength(),
                       GoodServeConfig(headroom=0.0, budget_refresh_iterations=50))


def active(slo_s: float, generated: int, out: int = 400, gpu: str = "A40") -> ActiveRequest:
    return ActiveRequest(make_request(slo_s, prompt=500, out=out), gpu, generated, True)


def test_watchdog_migrates_exactly_when_finish_would_miss_the_deadline():
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    now = 4.0  # 100 generated, 300 left: A40 needs 12 s more, A800 ~4.6 s, H800 ~3.1 s
    on_time = dog.check("A40", [active(17.0, 100)], cluster, now)
    assert on_time == {}
    late = dog.check("A40", [active(10.0, 100)], cluster, now)
    assert late == {"r": "A800"}  # just-enough among stronger instances


def test_migration_margin_moves_only_clearly_late_requests():
    """A40 needs 12 s for the 300 tokens left: 2 s late with 10 s left is within a 0.5
    margin (stays, unprotected); 6 s late with 6 s left is not (moves)."""
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    dog.config = dog.config.model_copy(update={"migration_margin": 0.5})
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    dog.budgets.admit("A40", "r", 1.0)
    assert dog.check("A40", [active(14.0, 100)], cluster, 4.0) == {}
    assert len(dog.budgets) == 0  # barely late: no longer protected
    assert dog.check("A40", [active(10.0, 100)], cluster, 4.0) == {"r": "A800"}
    with pytest.raises(ValueError, match="migration_margin"):
        GoodServeConfig(migration_margin=-0.1)


def test_watchdog_keeps_request_when_no_stronger_instance_can_make_it():
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    assert dog.check("A40", [active(5.0, 100)], cluster, 4.0) == {}


def test_watchdog_never_moves_from_the_strongest_or_twice():
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    assert dog.check("H800", [active(4.5, 100, gpu="H800")], cluster, 4.0) == {}
    assert dog.check("A40", [active(10.0, 100)], cluster, 4.0) == {"r": "A800"}
    assert dog.check("A40", [active(10.0, 100)], cluster, 4.0) == {}  # limit 1 per request


def test_recent_admissions_keep_a_window_per_instance():
    admissions = RecentAdmissions(GoodServeConfig(admissions_window=3))
    assert admissions.quantile_s("A800", 0.5) == math.inf  # nothing placed there yet
    for latency in (9.0, 1.0, 2.0, 3.0):  # the 9.0 falls out of the window
        admissions.record("A800", latency)
    assert admissions.quantile_s("A800", 0.5) == 2.0
    assert admissions.quantile_s("A800", 1.0) == 3.0
    assert admissions.quantile_s("A40", 0.0) == math.inf
    with pytest.raises(ValueError, match="admissions_window"):
        GoodServeConfig(admissions_window=0)


def turned_away(instance_id: str) -> Row:
    """An arrival that would have met its deadline on the instance but for its budgets."""
    return Row(instance_id, latency_s=1.0, slack_s=5.0, capability_s_per_token=0.01,
               has_memory_room=True, stall_s=0.2, shortest_stall_s=0.1)


def test_recent_admissions_know_which_instances_turned_arrivals_away():
    admissions = RecentAdmissions(GoodServeConfig(admissions_window=2))
    arrival = make_request(10.0)
    record_arrival(admissions, arrival, [turned_away("H800")], headroom=0.5)
    assert admissions.contended("H800") and not admissions.contended("A40")
    late = replace(turned_away("A40"), slack_s=0.1)  # would not have met there anyway
    record_arrival(admissions, arrival, [late], headroom=0.5)
    assert admissions.contended("H800") and not admissions.contended("A40")
    record_arrival(admissions, arrival, [], headroom=0.5)  # two arrivals later: spare again
    assert not admissions.contended("H800")


def test_an_instance_strands_an_arrival_only_when_nothing_else_could_take_it():
    admissions = RecentAdmissions(GoodServeConfig(admissions_window=2))
    arrival = make_request(10.0)
    room_elsewhere = Row("A800", latency_s=1.0, slack_s=5.0, capability_s_per_token=0.02,
                         has_memory_room=True)
    record_arrival(admissions, arrival, [turned_away("H800"), room_elsewhere], headroom=0.5)
    assert admissions.contended("H800") and not admissions.stranding_rows(("H800",))[0]
    record_arrival(admissions, arrival, [turned_away("H800")], headroom=0.5)
    assert admissions.stranding_rows(("H800",))[0]
    record_arrival(admissions, arrival, [], headroom=0.5)
    record_arrival(admissions, arrival, [], headroom=0.5)
    assert not admissions.stranding_rows(("H800",))[0]
    # turned away by its reservation: still contended, but that does not extend it
    reserved = replace(turned_away("H800"), shortest_stall_s=math.inf, reserved=True)
    record_arrival(admissions, arrival, [reserved], headroom=0.5)
    assert admissions.contended("H800") and not admissions.stranding_rows(("H800",))[0]


def test_stranding_counts_arrivals_that_could_meet_their_deadline_only_without_headroom():
    """In overload nothing meets with headroom; an arrival the strongest instance turns
    away for lack of capacity, though it would meet there with none, is still stranded
    (else the reservation switches off when the pool is most contended)."""
    admissions = RecentAdmissions(GoodServeConfig(admissions_window=2))
    arrival = make_request(10.0)
    at_the_edge = replace(turned_away("H800"), slack_s=0.2)  # meets, but not with 0.5 x T
    record_arrival(admissions, arrival, [at_the_edge], headroom=0.5)
    assert admissions.stranding_rows(("H800",))[0] and admissions.any_stranding()
    assert not admissions.contended("H800")  # no move could meet with headroom there
    harmless_edge = Row("A800", latency_s=1.0, slack_s=0.2, capability_s_per_token=0.02,
                        has_memory_room=True)  # fallback's first step takes it there
    record_arrival(admissions, arrival, [at_the_edge, harmless_edge], headroom=0.5)
    record_arrival(admissions, arrival, [at_the_edge, harmless_edge], headroom=0.5)
    assert not admissions.stranding_rows(("H800",))[0]


def test_slo_span_quantile_waits_for_enough_arrivals():
    admissions = RecentAdmissions(GoodServeConfig(slo_window=200))
    min_samples = GoodServeConfig().min_slo_samples
    for span in range(1, min_samples):
        record_arrival(admissions, make_request(float(span)), [], headroom=0.0)
    assert admissions.slo_span_quantile_s(0.9) == math.inf
    record_arrival(admissions, make_request(float(min_samples)), [], headroom=0.0)
    # no deadline: not a span
    record_arrival(admissions, make_request(math.inf), [], headroom=0.0)
    assert admissions.slo_span_quantile_s(0.9) == pytest.approx(0.9 * min_samples, abs=1)
    with pytest.raises(ValueError, match="slo_window"):
        GoodServeConfig(slo_window=0)


def stranding_h800_after_spans(admissions: RecentAdmissions) -> None:
    """Arrivals with SLO spans 1..100 s, the last of them stranded by the H800."""
    for span in range(1, 101):
        record_arrival(admissions, make_request(float(span)), [], headroom=0.0)
    record_arrival(admissions, make_request(50.0), [turned_away("H800")], headroom=0.0)


def test_stranding_strongest_instance_is_reserved_for_tighter_slos():
    """9,000 tokens need ~90 s on the H800 and ~135 s on the A800: only the H800 can
    meet a 95 s deadline, but 95 s is looser than 90% of recent arrivals."""
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    loose, tight = make_request(95.0, out=9000), make_request(85.0, out=8000)
    assert policy.choose(loose, cluster, 0.0) == "H800"  # not stranding yet
    stranding_h800_after_spans(policy.admissions)
    assert policy.choose(loose, cluster, 0.0) == "A800"  # best effort elsewhere
    assert policy.choose(tight, cluster, 0.0) == "H800"
    unreserved = JustEnoughPolicy(policy.status, TrueLength(),
                                  GoodServeConfig(headroom=0.0, reservation_quantile=1.0))
    stranding_h800_after_spans(unreserved.admissions)
    assert unreserved.choose(loose, cluster, 0.0) == "H800"
    with pytest.raises(ValueError, match="reservation_quantile"):
        GoodServeConfig(reservation_quantile=1.5)


def test_reserve_marks_only_the_pools_strongest_instances():
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    admissions = policy.admissions
    stranding_h800_after_spans(admissions)
    record_arrival(admissions, make_request(50.0), [turned_away("A800")], headroom=0.0)
    assert admissions.stranding_rows(("A800",))[0]
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    placer = policy.placer

    def reserved(request: RouteRequest, quantile: float = 0.9) -> set[str]:
        config = placer.config.model_copy(update={"reservation_quantile": quantile})
        scored = replace(placer, config=config).score(request, cluster.instances, cluster,
                                                        0.0).place(200)[1]
        return {iid for iid, row in rows_by_id(scored).items() if row.reserved}

    assert reserved(make_request(95.0)) == {"H800"}  # the A800 strands, but is not strongest
    assert reserved(make_request(math.inf)) == {"H800"}  # no deadline: the loosest of all
    assert reserved(make_request(50.0)) == set()
    assert reserved(make_request(95.0), quantile=1.0) == set()


def test_watchdog_does_not_move_a_loose_request_onto_a_reserved_instance():
    policy, dog = make_goodserve(TrueLength(), GoodServeConfig(headroom=0.0))
    for gpu, d in {"H800": 0.01, "A800": 0.015, "A40": 0.04}.items():
        set_speed(policy.status, gpu, d)
    moving_a800 = replace(make_view("A800"), num_iterations=50)  # a tau has passed
    cluster = make_cluster(make_view("H800"), moving_a800, make_view("A40"))
    late_on_a800 = ActiveRequest(make_request(95.0, out=9000), "A800", 0, is_running=True)
    assert dog.check("A800", [late_on_a800], cluster, 0.0) == {"r": "H800"}
    policy, dog = make_goodserve(TrueLength(), GoodServeConfig(headroom=0.0))
    for gpu, d in {"H800": 0.01, "A800": 0.015, "A40": 0.04}.items():
        set_speed(policy.status, gpu, d)
    stranding_h800_after_spans(dog.admissions)
    assert dog.check("A800", [late_on_a800], cluster, 0.0) == {}


def test_move_may_cost_a_contended_target_no_more_than_a_typical_arrival():
    """Resumed on the A800 the late request needs ~4.6 s (re-prefill + 300 tokens)."""
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))

    def dog_after_arrivals(latency_s: float, quantile: float, contended: bool = True
                           ) -> SloWatchdog:
        dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
        dog.config = dog.config.model_copy(update={"migration_cost_quantile": quantile})
        for _ in range(5):
            dog.admissions.record("A800", latency_s)
            dog.admissions.record("H800", latency_s)
        if contended:
            record_arrival(dog.admissions, make_request(10.0),
                           [turned_away("A800"), turned_away("H800")], 0.0)
        return dog

    cheap_arrivals = dog_after_arrivals(1.0, 0.5)
    cheap_arrivals.budgets.admit("A40", "r", 1.0)
    assert cheap_arrivals.check("A40", [active(10.0, 100)], cluster, 4.0) == {}
    assert len(cheap_arrivals.budgets) == 0  # stays, unprotected, nothing admitted on A800
    assert dog_after_arrivals(6.0, 0.5).check(
        "A40", [active(10.0, 100)], cluster, 4.0) == {"r": "A800"}
    assert dog_after_arrivals(1.0, 1.0).check(  # no limit
        "A40", [active(10.0, 100)], cluster, 4.0) == {"r": "A800"}
    assert dog_after_arrivals(1.0, 0.5, contended=False).check(  # capacity to spare
        "A40", [active(10.0, 100)], cluster, 4.0) == {"r": "A800"}
    with pytest.raises(ValueError, match="migration_cost_quantile"):
        GoodServeConfig(migration_cost_quantile=1.5)


def test_policy_records_what_its_placements_cost_for_the_watchdog():
    policy, dog = make_goodserve(TrueLength(), GoodServeConfig(headroom=0.0))
    assert dog.admissions is policy.admissions
    set_speed(policy.status, "H800", 0.01)
    cluster = make_cluster(make_view("H800"))
    request = make_request(100.0, prompt=500, out=400)
    assert policy.choose(request, cluster, 0.0) == "H800"
    estimate = policy.status.estimate(cluster.get("H800"), 0.0)
    expected = (estimate.queue_delay_s + 500 * estimate.prefill_s_per_token
                + 400 * estimate.decode_s_per_token)
    assert policy.admissions.quantile_s("H800", 0.5) == pytest.approx(expected)


def test_budgets_refresh_every_check_but_moves_wait_for_tau():
    """tau 50, refresh 20: checks every gcd = 10 iterations, moves on every 5th check."""
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    dog = SloWatchdog(dog.status, TrueLength(), GoodServeConfig(
        headroom=0.0, tau_iterations=50, budget_refresh_iterations=20))
    assert dog.check_period_iterations == 10

    def at(iterations: int) -> ClusterView:
        a40 = replace(make_view("A40"), num_iterations=iterations)
        return make_cluster(make_view("H800"), make_view("A800"), a40)

    for iterations in (10, 20, 30, 40):  # late, A800 could take it, but tau has not passed
        dog.budgets.admit("A40", "r", 1.0)
        assert dog.check("A40", [active(10.0, 100)], at(iterations), 4.0) == {}
        assert len(dog.budgets) == 0  # the refresh still drops its protection
    assert dog.check("A40", [active(10.0, 100)], at(50), 4.0) == {"r": "A800"}
    dog.req_to_num_migrations.clear()  # as if another late request were there
    assert dog.check("A40", [active(10.0, 100)], at(60), 4.0) == {}
    # a poller that sees several periods at once still moves at the next tau boundary
    assert dog.check("A40", [active(10.0, 100)], at(130), 4.0) == {"r": "A800"}
    with pytest.raises(ValueError, match="budget_refresh_iterations"):
        GoodServeConfig(budget_refresh_iterations=0)
    _, default = make_goodserve(RunningHistoryLength())
    assert (default.tau_iterations, default.check_period_iterations) == (50, 10)


def test_make_goodserve_shares_estimators_and_ablates_migration():
    policy, dog = make_goodserve(RunningHistoryLength(), GoodServeConfig(tau_iterations=25))
    assert dog.status is policy.status and dog.length is policy.length
    assert dog.budgets is policy.budgets and dog.admissions is policy.admissions
    assert dog.tau_iterations == 25
    stack = build_routing(PolicyKind.GOODSERVE_NO_MIGRATION)
    assert stack.watchdog.config.max_migrations_per_request == 0  # budgets kept, nobody moved


def test_watchdog_refreshes_budgets_from_progress_and_drops_late_requests():
    dog = make_watchdog(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # 100 of 400 tokens done at t=4 with 13 s left: 300 tokens take 12 s, 1 s to spare
    assert dog.check("A40", [active(17.0, 100)], cluster, 4.0) == {}
    assert dog.budgets.shortest_stall_s("A40") == pytest.approx(1.0)
    # at t=14 it has fallen behind and no stronger instance can save it: unprotected
    assert dog.check("A40", [active(17.0, 100)], cluster, 14.0) == {}
    assert dog.budgets.shortest_stall_s("A40") == math.inf
    # without migration the watchdog keeps budgets but never moves anyone
    still = SloWatchdog(dog.status, TrueLength(), GoodServeConfig(
        headroom=0.0, budget_refresh_iterations=50, max_migrations_per_request=0))
    assert still.check("A40", [active(10.0, 100)], cluster, 4.0) == {}


def test_queue_delay_follows_a_growing_queue_by_littles_law():
    status = StatusEstimator(alpha=0.2)
    status.observe_queue_wait("A40", 0.1, 0.0)
    for t in range(1, 5):  # one request finishes per second
        status.on_status(EngineStatus("A40", "A40", "unified", 0, 4, (), (), 0, 10, 0,
                                      num_finished=t), float(t))
    # 8 requests waiting, ~1 departure/s: ~8 s of queue, far above the lagging EMA
    est = status.estimate(make_view("A40", running=4, waiting=8), now=4.0)
    assert est.queue_delay_s == pytest.approx(8.0, rel=0.01)
    assert status.estimate(make_view("A40", running=4, waiting=0), now=4.0).queue_delay_s == 0.0


# ---- do-no-harm budgets ------------------------------------------------------------
def test_slack_budgets_track_the_smallest_admitted_slack():
    budgets = SlackBudgets()
    assert budgets.shortest_stall_s("A40") == math.inf
    budgets.admit("A40", "a", 0.2)
    budgets.admit("A40", "b", 0.9)
    budgets.admit("A800", "c", 0.1)
    assert budgets.shortest_stall_s("A40") == 0.2
    budgets.remove("a")
    assert budgets.shortest_stall_s("A40") == 0.9
    budgets.admit("A40", "b", 0.5)  # refreshed by the watchdog
    assert budgets.shortest_stall_s("A40") == 0.5
    budgets.admit("A800", "b", 0.3)  # moved by a migration
    assert budgets.shortest_stall_s("A40") == math.inf
    assert budgets.shortest_stall_s("A800") == 0.1
    budgets.admit("A800", "d", math.inf)  # no deadline: constrains nothing
    assert len(budgets) == 2


@pytest.mark.parametrize("triage, long_sink", [(None, "A40"), (False, "H800")])
def test_label_free_history_triages_long_contexts_only(triage, long_sink):
    """With the running history, triage is off, except for requests whose context is
    long (their T is mostly the known queue and prefill): a hopeless 5,000-token
    request goes to the most backlogged instance (the A40, largest T), a hopeless
    short one to the fastest; `triage=False` turns both off."""
    status = StatusEstimator(alpha=1.0)
    for gpu, d in {"H800": 0.01, "A40": 0.04}.items():
        set_speed(status, gpu, d)
    policy = JustEnoughPolicy(status, RunningHistoryLength(), GoodServeConfig(
        triage=triage, triage_min_context_tokens=2048))
    cluster = make_cluster(make_view("H800"), make_view("A40"))
    assert policy.choose(make_request(0.5, prompt=5000, rid="long"), cluster, 0.0) == long_sink
    assert policy.choose(make_request(0.01, prompt=100, rid="short"), cluster, 0.0) == "H800"


def test_late_request_avoids_instances_whose_admitted_requests_its_prefill_would_stall():
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04, triage=False)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # tight: H800 needs 2.1 s of its 2.2 s -> 0.1 s of slack
    assert policy.choose(make_request(2.2, rid="tight"), cluster, 0.0) == "H800"
    hopeless = make_request(0.5, prompt=5000, rid="late")
    by_id = rows_by_id(policy.placer.score(hopeless, cluster.instances, cluster,
                                             0.0).place(200)[1])
    # the H800 is still the fastest for it, but its 0.5 s prefill would make "tight" late
    assert min(by_id, key=lambda iid: by_id[iid].latency_s) == "H800"
    assert not by_id["H800"].harmless and by_id["A800"].harmless
    assert policy.choose(hopeless, cluster, 0.0) == "A800"
    # once nothing admitted is left to protect, best effort means the fastest again
    policy.on_finish(FinishReport(make_request(2.2, rid="tight"), "H800", 200, 0.1, 2.1), 2.1)
    assert policy.choose(make_request(0.5, prompt=5000, rid="late2"), cluster, 2.1) == "H800"


def test_an_instance_is_not_closed_for_the_slowdown_a_newcomer_adds():
    """Decode is memory-bound: joining a batch slows it by well under 1%. Only the
    newcomer's prefill is budgeted; a per-token budget closed instances to arrivals
    that would have met (docs/goodserve-routing.md, "do-no-harm budgets")."""
    policy = policy_with_speeds(H800=0.01, A800=0.015, A40=0.04)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    # tight: A40 takes 8.1 s of its 8.2 s, 0.1 s of slack
    assert policy.choose(make_request(8.2, rid="tight"), cluster, 0.0) == "A40"
    # 6 running: one more makes a step ~1% slower, which "tight" alone could not afford
    # per token; a short prefill (0.05 s) fits its slack, so the A40 stays open
    busier = make_cluster(make_view("H800"), make_view("A800"), make_view("A40", running=6))
    assert policy.choose(make_request(60.0, prompt=500, rid="loose"), busier, 0.0) == "A40"


def test_headroom_reserves_the_new_requests_slack_not_the_admitted_budgets():
    """T 2 s with 1 s of slack: feasible with up to 0.5 x T in reserve; a stall past the
    admitted budget or no KV room closes it whatever the headroom."""
    request = make_request(3.0, rid="new")
    row = Row("A40", latency_s=2.0, slack_s=1.0, capability_s_per_token=0.02,
              has_memory_room=True, stall_s=0.09, shortest_stall_s=0.1)

    def feasible(row: Row, headroom: float) -> bool:
        scorer = scored_rows(request, [row]).scorer  # T 2 s of the 3 s left
        return scorer.place(1.0, JustEnoughVariant.WEAKEST, headroom, None)[0] is not None

    assert feasible(row, 0.5) and not feasible(row, 0.6)
    assert not feasible(replace(row, stall_s=0.11), 0.0)
    assert not feasible(replace(row, has_memory_room=False), 0.0)


def test_best_effort_placement_with_time_to_spare_is_protected():
    status = StatusEstimator(alpha=1.0)
    for gpu, d in (("H800", 0.01), ("A800", 0.015), ("A40", 0.04)):
        set_speed(status, gpu, d)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    policy = JustEnoughPolicy(status, TrueLength(), GoodServeConfig(headroom=0.5))
    # 2.5 s: H800 makes it (2.1 s) but not with half of T in reserve (3.15 s) -> best effort
    assert policy.choose(make_request(2.5, rid="edge"), cluster, 0.0) == "H800"
    assert policy.budgets.shortest_stall_s("H800") < math.inf
    # hopeless everywhere: placed (triage: on the most backlogged), nothing to protect
    assert policy.choose(make_request(0.5, rid="late"), cluster, 0.0) == "A40"
    assert len(policy.budgets) == 1


@pytest.mark.parametrize("factor, harmless_prompts, harmful_prompts", [
    (1.0, (1000, 2500), (5000,)),  # the default: a 5000-token prefill stalls "edge" 0.5 s
    (0.5, (1000, 5000), (8000,)),  # half the 0.5 s prefill fits the 0.3 s slack
    (0.0, (1000, 8000), ()),  # no check at all
])
def test_long_prefill_cannot_stall_an_admitted_request_past_its_slack(
    factor, harmless_prompts, harmful_prompts
):
    """A loose request fits the H800 by speed, but not if its prefill (times the stall
    factor) exceeds the slack of the request already there."""
    status = StatusEstimator(alpha=1.0)
    for gpu, d in (("H800", 0.01), ("A800", 0.015)):
        set_speed(status, gpu, d)
    config = GoodServeConfig(headroom=0.0, stall_factor=factor)
    policy = JustEnoughPolicy(status, TrueLength(), config)
    cluster = make_cluster(make_view("H800"), make_view("A800"))
    # edge: H800 takes 0.1 s prefill + 2 s decode of its 2.4 s -> 0.3 s of slack to spare
    assert policy.choose(make_request(2.4, rid="edge"), cluster, 0.0) == "H800"
    assert policy.budgets.shortest_stall_s("H800") == pytest.approx(0.3, abs=0.01)

    def h800_harmless(prompt: int) -> bool:
        request = make_request(60.0, prompt=prompt, rid=f"p{prompt}")
        scored = policy.placer.score(request, cluster.instances, cluster, 0.0).place(20)[1]
        return rows_by_id(scored)["H800"].harmless

    assert all(h800_harmless(n) for n in harmless_prompts)
    assert not any(h800_harmless(n) for n in harmful_prompts)


def test_stall_factor_reaches_the_policy_and_the_watchdog():
    options = RoutingOptions(goodserve=GoodServeConfig(stall_factor=0.7))
    stack = build_routing(PolicyKind.GOODSERVE, options)
    assert stack.policy.config.stall_factor == 0.7
    assert stack.watchdog.config.stall_factor == 0.7


@pytest.mark.parametrize("kind, trained, expected", [
    (PolicyKind.GOODSERVE, True, TRAINED_PREDICTOR_STALL_FACTOR),
    (PolicyKind.GOODSERVE_NO_MIGRATION, True, TRAINED_PREDICTOR_STALL_FACTOR),
    (PolicyKind.GOODSERVE, False, DEFAULT_STALL_FACTOR),  # running history
    (PolicyKind.GOODSERVE_HISTORY, True, DEFAULT_STALL_FACTOR),  # the ablation's history
    (PolicyKind.GOODSERVE_EXACT, True, DEFAULT_STALL_FACTOR),  # exact lengths
])
def test_stall_factor_defaults_per_length_estimator(kind, trained, expected):
    """Unset, the charge suits the estimator: lighter for a trained predictor, whose
    "late" requests are often over-predicted, full for exact or label-free lengths."""
    assert TRAINED_PREDICTOR_STALL_FACTOR < DEFAULT_STALL_FACTOR
    options = RoutingOptions(length_factory=trained_length if trained else None)
    stack = build_routing(kind, options)
    assert stack.policy.config.stall_factor == expected
    assert stack.watchdog.config.stall_factor == expected
    explicit = build_routing(kind, replace(options, goodserve=GoodServeConfig(stall_factor=0.8)))
    assert explicit.policy.config.stall_factor == explicit.watchdog.config.stall_factor == 0.8


def test_reports_name_the_stall_factor_they_ran_with():
    assert stall_factor_label(0.7) == "0.7"
    assert stall_factor_label(None) == (
        f"{TRAINED_PREDICTOR_STALL_FACTOR:g} with a trained predictor, "
        f"{DEFAULT_STALL_FACTOR:g} with exact or label-free lengths")


def test_stall_factor_must_not_be_negative():
    with pytest.raises(ValueError, match="stall_factor"):
        GoodServeConfig(stall_factor=-0.5)


def test_headroom_keeps_slack_in_reserve():
    status = StatusEstimator(alpha=1.0)
    for gpu, d in (("H800", 0.01), ("A800", 0.015), ("A40", 0.04)):
        set_speed(status, gpu, d)
    cluster = make_cluster(make_view("H800"), make_view("A800"), make_view("A40"))
    tight = JustEnoughPolicy(status, TrueLength(), GoodServeConfig(headroom=0.0))
    spare = JustEnoughPolicy(status, TrueLength(), GoodServeConfig(headroom=0.5))
    # A40 needs 8.1 s: feasible for a 9 s SLO, but not with 50% of T in reserve (12.15 s)
    assert tight.choose(make_request(9.0, rid="a"), cluster, 0.0) == "A40"
    assert spare.choose(make_request(9.0, rid="b"), cluster, 0.0) == "A800"
    with pytest.raises(ValueError, match="headroom"):
        GoodServeConfig(headroom=-0.1)


@pytest.mark.parametrize("kind, trained, expected", [
    (PolicyKind.GOODSERVE, True, True),  # a trained predictor
    (PolicyKind.GOODSERVE_EXACT, True, True),  # exact lengths
    (PolicyKind.GOODSERVE, False, False),  # the label-free running history
    (PolicyKind.GOODSERVE_HISTORY, True, False),
])
def test_triage_defaults_per_length_estimator(kind, trained, expected):
    """Unset, triage is on where "late even with an optimistic length" is trustworthy
    and off with the label-free history, whose pessimism under steady overload made
    the most backlogged instance a sink that filled every instance in turn."""
    options = RoutingOptions(length_factory=trained_length if trained else None)
    stack = build_routing(kind, options)
    assert stack.policy.config.triage is expected and stack.watchdog.config.triage is expected
    forced = build_routing(kind, replace(options, goodserve=GoodServeConfig(triage=True)))
    assert forced.policy.config.triage is True


def test_session_length_variant_is_label_free():
    """`goodserve-session-lengths` predicts from sessions' own steps; like the running
    history it learns from finishes alone, so triage stays off below long contexts."""
    from app.routing.session_length import SessionHistoryLength

    policy = build_routing(PolicyKind.GOODSERVE_SESSION_LENGTHS).policy
    assert isinstance(policy.length, SessionHistoryLength)
    assert policy.config.triage is False
    assert policy.triages(RouteRequest("r", 0.0, 1.0, 100_000))
    assert not policy.triages(RouteRequest("r", 0.0, 1.0, 100))


def test_long_context_estimates_follow_the_hardware_model_and_leave_short_ones_alone():
    """At a 1k-token span the per-token figures stand; on a 60k context the scaled
    prefill (a full recompute) and decode track the hardware model's own times, where
    the unscaled figures are about 2x and 1.4x short."""
    spec = SPECS["A800"]
    prior = catalog_prior(spec)

    def scorer(request: RouteRequest, hit_blocks: int = 0,
               long_context: bool = True) -> InstanceScorer:
        cluster = make_cluster(make_view("A800"), hits={"A800": hit_blocks})
        return InstanceScorer.build(request, cluster.instances, cluster, StatusEstimator(),
                                    0.0, None, 1.0, long_context)

    short = scorer(RouteRequest("s", 0.0, 10.0, num_prompt_tokens=900))
    assert short.ahead_s[0] == 900 * prior.prefill_s_per_token
    assert short.decode_s[0] == prior.decode_s_per_token
    context = 60_000
    ttft, tpot = spec.solo_phases_s(context, 2)
    request = RouteRequest("l", 0.0, 100.0, num_prompt_tokens=context)
    assert scorer(request).ahead_s[0] == pytest.approx(ttft, rel=0.1)
    assert scorer(request, long_context=False).ahead_s[0] < 0.6 * ttft
    assert scorer(request).decode_s[0] == pytest.approx(spec.decode_time_per_token_s(context),
                                                        rel=0.05)
    # appended tokens over a cached context attend to all of it
    hit_blocks = (context - 912) // 16
    hit = hit_blocks * 16
    chunk = spec.solo_phases_s(context, 2, num_cached_tokens=hit)[0]
    cached = replace(request, block_hashes=tuple(range(hit_blocks)))
    assert scorer(cached, hit_blocks).ahead_s[0] == pytest.approx(chunk, rel=0.15)


def test_paper_variant_turns_every_addition_off_and_keeps_the_papers_knobs():
    config = GoodServeConfig(alpha=0.3, tau_iterations=40, variant=JustEnoughVariant.LEAST_SLACK,
                             admission_control=True)
    paper = config.paper_algorithm()
    assert paper.variant is JustEnoughVariant.WEAKEST  # the paper's rule
    assert paper.headroom == 0.0
    assert not paper.admission_control
    assert paper.cache_affinity_tokens is None
    assert not paper.long_context_estimates
    assert paper.triage is False and paper.triage_min_context_tokens is None
    assert not paper.protect_admitted  # do-no-harm budgets
    assert paper.confidence_quantile == 0.5  # the point estimate alone
    assert not paper.fast_while_cold
    assert paper.reservation_quantile == 1.0
    assert paper.budget_refresh_iterations == 40  # the watchdog runs every tau
    assert paper.reestimate is LengthReestimate.REPREDICT
    assert (paper.migration_margin, paper.migration_cost_quantile) == (0.0, 1.0)
    assert (paper.alpha, paper.tau_iterations, paper.max_migrations_per_request) == (0.3, 40, 1)

    stack = build_routing("goodserve-paper", RoutingOptions(goodserve=config))
    assert isinstance(stack.watchdog, SloWatchdog)
    assert isinstance(stack.policy.length, RunningHistoryLength)  # the options' estimator
    expected = paper.for_length(stack.policy.length)
    assert stack.policy.config == expected and stack.watchdog.config == expected
    assert stack.watchdog.check_period_iterations == 40
