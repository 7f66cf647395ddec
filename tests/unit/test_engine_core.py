"""The shared continuous-batching engine model, driven like the simulator drives it."""

from __future__ import annotations

import pytest

from app.engines.config import SchedulerConfig
from app.engines.messages import RequestStatus, TokenEvent
from app.hardware.specs import make_instance
from app.sim.engine_core import ScheduledStep, SimEngineCore, SimSequence, sim_token_id

pytestmark = pytest.mark.unit


def make_core(gpu: str = "A800", **knobs) -> SimEngineCore:
    return SimEngineCore(make_instance(gpu, "llama-3.1-8b"), SchedulerConfig(**knobs))


def make_seq(rid: str, prompt: int = 100, out: int = 10, **kw) -> SimSequence:
    return SimSequence(rid, prompt, out, arrival_s=kw.pop("arrival_s", 0.0), **kw)


def run_to_completion(core: SimEngineCore, now: float = 0.0) -> tuple[list[TokenEvent], float]:
    events: list[TokenEvent] = []
    while core.has_work:
        step = core.begin_step(now)
        assert step is not None, "work exists but nothing was scheduled"
        now = step.end_s
        events.extend(core.complete_step(step, now))
    return events, now


def test_every_request_gets_exactly_its_tokens():
    core = make_core()
    for i in range(6):
        core.add_request(make_seq(f"r{i}", prompt=200 + 50 * i, out=5 + i))
    events, _ = run_to_completion(core)
    for i in range(6):
        mine = [e for e in events if e.request_id == f"r{i}"]
        assert [e.index for e in mine] == list(range(5 + i))
        assert mine[-1].finish_reason == "length" and not any(e.finished for e in mine[:-1])
    assert core.num_free_blocks == core.num_kv_blocks  # all KV returned


def test_batching_beats_serial_execution():
    serial_total = 0.0
    for i in range(8):
        core = make_core()
        core.add_request(make_seq(f"r{i}", out=50))
        serial_total += run_to_completion(core)[1]
    core = make_core()
    for i in range(8):
        core.add_request(make_seq(f"r{i}", out=50))
    assert run_to_completion(core)[1] < serial_total / 4


def test_chunked_prefill_respects_token_budget():
    core = make_core(max_num_batched_tokens=512)
    core.add_request(make_seq("long", prompt=2000, out=2))
    step = core.begin_step(0.0)
    assert step.req_to_num_tokens == {"long": 512}
    _, end = run_to_completion(core, step.end_s)
    assert core.num_iterations >= 4


def test_max_num_seqs_limits_running():
    core = make_core(max_num_seqs=2)
    for i in range(5):
        core.add_request(make_seq(f"r{i}"))
    step = core.begin_step(0.0)
    assert len(step.req_to_num_tokens) == 2
    assert len(core.waiting) == 3


def test_prefix_cache_hit_skips_computation():
    core = make_core()
    hashes = tuple(range(10))
    core.add_request(make_seq("a", prompt=160, out=2, block_hashes=hashes))
    run_to_completion(core)
    core.add_request(make_seq("b", prompt=170, out=2, block_hashes=hashes))
    step = core.begin_step(100.0)
    assert step.req_to_num_tokens == {"b": 10}  # 160 cached tokens, 10 left to prefill
    assert core.prefix_cache.peek(hashes) == 10


def test_resume_reproduces_uninterrupted_tokens():
    core = make_core()
    core.add_request(make_seq("full", out=20, token_seed=42))
    full = [e.token_id for e in run_to_completion(core)[0]]
    resumed_core = make_core("H800")
    resumed_core.add_request(make_seq("rest", out=20, token_seed=42, num_resumed_tokens=7))
    rest = run_to_completion(resumed_core)[0]
    assert [e.index for e in rest] == list(range(7, 20))
    assert [e.token_id for e in rest] == full[7:]
    first = resumed_core.num_iterations  # re-prefill of prompt + 7 resumed tokens happened
    assert first == 13


def test_kv_exhaustion_preempts_and_still_finishes():
    core = make_core(num_kv_blocks=40, block_size=16)  # 640 tokens of KV
    for i in range(4):
        core.add_request(make_seq(f"r{i}", prompt=120, out=60))
    events, _ = run_to_completion(core)
    assert core.num_preemptions > 0
    assert sorted({e.request_id for e in events if e.finished}) == ["r0", "r1", "r2", "r3"]
    assert core.num_free_blocks == 40


def test_oversized_request_is_refused_with_reason():
    core = make_core(num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="exceed KV capacity"):
        core.add_request(make_seq("big", prompt=500))


def test_abort_frees_resources():
    core = make_core()
    core.add_request(make_seq("a", out=100))
    step = core.begin_step(0.0)
    core.complete_step(step, step.end_s)
    aborted = core.abort_request("a")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert not core.has_work and core.num_free_blocks == core.num_kv_blocks
    assert core.abort_request("a") is None


def test_decode_role_skips_prefill():
    core = make_core()
    core.add_request(make_seq("d", prompt=4000, out=3, skip_prefill=True))
    step = core.begin_step(0.0)
    assert step.req_to_num_tokens == {"d": 1}


def test_queue_wait_is_reported():
    core = make_core(max_num_seqs=1)
    core.add_request(make_seq("a", out=5))
    core.add_request(make_seq("b", out=5))
    run_to_completion(core)
    status = core.status("e0", "unified", 1.0)
    assert status.recent_queue_wait_s[0] == 0.0 and status.recent_queue_wait_s[1] > 0.0
    assert status.num_running == 0 and len(status.recent_iteration_s) == core.num_iterations


def test_sim_token_ids_are_deterministic_and_in_vocab():
    ids = [sim_token_id(7, i, 1000) for i in range(100)]
    assert ids == [sim_token_id(7, i, 1000) for i in range(100)]
    assert all(0 <= t < 1000 for t in ids) and len(set(ids)) > 80


def test_preempted_request_recomputes_its_generated_tokens_too():
    core = make_core(num_kv_blocks=30, block_size=16)  # 480 tokens of KV
    core.add_request(make_seq("a", prompt=100, out=200, token_seed=1))
    core.add_request(make_seq("b", prompt=100, out=200, token_seed=2))
    now, events, recomputes = 0.0, [], []
    while core.has_work:
        preempted = {rid: seq.num_output_tokens for rid, seq in core.requests.items()
                     if seq.status == RequestStatus.PREEMPTED}
        step = core.begin_step(now)
        recomputes += [(step.req_to_num_tokens[rid], n) for rid, n in preempted.items()
                       if rid in step.req_to_num_tokens]
        now = step.end_s
        events.extend(core.complete_step(step, now))
    assert recomputes and all(tokens == 100 + n for tokens, n in recomputes)
    for rid, seed in (("a", 1), ("b", 2)):
        mine = [e for e in events if e.request_id == rid]
        assert [e.index for e in mine] == list(range(200))
        assert [e.token_id for e in mine] == [sim_token_id(seed, i, 128256) for i in range(200)]


def test_prefix_is_reusable_as_soon_as_prefill_completes():
    core = make_core()
    hashes = tuple(range(10))
    core.add_request(make_seq("a", prompt=160, out=50, block_hashes=hashes))
    step = core.begin_step(0.0)
    core.complete_step(step, step.end_s)  # prefill done, "a" still decoding
    assert core.prefix_cache.peek(hashes) == 10


def test_prefix_cache_capacity_counts_tokens_not_entries():
    core = make_core(num_kv_blocks=64, block_size=16)  # 1024 tokens
    core.cache_context(range(4), 512)  # 2048 tokens of 512-token blocks
    assert core.prefix_cache.num_cached_tokens <= 1024 and len(core.prefix_cache) == 2


# ---- the prefix cache shares the KV pool, as vLLM's does -----------------------------
def blocks_of(prefix: str, num: int) -> tuple[int, ...]:
    """`num` distinct 16-token block hashes of a prompt named `prefix`."""
    return tuple(hash((prefix, i)) for i in range(num))


def cached_tokens_of(events: list[TokenEvent], request_id: str) -> int:
    return next(e.num_cached_tokens for e in events if e.request_id == request_id)


def test_running_requests_crowd_cached_prefixes_out_of_the_pool():
    core = make_core(num_kv_blocks=40, block_size=16)
    core.add_request(make_seq("a", prompt=320, out=2, block_hashes=blocks_of("a", 20)))
    run_to_completion(core)
    assert core.prefix_cache.peek(blocks_of("a", 20)) == 20 and core.num_free_blocks == 40
    core.add_request(make_seq("big", prompt=480, out=100))  # 30 blocks, then growing
    step = core.begin_step(0.0)
    core.complete_step(step, step.end_s)
    assert core.prefix_cache.peek(blocks_of("a", 20)) == 10  # the 10 that still fit
    step = core.begin_step(step.end_s)  # its first decode takes a 31st block
    core.complete_step(step, step.end_s)
    assert core.prefix_cache.peek(blocks_of("a", 20)) == 9
    assert core.prefix_cache.num_free_cached_blocks == core.num_free_blocks == 9


def test_cached_blocks_go_least_recently_used_first_and_only_when_free_ones_run_out():
    core = make_core(num_kv_blocks=64, block_size=16)
    for name in ("old", "new"):  # 10 blocks each, "old" released first
        core.add_request(make_seq(name, prompt=160, out=2, block_hashes=blocks_of(name, 10)))
        run_to_completion(core)
    core.add_request(make_seq("small", prompt=600, out=2))  # 38 blocks of 44 uncached ones
    run_to_completion(core)
    assert core.prefix_cache.peek(blocks_of("old", 10)) == 10  # nothing needed evicting
    core.add_request(make_seq("larger", prompt=800, out=2))  # 51 blocks: 7 must go
    run_to_completion(core)
    assert core.prefix_cache.peek(blocks_of("new", 10)) == 10
    # "old" loses its deepest blocks first (a request's tail is freed first), so a
    # shorter lead of it is still found
    assert 0 < core.prefix_cache.peek(blocks_of("old", 10)) < 10


def test_a_prefix_two_running_requests_share_is_held_once_and_not_evicted():
    core = make_core(num_kv_blocks=64, block_size=16)
    shared = blocks_of("shared", 10)
    core.add_request(make_seq("a", prompt=170, out=200, block_hashes=shared))
    step = core.begin_step(0.0)
    events = core.complete_step(step, step.end_s)
    core.add_request(make_seq("b", prompt=175, out=200, block_hashes=shared))
    step = core.begin_step(step.end_s)
    events += core.complete_step(step, step.end_s)
    assert cached_tokens_of(events, "b") == 160
    held = core.num_kv_blocks - core.num_free_blocks
    assert held == 10 + 1 + 1  # the shared 10 once, and each one's own last block
    core.add_request(make_seq("c", prompt=900, out=2))  # more than the free blocks
    step = core.begin_step(step.end_s)
    assert "c" not in step.req_to_num_tokens and core.prefix_cache.peek(shared) == 10


def test_a_preempted_request_finds_its_prefix_again():
    core = make_core(num_kv_blocks=30, block_size=16, max_num_batched_tokens=4096)
    core.add_request(make_seq("a", prompt=160, out=2, block_hashes=blocks_of("p", 10)))
    run_to_completion(core)
    core.add_request(make_seq("r", prompt=170, out=300, block_hashes=blocks_of("p", 10)))
    core.add_request(make_seq("s", prompt=100, out=300))
    events, _ = run_to_completion(core)
    assert core.num_preemptions >= 1
    assert [e.num_cached_tokens for e in events if e.num_cached_tokens][:1] == [160]
    assert core.num_free_blocks == core.num_kv_blocks


def test_a_pinned_context_survives_the_churn_that_evicts_an_unpinned_one():
    core = make_core(num_kv_blocks=64, block_size=16)
    for name in ("kept", "lost"):
        core.add_request(make_seq(name, prompt=160, out=2, block_hashes=blocks_of(name, 10)))
        run_to_completion(core)
    assert core.pin("session", blocks_of("kept", 10), until_s=100.0) == 10
    assert core.num_free_blocks == 54  # its blocks left the free pool
    core.add_request(make_seq("churn", prompt=840, out=2))  # 53 of the 54 unpinned blocks
    run_to_completion(core)
    assert core.prefix_cache.peek(blocks_of("kept", 10)) == 10
    assert core.prefix_cache.peek(blocks_of("lost", 10)) == 1  # its head alone is left
    core.unpin("session")
    assert core.num_free_blocks == core.num_kv_blocks
    assert core.prefix_cache.peek(blocks_of("kept", 10)) == 10  # still cached, unheld


def test_a_pin_ends_when_its_time_is_up_and_never_makes_a_request_wait():
    core = make_core(num_kv_blocks=64, block_size=16)
    core.add_request(make_seq("a", prompt=480, out=2, block_hashes=blocks_of("a", 30)))
    run_to_completion(core)
    core.pin("s", blocks_of("a", 30), until_s=5.0)
    core.add_request(make_seq("b", prompt=16, out=2, arrival_s=6.0))
    core.begin_step(6.0)
    assert core.pins == {}  # ended at 5 s
    core = make_core(num_kv_blocks=64, block_size=16)
    core.add_request(make_seq("a", prompt=480, out=2, block_hashes=blocks_of("a", 30)))
    run_to_completion(core)
    core.pin("s", blocks_of("a", 30), until_s=1e9)
    core.add_request(make_seq("big", prompt=900, out=2))  # needs more than is unpinned
    events, _ = run_to_completion(core)
    assert core.pins == {} and any(e.request_id == "big" and e.finished for e in events)


# ---- priority mode (vLLM's scheduling_policy="priority") ------------------------------


def step_once(core: SimEngineCore, now: float) -> tuple[dict[str, int], float]:
    """One iteration; (what it ran, when it ended)."""
    step = core.begin_step(now)
    assert step is not None
    core.complete_step(step, step.end_s)
    return step.req_to_num_tokens, step.end_s


def test_priority_mode_orders_the_waiting_queue_by_priority_then_arrival():
    arrivals = [("a", 5, 0.0), ("b", 1, 2.0), ("c", 1, 1.0), ("d", 5, 0.0), ("e", 0, 3.0)]
    order = {}
    for policy in ("fcfs", "priority"):
        core = make_core(max_num_seqs=1, scheduling_policy=policy)
        for rid, priority, arrival in arrivals:
            core.add_request(make_seq(rid, out=3, priority=priority, arrival_s=arrival))
        order[policy] = [seq.request_id for seq in core.waiting]
        events, _ = run_to_completion(core)
        assert [e.request_id for e in events if e.index == 0] == order[policy]
    assert order == {"fcfs": ["a", "b", "c", "d", "e"], "priority": ["e", "c", "b", "a", "d"]}
    core = make_core(scheduling_policy="priority")
    for rid, priority, arrival in arrivals:
        core.add_request(make_seq(rid, priority=priority, arrival_s=arrival))
    assert core.waiting.priorities() == (0, 1, 1, 5, 5)
    assert core.abort_request("c") is not None and core.waiting.priorities() == (0, 1, 5, 5)
    assert make_core().waiting.priorities() is None  # fcfs: the whole queue is ahead


def staggered_core(policy: str) -> SimEngineCore:
    """Nine KV blocks of 16 tokens, full after three admissions: running in order
    high-a (priority 1), low (9), high-b (2); high-b's first decode needs a tenth."""
    core = make_core(num_kv_blocks=9, block_size=16, scheduling_policy=policy)
    now = 0.0
    for rid, prompt, priority in (("high-a", 40, 1), ("low", 40, 9), ("high-b", 47, 2)):
        core.add_request(make_seq(rid, prompt=prompt, out=50, priority=priority, arrival_s=now))
        _, now = step_once(core, now)
    assert [s.request_id for s in core.running] == ["high-a", "low", "high-b"]
    assert core.num_free_blocks == 0 and core.num_preemptions == 0
    return core


def test_priority_mode_preempts_the_largest_priority_even_if_already_scheduled():
    """The victim ran earlier in the same pass: its tokens go back and the request that
    could not grow is scheduled; nothing waiting is admitted in that iteration."""
    core = staggered_core("priority")
    ran, _ = step_once(core, 10.0)
    assert ran == {"high-a": 1, "high-b": 1}
    assert core.requests["low"].status == RequestStatus.PREEMPTED
    assert [s.request_id for s in core.waiting] == ["low"]


def test_fcfs_mode_preempts_the_last_admitted():
    """high-b, the request that could not grow, is the victim; fcfs admits after a
    preemption, so it is recomputed (prompt + its one token) in the same iteration."""
    core = staggered_core("fcfs")
    ran, _ = step_once(core, 10.0)
    assert core.num_preemptions == 1
    assert ran == {"high-a": 1, "low": 1, "high-b": 48}


def test_priority_mode_passes_over_an_iteration_left_empty():
    """The request that cannot grow is itself the victim and comes first: vLLM's
    iteration schedules nothing; the next one runs the others at once."""
    core = make_core(num_kv_blocks=9, block_size=16, scheduling_policy="priority")
    core.add_request(make_seq("low", prompt=40, out=100, priority=9))
    _, now = step_once(core, 0.0)
    for rid in ("high-a", "high-b"):
        core.add_request(make_seq(rid, prompt=40, out=100, priority=1, arrival_s=now))
    while core.num_preemptions == 0:
        ran, now = step_once(core, now)
    assert {"high-a", "high-b"} <= ran.keys()
    events, _ = run_to_completion(core, now)
    finished = [e.request_id for e in events if e.finished]
    assert finished[-1] == "low" and sorted(finished) == ["high-a", "high-b", "low"]
    assert core.num_free_blocks == core.num_kv_blocks


def decoding_core(**knobs) -> tuple[SimEngineCore, ScheduledStep]:
    """Two requests stepped to their first iteration that only decodes (begun)."""
    core = make_core("A40", **knobs)
    for i, out in enumerate((40, 70)):
        core.add_request(make_seq(f"r{i}", prompt=30 + i, out=out))
    step = core.begin_step(0.0)
    while step.batch.num_prefill_tokens:
        core.complete_step(step, step.end_s)
        step = core.begin_step(step.end_s)
    return core, step


@pytest.mark.parametrize("num_kv_blocks", [9, None])
def test_repeats_are_what_begin_step_schedules_up_to_a_finish_or_a_preemption(num_kv_blocks):
    # 9 blocks of 16 tokens: the two requests outgrow them before r0's 40th token
    planned, step = decoding_core(num_kv_blocks=num_kv_blocks)
    stepped, _ = decoding_core(num_kv_blocks=num_kv_blocks)
    run = planned.plan_run(step, 1000)
    assert run is not None and run.num_repeats > 0
    for index in range(run.num_repeats):
        prev, nxt = run.iteration(index), run.iteration(index + 1)
        planned.complete_repeats(run, index, index + 1)
        planned.begin_repeat(run, index + 1)
        stepped.complete_step(prev, prev.end_s)
        assert stepped.begin_step(prev.end_s) == nxt
        assert planned.num_free_blocks == stepped.num_free_blocks
        assert planned.req_to_blocks == stepped.req_to_blocks
    last = run.iteration(run.num_repeats)
    for core in (planned, stepped):
        core.complete_step(last, last.end_s)
        assert core.num_preemptions == 0
    assert planned.num_free_blocks == stepped.num_free_blocks
    assert list(planned.recent_iteration_s) == list(stepped.recent_iteration_s)
    assert [(s.num_computed_tokens, s.num_output_tokens) for s in planned.running] == [
        (s.num_computed_tokens, s.num_output_tokens) for s in stepped.running]
    stepped.begin_step(last.end_s)
    if num_kv_blocks is None:
        assert stepped.num_finished == 1  # the last repeat finished r0
    else:
        assert stepped.num_preemptions == 1  # the next iteration did not find KV


def test_a_run_applied_at_once_leaves_the_engine_as_one_iteration_at_a_time():
    bulk, step = decoding_core()
    single, _ = decoding_core()
    run, same = bulk.plan_run(step, 20), single.plan_run(step, 20)
    assert run is not None and same is not None and run.num_repeats == 20
    bulk.complete_repeats(run, 0, 13)
    bulk.begin_repeat(run, 13)
    for index in range(13):
        single.complete_repeats(same, index, index + 1)
        single.begin_repeat(same, index + 1)
    for core in (bulk, single):
        core.complete_step(run.iteration(13), run.ends_s[13])
    assert bulk.num_free_blocks == single.num_free_blocks
    assert bulk.req_to_blocks == single.req_to_blocks
    assert list(bulk.recent_iteration_s) == list(single.recent_iteration_s)
    assert bulk.num_iterations == single.num_iterations
    assert [(s.num_computed_tokens, s.num_output_tokens) for s in bulk.running] == [
        (s.num_computed_tokens, s.num_output_tokens) for s in single.running]


def test_no_repeats_while_a_request_could_join_or_a_prompt_is_computed():
    core, step = decoding_core(max_num_seqs=3)
    core.add_request(make_seq("late", prompt=50, out=5))  # waits, and a slot is free
    assert core.plan_run(step, 100) is None
    core = make_core()
    core.add_request(make_seq("r", prompt=2000, out=5))
    assert core.plan_run(core.begin_step(0.0), 100) is None
    full, step = decoding_core(max_num_seqs=2)
    full.add_request(make_seq("late", prompt=50, out=5))  # waits, but no slot is free
    run = full.plan_run(step, 5)
    assert run is not None and run.num_repeats == 5