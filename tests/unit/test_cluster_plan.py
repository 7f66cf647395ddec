"""SARA's plan for a fixed cluster: stage targets from deadlines, every layout scored,
the promise at a rate; and the uncached length a controller measures."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.experiments.autoscale import observed
from app.planning.allocator import LengthMoments
from app.planning.cluster_plan import (
    PREFILL_SHARES,
    UNIFIED,
    Layout,
    plan_cluster,
    promised_attainment,
    unified_rps,
)
from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams
from app.planning.queues import Method
from app.planning.split import EngineKind, stage_slos
from app.workloads.slo import reference_instance
from app.workloads.workload import Workload, WorkloadRequest

pytestmark = pytest.mark.unit

LLAMA = ModelParams.named("llama-3.1-8b")
A800 = reference_instance("llama-3.1-8b", "A800")
CHAT = LengthMoments(LengthDist.from_moments(600.0, 1.2), 250.0)
AGENT = LengthMoments(LengthDist.from_moments(12000.0, 1.0), 300.0,
                      uncached_len=LengthDist.from_moments(800.0, 1.5))
PAPER = {EngineKind("H800"): 1, EngineKind("A800"): 1, EngineKind("A40"): 1,
         EngineKind("V100", 2): 1}


def _mean_request_budget(slo, workload: LengthMoments) -> float:
    num_later = round(workload.mean_output_len) - 1
    return slo.ttft_s + num_later * slo.tpot_s


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_every_slack_share_spends_exactly_the_mean_requests_deadline(share):
    scale = 2.5
    prefill_s, tpot_s = A800.solo_phases_s(600, 250)
    deadline = scale * (prefill_s + 249 * tpot_s)
    slo = stage_slos(A800, CHAT, scale, prefill_share=share)
    assert _mean_request_budget(slo, CHAT) == pytest.approx(deadline, rel=1e-9)
    assert slo.ttft_s >= prefill_s and slo.tpot_s >= tpot_s
    assert slo.kv_s == slo.ttft_s


def test_the_proportional_split_scales_each_solo_phase():
    prefill_s, tpot_s = A800.solo_phases_s(600, 250)
    slo = stage_slos(A800, CHAT, 2.0)
    assert slo.ttft_s == pytest.approx(2 * prefill_s)
    assert slo.tpot_s == pytest.approx(2 * tpot_s)
    first_token_heavy = stage_slos(A800, CHAT, 2.0, prefill_share=0.5)
    assert first_token_heavy.ttft_s > 10 * slo.ttft_s > 0
    assert first_token_heavy.tpot_s < slo.tpot_s
    with pytest.raises(ValueError, match="prefill share"):
        stage_slos(A800, CHAT, 2.0, prefill_share=1.5)


def test_an_agent_steps_prefill_target_counts_only_its_uncached_tokens():
    whole = LengthMoments(AGENT.input_len, AGENT.mean_output_len)
    cached, uncached = stage_slos(A800, AGENT, 1.0), stage_slos(A800, whole, 1.0)
    assert cached.ttft_s < uncached.ttft_s / 5
    assert AGENT.prefill_len.mean == 800.0 and whole.prefill_len.mean == 12000.0


@pytest.fixture(scope="module")
def paper_chat_plan():
    """The paper cluster's plan for chat at scale 2 over a 25 Gbps link: several tests
    read it, and it takes seconds to score."""
    return plan_cluster(PAPER, LLAMA, CHAT, A800, 2.0, kv_link_gbps=25.0)


def test_the_plan_scores_unified_and_every_split_best_first(paper_chat_plan):
    plan = paper_chat_plan
    labels = [e.layout.label for e in plan.estimates]
    assert len(labels) == len(set(labels)) == 1 + (2 ** 4 - 2)
    assert UNIFIED in labels and "A40+A800+V100x2" in labels
    goodputs = [e.goodput_rps for e in plan.estimates]
    assert goodputs == sorted(goodputs, reverse=True)
    assert plan.recommended is plan.estimates[0]
    unified = plan.estimate(UNIFIED)
    engines = [unified_rps(c, LLAMA, CHAT, unified.slo) for c in unified.capacities]
    assert unified.goodput_rps == pytest.approx(sum(engines))
    for c, rps in zip(unified.capacities, engines, strict=True):
        assert rps <= min(c.prefill_rps, c.decode_rps)
    split = plan.estimate("H800")
    stages = {"prefill": split.capacities[2].prefill_rps,  # kinds sorted: A40, A800, H800, V100
              "decode": sum(c.decode_rps for i, c in enumerate(split.capacities) if i != 2)}
    assert split.goodput_rps <= min(stages.values()) + 1e-9


def test_searching_the_slack_share_never_scores_a_layout_below_the_proportional_split(
        paper_chat_plan):
    proportional = plan_cluster(PAPER, LLAMA, CHAT, A800, 2.0, 25.0, shares=(None,))
    searched = paper_chat_plan
    for estimate in proportional.estimates:
        assert searched.estimate(estimate.layout.label).goodput_rps >= estimate.goodput_rps
    # proportional targets leave a short prompt's first token almost no slack: the
    # A800 reference itself could prefill under 1 req/s, the A40 and V100s nothing
    before = {c.kind.name: c.prefill_rps for c in proportional.estimate(UNIFIED).capacities}
    after = {c.kind.name: c.prefill_rps for c in searched.estimate(UNIFIED).capacities}
    assert before["A800"] < 1.0 and before["A40"] == before["V100x2"] == 0.0
    assert min(after.values()) > 5 * before["A800"]
    # so the V100s add to unified's score only once the share is searched
    v100 = {estimate.prefill_share: unified_rps(estimate.capacities[-1], LLAMA, CHAT,
                                                 estimate.slo)
            for estimate in (proportional.estimate(UNIFIED), searched.estimate(UNIFIED))}
    assert v100[None] == 0.0 and min(v100.values()) == 0.0 < max(v100.values())
    assert searched.estimate(UNIFIED).goodput_rps > proportional.estimate(
        UNIFIED).goodput_rps
    assert len(PREFILL_SHARES) > 1 and None in PREFILL_SHARES


def test_a_unified_engine_overlaps_the_stages_and_prompts_stretch_its_decode_steps():
    """Chunked prefill carries the decode tokens in the prompts' iterations, so a
    unified engine is not charged each stage's whole time in turn; but the more of its
    time goes to prompts, the fewer decode steps fit a TPOT target."""
    plan = plan_cluster(PAPER, LLAMA, AGENT, A800, 2.0, kv_link_gbps=25.0)
    unified = plan.estimate(UNIFIED)
    h800 = next(c for c in unified.capacities if c.kind.name == "H800")
    rps = unified_rps(h800, LLAMA, AGENT, unified.slo)
    time_shared = 1 / (1 / h800.prefill_rps + 1 / h800.decode_rps)
    assert time_shared < rps <= h800.decode_rps
    at = promised_attainment(plan, unified, LLAMA, AGENT, 0.5 * unified.goodput_rps, 25.0)
    beyond = promised_attainment(plan, unified, LLAMA, AGENT, 1.5 * unified.goodput_rps, 25.0)
    assert at > unified.slo.p_slo ** 2 and beyond < at
    # a prompt-heavy load leaves too little of the engine for the decode steps
    heavy = LengthMoments(LengthDist.from_moments(12000.0, 1.0), 300.0)
    slo = stage_slos(A800, heavy, 2.0, prefill_share=0.5)
    whole = plan_cluster({EngineKind("A800"): 1}, LLAMA, heavy, A800, 2.0, None,
                         shares=(0.5,)).recommended
    (a800,) = whole.capacities
    assert unified_rps(a800, LLAMA, heavy, slo) < min(a800.prefill_rps, a800.decode_rps)


def test_one_engine_can_only_run_unified_and_an_empty_inventory_is_an_error():
    plan = plan_cluster({EngineKind("A800"): 1}, LLAMA, CHAT, A800, 2.0, None)
    assert [e.layout.mode for e in plan.estimates] == [UNIFIED]
    with pytest.raises(ValueError, match="no engine"):
        plan_cluster({}, LLAMA, CHAT, A800, 2.0, None)


@pytest.mark.parametrize("label", [UNIFIED, "H800"])
def test_the_promise_falls_as_the_rate_rises_and_vanishes_past_capacity(label,
                                                                        paper_chat_plan):
    plan = paper_chat_plan
    estimate = plan.estimate(label)
    rates = [f * estimate.goodput_rps for f in (0.05, 0.5, 1.5)] + [
        100 * estimate.goodput_rps]
    promises = [promised_attainment(plan, estimate, LLAMA, CHAT, r, 25.0) for r in rates]
    assert all(0 <= p <= 1 for p in promises)
    assert promises == sorted(promises, reverse=True)
    assert promises[0] > 0.9 and promises[-1] == 0.0
    with pytest.raises(ValueError, match="rate"):
        promised_attainment(plan, estimate, LLAMA, CHAT, 0.0, 25.0)


def test_layout_labels_name_the_prefill_pool():
    assert Layout().label == UNIFIED and Layout().mode == UNIFIED
    layout = Layout((("A800", 2), ("H800", 1)))
    assert layout.label == "2xA800+H800" and layout.mode == "disaggregated"
    assert layout.prefill_count(EngineKind("A800")) == 2
    assert layout.prefill_count(EngineKind("A40")) == 0


def test_the_tpot_cdf_inverts_the_tpot_quantiles_and_is_zero_when_unstable():
    stage = DecodeStage(LLAMA, DeviceParams.named("A800"), CHAT.input_len, CHAT.mean_output_len)
    rate = 5.0
    quantiles = stage.tpot_quantiles(1, 64, np.array([0.5, 0.9]), Method.REFINED, rate)
    for p, q in zip((0.5, 0.9), quantiles, strict=True):
        assert stage.tpot_cdf(1, 64, float(q), rate) == pytest.approx(p, abs=0.01)
    assert stage.tpot_cdf(1, 64, 10.0, 1e4) == 0.0


def _request(i: int, prompt: int, appended: int | None) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", float(i), prompt, 10, num_appended_tokens=appended)


def test_observed_moments_count_an_agent_steps_appended_tokens_as_uncached():
    steps = Workload((_request(0, 1000, None), _request(1, 1200, 200),
                      _request(2, 1500, 300)), duration_s=3.0)
    seen = observed(steps)
    assert seen.mean_input_len == pytest.approx(3700 / 3)
    assert seen.mean_uncached_len == pytest.approx(1500 / 3)
    assert seen.workload.prefill_len.mean == pytest.approx(500.0)
    plain = observed(Workload((_request(0, 100, None), _request(1, 300, None)),
                              duration_s=2.0))
    assert plain.mean_uncached_len is None and plain.workload.uncached_len is None
    assert math.isclose(plain.workload.prefill_len.mean, 200.0)


def test_whole_kind_layouts_give_each_gpu_kind_one_role():
    from app.experiments.plan_check import layouts_to_simulate, whole_kind_layouts

    sixteen = {EngineKind("H800"): 4, EngineKind("A800"): 4, EngineKind("A40"): 4,
               EngineKind("V100", 2): 4}
    plan = plan_cluster(sixteen, LLAMA, CHAT, A800, 2.0, 25.0, shares=(0.5,))
    assert len(plan.estimates) == 1 + 5 ** 4 - 2  # unified and every split
    layouts = whole_kind_layouts(plan)
    assert len(layouts) == 1 + 2 ** 4 - 2 and layouts[0].mode == UNIFIED
    for layout in layouts[1:]:
        assert all(n == 4 for _, n in layout.prefill)
    assert Layout((("A40", 4), ("H800", 4))) in layouts
    assert layouts_to_simulate(plan) == layouts + [plan.recommended.layout]
    four = plan_cluster(PAPER, LLAMA, CHAT, A800, 2.0, 25.0, shares=(0.5,))
    assert layouts_to_simulate(four) == [e.layout for e in four.estimates]  # all 15
