"""Engine backends without Ray: the sim backend, the vLLM stats recorder, the prefix
index, and the status estimator learning p_g from what engines report."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from app.engines.config import EngineBackend, EngineConfig, SchedulerConfig
from app.engines.factory import make_backend
from app.engines.messages import EngineRequest, EngineStatus, PrefillTotals, SamplingSpec
from app.engines.prefix import PrefixCache, prefix_block_hashes
from app.engines.sim import SimBackend
from app.engines.vllm import VllmBackend, VllmStatsRecorder
from app.routing.status import StatusEstimator
from app.routing.view import StepReport
from tests.unit.routing_utils import make_view

pytestmark = pytest.mark.unit

SIM_CONFIG = EngineConfig(gpu_type="A800", backend=EngineBackend.SIM, time_scale=0.01)


def request(rid: str, prompt: int = 100, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(rid, list(range(1, prompt + 1)), SamplingSpec(max_tokens=max_tokens))


def make_status(prefill: PrefillTotals, engine_id: str = "A40", running: int = 1) -> EngineStatus:
    return EngineStatus(engine_id, engine_id, "unified", 0, running, (), (), 0, 10, 0,
                        prefill=prefill)


# ---- prefix index ------------------------------------------------------------------
def test_block_hashes_are_chained_so_equal_hash_means_equal_prefix():
    a = prefix_block_hashes(list(range(48)))
    b = prefix_block_hashes(list(range(16)) + [999] + list(range(17, 48)))
    assert len(a) == 3 and len(prefix_block_hashes(list(range(47)))) == 2  # full blocks only
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # a change poisons what follows


def test_prefix_cache_peek_leaves_lru_order_and_match_refreshes_it():
    cache = PrefixCache(capacity_tokens=32)
    cache.insert([1, 2], block_size=16)
    assert cache.peek([1, 2, 3]) == 2
    cache.insert([3], block_size=16)  # evicts the least recently used: 1
    assert 1 not in cache and cache.peek([2, 3]) == 2
    assert cache.match([2]) == 1  # touches 2, so 3 is now the oldest
    cache.insert([4], block_size=16)
    assert 3 not in cache and 2 in cache and cache.num_cached_tokens == 32


# ---- sim backend ---------------------------------------------------------------------
async def _collect(backend: SimBackend, req: EngineRequest) -> list:
    return [ev async for batch in backend.generate(req) for ev in batch]


def test_make_backend_picks_the_configured_backend():
    assert isinstance(make_backend("e0", SIM_CONFIG), SimBackend)


def test_sim_backend_streams_and_counts_its_prefill_work():
    async def run():
        backend = SimBackend("e0", SIM_CONFIG)
        try:
            events = await _collect(backend, request("r1", prompt=100, max_tokens=8))
            return events, backend.status()
        finally:
            await backend.shutdown()

    events, status = asyncio.run(run())
    assert [e.index for e in events] == list(range(8)) and events[-1].finish_reason == "length"
    assert status.num_finished == 1 and status.num_iterations == 8
    assert status.prefill.num_iterations == 1 and status.prefill.num_tokens == 100
    assert status.prefill.busy_s == status.recent_iteration_s[0] > 0  # the first step


def test_a_sim_backend_with_a_tokenizer_generates_words_that_re_tokenize_one_for_one(
        tiny_tokenizer_dir):
    """What a benchmark client counts is what was generated: the output decodes to text
    that the same tokenizer splits back into the same ids."""
    from transformers import AutoTokenizer

    from app.engines.sim import round_trip_vocabulary

    tiny_tokenizer = str(tiny_tokenizer_dir)
    config = SIM_CONFIG.model_copy(update={"tokenizer_path": tiny_tokenizer})

    async def run():
        backend = SimBackend("e0", config)
        try:
            return [await _collect(backend, request(f"r{i}", max_tokens=60)) for i in range(3)]
        finally:
            await backend.shutdown()

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer, local_files_only=True)
    vocabulary = set(round_trip_vocabulary(tiny_tokenizer))
    assert len(vocabulary) > 20
    for events in asyncio.run(run()):
        ids = [e.token_id for e in events]
        assert len(ids) == 60 and set(ids) <= vocabulary and len(set(ids)) > 10
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_a_tokenizer_with_no_word_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.engines.sim import round_trip_vocabulary

    chars = Tokenizer(models.WordLevel({c: i for i, c in enumerate("abc")}, unk_token="a"))
    chars.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=chars).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no token is a word"):
        round_trip_vocabulary(str(tmp_path))


def test_sim_backend_abort_ends_the_stream():
    async def run():
        backend = SimBackend("e0", SIM_CONFIG)
        try:
            task = asyncio.ensure_future(_collect(backend, request("long", max_tokens=5000)))
            await asyncio.sleep(0.05)
            assert await backend.abort("long")
            events = await asyncio.wait_for(task, 5.0)
            return events, await backend.abort("long"), backend.status()
        finally:
            await backend.shutdown()

    events, again, status = asyncio.run(run())
    assert 0 < len(events) < 5000 and not again
    assert status.num_running == 0 and status.num_waiting == 0


def test_sim_backend_in_priority_mode_serves_the_lower_priority_value_first():
    """One slot, busy: of two requests waiting, the later one with the lower priority
    value runs first."""
    config = SIM_CONFIG.model_copy(update={"scheduler": SchedulerConfig(
        max_num_seqs=1, scheduling_policy="priority")})

    async def run():
        backend = SimBackend("e0", config)
        try:
            busy = asyncio.ensure_future(_collect(backend, request("busy", max_tokens=200)))
            await asyncio.sleep(0.05)
            later = [asyncio.ensure_future(_collect(backend, replace(request(rid), priority=p)))
                     for rid, p in (("b", 5), ("c", 1))]
            return [await task for task in (busy, *later)]
        finally:
            await backend.shutdown()

    _, b, c = asyncio.run(run())
    assert c[-1].time_s <= b[0].time_s  # c ran to its end before b started


def test_vllm_engine_args_carry_the_scheduling_policy():
    config = EngineConfig(gpu_type="cpu", backend=EngineBackend.VLLM, model_path="/m",
                          scheduler=SchedulerConfig(scheduling_policy="priority"))
    assert VllmBackend("e0", config).engine_kwargs()["scheduling_policy"] == "priority"
    assert VllmBackend("e0", config.model_copy(update={"scheduler": SchedulerConfig()})
                       ).engine_kwargs()["scheduling_policy"] == "fcfs"


# ---- vLLM stats recorder (fed what vLLM's stat loggers receive) ----------------------
def iteration(computed: int = 0, ttfts: tuple = (), itls: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(
        prompt_token_stats=SimpleNamespace(computed=computed),
        time_to_first_tokens_iter=list(ttfts),
        inter_token_latencies_iter=list(itls),
        finished_requests=[],
    )


def test_vllm_recorder_counts_prefill_work_with_the_shortest_wait_as_duration():
    recorder = VllmStatsRecorder()
    recorder.record(None, iteration(computed=200, ttfts=(0.05,)))  # idle engine, one prompt
    recorder.record(None, iteration(itls=(0.01, 0.01)))  # decode only: no prefill
    recorder.record(None, iteration(computed=100, ttfts=(0.5,), itls=(0.02, 0.03)))  # mixed
    recorder.record(None, None)  # a step without outputs (e.g. a prefill chunk)
    assert recorder.prefill == PrefillTotals(2, 300, pytest.approx(0.07))
    assert recorder.num_iterations == 2  # decode latencies: iterations with ITLs
    # queue wait: time to first token beyond the iteration that computed the prompt
    assert recorder.recent_queue_wait_s == pytest.approx([0.0, 0.48])
    assert recorder.num_queue_wait_samples == 2


# ---- estimator: p_g from the status type ----------------------------------------------
def test_polled_prefill_counters_move_p_g_from_the_prior_to_the_measured_rate():
    estimator = StatusEstimator(alpha=0.2)
    view = make_view("A40", running=1)
    prior = estimator.estimate(view).prefill_s_per_token
    measured = 3 * prior
    estimator.on_status(make_status(PrefillTotals()), 0.0)
    assert estimator.estimate(view).prefill_s_per_token == prior
    for k in range(1, 30):  # one 500-token prefill iteration between polls
        estimator.on_status(make_status(PrefillTotals(k, 500 * k, 500 * k * measured)), k)
    assert estimator.estimate(view).prefill_s_per_token == pytest.approx(measured)


def test_an_engines_history_before_the_first_report_is_not_its_speed():
    """A router replica joining an engine that ran slow work for a long time (100x
    slower per token) learns the engine's current speed from the reports after, not
    from that history."""
    estimator = StatusEstimator(alpha=0.2)
    view = make_view("A40", running=1)
    fast_s_per_token = 1e-4
    lifetime = PrefillTotals(1000, 1000 * 500, 1000 * 500 * 100 * fast_s_per_token)
    estimator.on_status(make_status(lifetime), 0.0)
    estimator.on_status(make_status(PrefillTotals(
        lifetime.num_iterations + 1, lifetime.num_tokens + 500,
        lifetime.busy_s + 500 * fast_s_per_token)), 1.0)
    assert estimator.estimate(view).prefill_s_per_token == pytest.approx(fast_s_per_token)


def test_a_repeated_report_adds_nothing_and_a_restart_is_not_negative_work():
    estimator = StatusEstimator(alpha=0.5)
    view = make_view("A40", running=1)
    estimator.on_status(make_status(PrefillTotals()), 0.0)
    estimator.on_status(make_status(PrefillTotals(2, 1000, 0.2)), 1.0)
    first = estimator.estimate(view).prefill_s_per_token
    estimator.on_status(make_status(PrefillTotals(2, 1000, 0.2)), 2.0)
    estimator.on_status(make_status(PrefillTotals(0, 0, 0.0)), 3.0)  # engine restarted
    assert estimator.estimate(view).prefill_s_per_token == first == pytest.approx(2e-4)


def _step(duration_s: float, num_prefill: int, totals: PrefillTotals) -> StepReport:
    return StepReport("A40", 0.0, (duration_s,), num_prefill, 0, make_status(totals))


def test_polled_counters_learn_the_same_p_g_as_per_iteration_step_reports():
    """Parity: the live path (counters polled every few iterations) ends where the
    simulator's path (one step report per iteration) does."""
    steps = [(0.010, 100), (0.030, 400), (0.020, 200), (0.050, 900), (0.012, 120), (0.040, 500)]
    stepped, polled = StatusEstimator(alpha=0.3), StatusEstimator(alpha=0.3)
    totals = PrefillTotals()
    polled.on_status(make_status(totals), -1.0)  # the router's first poll: the baseline
    for i, (duration_s, tokens) in enumerate(steps):
        totals = totals.add(duration_s, tokens)
        stepped.on_step("A40", _step(duration_s, tokens, totals), float(i))
        polled.on_status(make_status(totals), float(i))
    view = make_view("A40", running=1)
    assert polled.estimate(view).prefill_s_per_token == pytest.approx(
        stepped.estimate(view).prefill_s_per_token, rel=1e-9
    )


def test_one_poll_over_identical_iterations_weighs_them_like_that_many_steps():
    stepped, polled = StatusEstimator(alpha=0.2), StatusEstimator(alpha=0.2)
    for estimator in (stepped, polled):  # same starting point: one 1 ms/token step
        estimator.observe_iterations("A40", (0.1,), 100, 0)
    stepped.on_status(make_status(PrefillTotals()), 0.0)
    polled.on_status(make_status(PrefillTotals()), 0.0)
    for _ in range(5):
        stepped.observe_iterations("A40", (0.4,), 200, 0)
    polled.on_status(make_status(PrefillTotals(5, 1000, 2.0)), 1.0)
    view = make_view("A40", running=1)
    assert polled.estimate(view).prefill_s_per_token == pytest.approx(
        stepped.estimate(view).prefill_s_per_token, rel=1e-9
    )


def test_one_report_of_a_run_leaves_the_estimator_where_one_report_per_iteration_does():
    """A decode run's stretch in one report: the same EMA steps, bit for bit, and its
    new queue waits and finishes dated at the first iteration's end, as per iteration."""
    durations = [0.021, 0.0213, 0.0209, 0.0217, 0.0222]
    before = make_status(PrefillTotals(), running=4)
    after = replace(before, recent_queue_wait_s=(0.5, 0.7), num_queue_wait_samples=2,
                    num_finished=3)
    bulk, stepped = StatusEstimator(alpha=0.3), StatusEstimator(alpha=0.3)
    for estimator in (bulk, stepped):
        estimator.on_step("A40", StepReport("A40", 0.0, (0.05,), 300, 2, before), 0.05)
    bulk.on_step("A40", StepReport("A40", 0.05, durations, 0, 4, after), 0.05 + sum(durations))
    start_s = 0.05
    for duration_s in durations:
        stepped.on_step("A40", StepReport("A40", start_s, (duration_s,), 0, 4, after),
                        start_s + duration_s)
        start_s += duration_s
    assert bulk._states == stepped._states
    view = make_view("A40", running=4, waiting=2)
    assert bulk.estimate(view, now=1.0) == stepped.estimate(view, now=1.0)


def test_each_backend_says_what_it_can_do():
    """The service asks the backend class, not the config's backend name."""
    from app.engines.config import EngineBackend
    from app.engines.factory import backend_class
    from app.engines.messages import StructuredOutput

    sim, vllm = backend_class(EngineBackend.SIM), backend_class(EngineBackend.VLLM)
    assert sim is SimBackend
    assert not (sim.CAPABILITIES.logprobs or sim.CAPABILITIES.structured_outputs
                or sim.CAPABILITIES.text)
    assert vllm.CAPABILITIES.logprobs and vllm.CAPABILITIES.structured_outputs
    assert vllm.CAPABILITIES.text
    assert vllm.constraint_error(StructuredOutput("regex", "[a-z]+")) is None
    assert vllm.constraint_error(StructuredOutput("regex", "(unclosed")) is not None
