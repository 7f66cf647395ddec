"""Stage capacities of the served system (`app/planning/served.py`)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from app.hardware.specs import make_instance
from app.planning.allocator import LengthMoments
from app.planning.distributions import LengthDist
from app.planning.queues import MgkQueue
from app.planning.served import (
    DECODE,
    PREFILL,
    UNIFIED,
    ContextReuse,
    EngineModel,
    StageBudgets,
    TrafficSample,
    cache_time_s,
    prefix_hits,
)
from app.planning.split import EngineKind
from app.workloads.sessions import SessionTimeline
from app.workloads.workload import WorkloadRequest

pytestmark = pytest.mark.unit

MODEL = "llama-3.1-8b"
REFERENCE = make_instance("A800", MODEL)


def _sample(prompt: int = 800, output: int = 200, cached: int = 0, n: int = 64,
            scale: float = 3.0, held: float = 0.0) -> TrafficSample:
    rng = np.random.default_rng(0)
    prompts = rng.integers(prompt // 2, prompt * 3 // 2, n)
    outputs = rng.integers(output // 2, output * 3 // 2, n)
    return TrafficSample.from_lengths(prompts, np.minimum(cached, prompts - 1), outputs,
                                      REFERENCE, scale, held)


def _model(sample: TrafficSample, role: str, gpu: str = "A800",
           max_num_seqs: int | None = None) -> EngineModel:
    share = {PREFILL: 1.0, DECODE: 0.0, UNIFIED: 0.5}[role]
    return EngineModel.for_kind(EngineKind(gpu, 1, max_num_seqs), MODEL, sample,
                                StageBudgets.split(sample, REFERENCE, share))


def test_prefix_hits_count_blocks_seen_before_and_an_agent_step_s_context():
    def request(i: int, blocks: tuple[int, ...], prompt: int, appended: int | None = None):
        return WorkloadRequest(f"r{i}", 0.0, prompt, 10, blocks, 16,
                               num_appended_tokens=appended)

    hits = prefix_hits([
        request(0, (1, 2, 3), 50),  # new: nothing cached
        request(1, (1, 2, 3), 50),  # the same prompt: its 3 blocks (48 tokens)
        request(2, (1, 2), 32),  # whole prompt seen: all but the last token
        request(3, (1, 9), 40),  # one leading block shared
        request(4, (), 5000, appended=200),  # an agent step extends 4,800 cached tokens
        # a step with block hashes: its previous prompt (3 blocks) is cached, not the
        # previous output (block 7), which an engine never cached as a prompt
        request(5, (1, 2, 3, 7, 8), 90, appended=20),
    ])
    assert hits == [0, 48, 31, 16, 4800, 48]


def test_the_cache_time_is_when_the_prompts_touched_within_it_fill_the_cache():
    prompts = np.full(4, 1000)
    never_back = np.full(4, np.inf)  # 1 step/s of 1,000 tokens: 1,000 T tokens held
    assert cache_time_s(prompts, never_back, 1.0, 5000) == pytest.approx(5.0, rel=1e-6)
    back_soon = np.full(4, 2.0)  # each prompt reused after 2 s: at most 2,000 held
    assert cache_time_s(prompts, back_soon, 1.0, 5000) == math.inf
    mixed = np.array([2.0, 2.0, np.inf, np.inf])  # 1,000 + 500 T = 5,000
    assert cache_time_s(prompts, mixed, 1.0, 5000) == pytest.approx(8.0, rel=1e-6)


def test_idle_gaps_run_from_the_parent_s_last_touch_to_the_child_s_arrival():
    reuse = ContextReuse(parent=np.array([-1, 0, 1, 1]), wait_s=np.array([0.0, 3.0, 5.0, 1.0]),
                         shared_tokens=np.zeros(4))
    before, after = reuse.idle_gaps_s(busy_s=np.array([0.5, 1.0, 2.0, 2.0]))
    assert np.isnan(before[0]) and before[1:].tolist() == [3.5, 6.0, 2.0]
    # step 1 is reused by two children: its prompt is touched again after the sooner
    assert after.tolist() == [3.5, 2.0, math.inf, math.inf]


def test_a_step_waits_for_its_tool_or_its_own_arrival_whichever_comes_later():
    """As `StepReleases` issues steps: step 1 is ready at 13 s but arrives at 15 s;
    step 2 arrived long before it is ready; step 3 joins both branches."""
    from app.workloads.sessions import AgentSession, AgentStep, sessions_workload

    def step(step_id: str, wait_for: tuple[str, ...], tool_wait_s: float,
             arrival_offset_s: float = 0.0) -> AgentStep:
        return AgentStep(step_id, wait_for, tool_wait_s, 100, 10, 5, (), 16, arrival_offset_s)

    session = AgentSession("a", 10.0, (
        step("0", (), 0.0), step("1", ("0",), 2.0, 5.0), step("2", ("0",), 3.0, 1.0),
        step("3", ("1", "2"), 1.0)))
    workload = sessions_workload([session], 1.0, "a")
    timeline = SessionTimeline.of(workload, [1.0, 1.0, 2.0, 1.0])
    # 0: 10 -> 11; 1: max(11 + 2, 15) -> 16; 2: max(11 + 3, 11) -> 16; 3: 16 + 1 -> 18
    assert timeline.end_s.tolist() == [11.0, 16.0, 16.0, 18.0]
    assert timeline.wait_s.tolist() == [0.0, 4.0, 3.0, 1.0]
    reuse = ContextReuse.of(workload, np.zeros(4, dtype=np.int64), np.array([1.0, 1.0, 2.0, 1.0]))
    assert reuse.wait_s.tolist() == [0.0, 4.0, 3.0, 1.0]


def test_a_prefill_engine_loses_session_contexts_when_its_cache_overflows():
    """Chat sessions on one H800 prefill engine: at a light rate every step finds its
    context cached; at a rate whose parked contexts overflow the KV, steps recompute
    theirs and the engine carries fewer steps than the never-evicting count says."""
    from app.workloads.sessions import SessionPreset, preset_workload
    from app.workloads.workload import Arrivals, SyntheticArrivals

    workload = preset_workload(SessionPreset.CHAT_AGENT,
                               SyntheticArrivals(Arrivals.POISSON, 1.0, 300.0), 131072, 7)
    sample = TrafficSample.from_workload(workload, REFERENCE, 3.0)
    assert sample.reuse is not None and np.sum(sample.reuse.parent >= 0) > 0
    model = _model(sample, PREFILL, gpu="H800")
    busy = model._remote_decode_s
    light, _, _ = model._prefill_at(0.01, busy)
    heavy, heavy_work, _ = model._prefill_at(5.0, busy)
    assert np.array_equal(light, sample.cached_tokens)
    assert heavy.sum() < 0.8 * sample.cached_tokens.sum()
    never = replace(sample, reuse=None)
    assert model.rate(PREFILL) < 0.8 * _model(never, PREFILL, gpu="H800").rate(PREFILL)
    assert heavy_work.mean() > model._prefill_costs(sample.cached_tokens)[0].mean()


def test_the_lattice_wait_cdf_agrees_with_the_pointwise_one():
    queue = MgkQueue(30.0, 2, LengthDist.lognormal(0.05, 1.5))
    points = np.array([-1.0, 0.0, 0.01, 0.05, 0.2, 0.6])
    many = queue.wait_cdf_many(points)
    assert many[0] == 0.0 and many[1] == pytest.approx(1 - queue.wait_probability)
    for t, value in zip(points[2:], many[2:], strict=True):
        assert value == pytest.approx(queue.wait_cdf(t), abs=2e-3)


def test_decode_occupancy_obeys_little_s_law_and_the_rate_stops_at_the_slots():
    model = _model(_sample(), DECODE)
    rate = model.rate(DECODE)
    n, step = model._occupancy(rate)
    steps = float(np.mean(model._decode_steps))
    assert n == pytest.approx(rate * steps * step, rel=1e-4)
    assert n <= model._slots
    capped = _model(_sample(), DECODE, max_num_seqs=16)
    assert capped._slots == 16
    assert capped.rate(DECODE) < rate
    assert capped._occupancy(1.01 * capped._decode_ceiling()) is None


def test_long_contexts_overflow_the_kv_before_the_mean_occupancy_fills_it():
    """Contexts of 30k-90k tokens on an A40 (219k tokens of KV, three mean slots): with
    1.5 others running on average the KV often cannot hold a request, so fewer meet
    their budgets than the mean occupancy says; short prompts always fit."""
    long = _model(_sample(prompt=60000, output=300), DECODE, gpu="A40")
    assert long._slots == 3
    room = long._kv_room(1.5)
    assert 0.3 < room.mean() < 0.95
    assert room[np.argmax(long.sample.prompt_tokens)] < room[np.argmin(long.sample.prompt_tokens)]
    assert long._kv_room(0.0).min() == 1.0  # alone, each fits
    short = _model(_sample(), DECODE, gpu="A40")
    assert short._kv_room(10.0).min() > 0.999


def test_context_that_sessions_park_on_a_decoder_takes_its_slots():
    long_context = _sample(prompt=60_000, output=300)
    free = _model(long_context, DECODE)
    parked = _model(_sample(prompt=60_000, output=300,
                            held=0.5 * REFERENCE.kv_capacity_tokens), DECODE)
    assert parked._slots < free._slots <= 256
    assert parked.rate(DECODE) < free.rate(DECODE)


def test_a_stronger_gpu_decodes_more_and_attention_grows_with_the_context():
    short, long = _sample(prompt=500), _sample(prompt=20_000)
    a800, h800 = _model(short, DECODE), _model(short, DECODE, gpu="H800")
    assert h800.rate(DECODE) > a800.rate(DECODE)
    assert a800.step_s(64) > a800.step_s(8)
    assert _model(long, DECODE).step_s(8) > a800.step_s(8)


def test_prefill_carries_more_with_cached_prefixes_and_longer_deadlines():
    base = _model(_sample(prompt=4000), PREFILL)
    cached = _model(_sample(prompt=4000, cached=3000), PREFILL)
    loose = _model(_sample(prompt=4000, scale=6.0), PREFILL)
    rate = base.rate(PREFILL)
    assert 0 < rate < cached.rate(PREFILL)
    assert rate < loose.rate(PREFILL)
    assert base.prefill_attainment(0.5 * rate) >= base.prefill_attainment(rate) >= 0.9
    assert base.prefill_attainment(1.2 * rate) < 0.9
    assert base.rate(PREFILL, 2) > 2 * rate  # two engines share one queue


def test_each_request_s_own_budget_counts_in_the_prefill_queue():
    """Requests with long answers may wait long for their first token: giving half the
    requests a far deadline lets the queue run hotter than when every request has the
    tight one."""
    tight = _sample(prompt=4000)
    mixed = TrafficSample(tight.prompt_tokens, tight.cached_tokens, tight.output_tokens,
                          np.where(np.arange(len(tight.deadline_s)) % 2 == 0,
                                   tight.deadline_s * 5, tight.deadline_s))
    assert _model(mixed, PREFILL).rate(PREFILL) > _model(tight, PREFILL).rate(PREFILL)


def test_a_unified_engine_carries_less_than_its_decode_alone():
    sample = _sample(prompt=2000)
    unified, decode = _model(sample, UNIFIED), _model(sample, DECODE)
    assert 0 < unified.rate(UNIFIED) < decode.rate(DECODE)


def test_a_sample_from_moments_keeps_the_means_and_the_cached_share():
    moments = LengthMoments(LengthDist.lognormal(2000, 1.5), 250.0,
                            uncached_len=LengthDist.lognormal(200, 1.0))
    sample = TrafficSample.from_moments(moments, REFERENCE, 2.0, points=24)
    assert len(sample.prompt_tokens) == 24 * 24
    assert np.mean(sample.output_tokens) == pytest.approx(250, rel=0.1)
    assert np.mean(sample.prompt_tokens) == pytest.approx(2000, rel=0.25)
    share = sample.cached_tokens.sum() / sample.prompt_tokens.sum()
    assert share == pytest.approx(0.9, abs=0.01)


def test_a_bad_sample_is_refused():
    with pytest.raises(ValueError, match="cached tokens"):
        TrafficSample(np.array([10]), np.array([10]), np.array([5]), np.array([1.0]))
    with pytest.raises(ValueError, match="at least one request"):
        TrafficSample(np.array([]), np.array([]), np.array([]), np.array([]))
    with pytest.raises(ValueError, match="prefill share"):
        StageBudgets.split(_sample(), REFERENCE, 1.5)


def test_the_inventory_sizer_sizes_from_the_served_models_when_given_them():
    from app.planning.inventory import InventorySizer, PoolLimits, Stock
    from app.planning.params import ModelParams, SloTargets
    from app.planning.served import ServedCapacity
    from app.planning.split import EngineKind

    moments = LengthMoments(LengthDist.lognormal(1500, 1.2), 200.0)
    served = ServedCapacity.from_moments(MODEL, moments, REFERENCE, 3.0)
    a800, a40 = EngineKind("A800"), EngineKind("A40")
    stock = [Stock(a800, 8, 2.0), Stock(a40, 8, 0.8)]
    sizer = InventorySizer(ModelParams.named(MODEL), moments, SloTargets(1.0, 1.0, 0.05, 0.9),
                           stock, factors={"decode:A800": 0.5}, served=served)
    assert sizer.rate_of(DECODE, a800, 3) == pytest.approx(3 * 0.5 * served.rate(DECODE, a800, 1))
    assert sizer.rate_of(PREFILL, a40, 2) == served.rate(PREFILL, a40, 2)
    rate = 0.9 * sizer.rate_of(DECODE, a800, 2) + 0.9 * sizer.rate_of(DECODE, a40, 1)
    targets = sizer.size(rate, (PREFILL, DECODE), PoolLimits())
    assert targets.meets_slo
    for role in (PREFILL, DECODE):
        assert sizer.carried(role, targets.engines[role]) >= rate


def test_a_controller_on_the_served_models_spreads_parked_context_over_unified_engines():
    from app.control.controller import CapacityModel
    from app.experiments.autoscale import DEFAULT_CONFIG, load_autoscale_config
    from app.planning.pools import Observation

    config = load_autoscale_config(DEFAULT_CONFIG).model_copy(update={"mode": "unified"})
    settings = config.controller.model_copy(update={
        "capacity_model": CapacityModel.SERVED, "capacity_factors": {}}).settings(
        config.model, config.roles)
    observation = Observation(rate_rps=5.0, mean_input_len=40_000, cv_input_len=0.5,
                              mean_output_len=300, held_kv_tokens=800_000)
    kind = settings.stock[1].kind  # A800
    alone = settings.sizer(observation, per_engine_share=1_000_000)
    crowded = settings.sizer(observation, per_engine_share=2)
    assert alone.served is not None and crowded.served is not None
    assert crowded.rate_of(UNIFIED, kind, 1) < alone.rate_of(UNIFIED, kind, 1)
    sara = config.controller.settings(config.model, config.roles).sizer(observation)
    assert sara.served is None
    disaggregated = load_autoscale_config(DEFAULT_CONFIG)  # decoders free it after each step
    pd = disaggregated.controller.model_copy(update={
        "capacity_model": CapacityModel.SERVED, "capacity_factors": {}}).settings(
        disaggregated.model, disaggregated.roles)
    assert not pd.parks_context and settings.parks_context
    assert pd.sizer(observation, 2).rate_of(DECODE, kind, 1) == pytest.approx(
        pd.sizer(observation, 1_000_000).rate_of(DECODE, kind, 1))
