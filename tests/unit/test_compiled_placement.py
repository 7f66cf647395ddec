"""GoodServe's compiled placement makes the decisions of a per-instance reference.

Random clusters (mixed GPU kinds, loads, KV room, prefix hits, disaggregated KV
arrivals), random estimator histories and random knob settings; two policies, one per
path, see the same events and must answer every request identically (instance or
rejection reason), which also keeps their budgets and admission records in step.
The reference (`tests/unit/reference_placement.py`) writes each rule in plain Python.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from app.engines.config import EngineRole
from app.engines.messages import EngineStatus
from app.hardware.specs import make_instance
from app.routing.arrays import ViewArrays, ViewColumns
from app.routing.goodserve import GoodServeConfig, JustEnoughPolicy, JustEnoughVariant
from app.routing.instance_view import InstanceView
from app.routing.length import RunningHistoryLength
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, RouteRequest
from tests.unit.reference_placement import use_reference

pytestmark = pytest.mark.unit

KINDS = [make_instance("H800", "llama-3.1-8b"), make_instance("A800", "llama-3.1-8b"),
         make_instance("A40", "llama-3.1-8b"), make_instance("V100", "llama-3.1-8b", 2)]


def random_config(rng: random.Random) -> GoodServeConfig:
    return GoodServeConfig(
        variant=rng.choice(list(JustEnoughVariant)), headroom=rng.choice([0.0, 0.1, 0.3]),
        admission_control=rng.random() < 0.3, triage=rng.choice([None, True, False]),
        protect_admitted=rng.random() < 0.8, confidence_quantile=rng.choice([0.5, 0.9]),
        fast_while_cold=rng.random() < 0.7, reservation_quantile=rng.choice([0.8, 1.0]),
        admissions_window=rng.choice([8, 64]), min_slo_samples=rng.choice([1, 20]),
        cache_affinity_tokens=rng.choice([None, 0, 2048]),
        session_homes=rng.random() < 0.7, triage_session_steps=rng.random() < 0.3)


PRIORITIES = [0, 1_000, 1_000, 60_000, 2**62]  # deadline priorities, ties included


def random_views(rng: random.Random, n: int, now: float,
                 ordered: bool = False) -> tuple[InstanceView, ...]:
    """`ordered`: most engines run their queue by priority, some of whose waiting
    requests' priorities are not known."""
    views = []
    for i in range(n):
        total = rng.choice([2_000, 20_000, 60_000])
        waiting = rng.choice([0, 0, 1, 5, 40])
        priorities = None
        if ordered and rng.random() < 0.7:
            known = rng.choice([waiting, waiting, rng.randrange(waiting + 1)])
            priorities = tuple(sorted(rng.choice(PRIORITIES) for _ in range(known)))
        views.append(InstanceView(
            instance_id=f"i{rng.randrange(10 * n):03d}-{i}", spec=rng.choice(KINDS),
            role=EngineRole.UNIFIED, num_waiting=waiting,
            num_running=rng.choice([0, 1, 8, 64, 300]),
            num_kv_blocks_free=rng.randrange(total + 1), num_kv_blocks=total,
            kv_block_size=16, num_iterations=rng.randrange(1000), recent_iteration_s=(),
            recent_queue_wait_s=(), updated_s=now,
            max_num_seqs=rng.choice([None, 8, 256]), waiting_priorities=priorities))
    return tuple(views)


def feed(estimators: list[StatusEstimator], views: tuple[InstanceView, ...],
         rng: random.Random, now: float) -> None:
    """The same random history into every estimator."""
    for view in rng.sample(views, k=len(views) // 2):
        iid = view.instance_id
        for _ in range(rng.randrange(1, 4)):
            args = (iid, (rng.uniform(0.01, 0.3),), rng.choice([0, 0, 512, 4096]),
                    rng.choice([0, 1, 16, 128]))
            for status in estimators:
                status.observe_iterations(*args)
        if rng.random() < 0.5:
            wait = rng.uniform(0, 3)
            for status in estimators:
                status.observe_queue_wait(iid, wait, now)
        if rng.random() < 0.5:
            finished = rng.randrange(1, 40)
            report = EngineStatus(iid, view.gpu_type, "unified", 0, 1, (), (), 0, 1, 0,
                                  num_finished=finished)
            seen = now - rng.uniform(0, 5)
            for status in estimators:
                status.on_status(report, seen)


def random_request(rng: random.Random, k: int, now: float,
                   ordered: bool = False) -> RouteRequest:
    prompt = rng.choice([50, 800, 4000, 30_000, 2_000_000])
    return RouteRequest(
        f"r{k}", now, now + rng.choice([0.5, 2.0, 10.0, 60.0, math.inf]), prompt,
        block_hashes=tuple(range(rng.choice([0, 1, 20]))), prompt="p",
        predicted_output_tokens=rng.choice([None, 10, 300]),
        num_generated_tokens=rng.choice([0, 0, 0, 50]),
        max_output_tokens=rng.choice([None, 64, 2048]),
        kv_ready_s=rng.choice([None, None, now + 0.2, now - 1.0]),
        priority=rng.choice([-1, 500, *PRIORITIES]) if ordered else 0,
        session_id=rng.choice([None, None, "s"]))


@pytest.mark.parametrize("ordered", [False, True], ids=["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(40))
def test_compiled_and_reference_placement_decide_alike(seed: int, ordered: bool):
    rng = random.Random(seed)
    config = random_config(rng)
    lengths = [RunningHistoryLength(window_size=200) for _ in range(2)]
    for _ in range(rng.choice([0, 5, 300])):
        tokens = rng.randrange(1, 2000)
        for length in lengths:
            length.observe_length(tokens)
    policies = [JustEnoughPolicy(StatusEstimator(), length, config) for length in lengths]
    use_reference(policies[0])
    decided = 0
    for step in range(30):
        now = 100.0 + step
        views = random_views(rng, rng.choice([1, 3, 12, 40]), now, ordered)
        feed([p.status for p in policies], views, rng, now)
        hits = {v.instance_id: rng.choice([0, 0, 3, 40]) for v in views}
        view = ClusterView(now, views, lambda iid, hashes, hits=hits: min(hits[iid], len(hashes)))
        for k in range(5):
            request = random_request(rng, step * 10 + k, now, ordered)
            plain, columns = (p.choose(request, view, now) for p in policies)
            assert columns == plain, (seed, step, k)
            decided += 1
            if rng.random() < 0.3:  # a finish moves the history and frees a budget
                report = FinishReport(request, views[0].instance_id, rng.randrange(1, 900),
                                      None, now)
                for p in policies:
                    p.on_finish(report, now)
    assert decided == 150


def test_columns_follow_their_views_and_arrays_handed_out_stay_put():
    views = random_views(random.Random(1), 4, 0.0)
    columns = ViewColumns()
    for i, v in enumerate(views):
        columns.set(i, v)
    first = columns.arrays()
    assert np.array_equal(first.table, ViewArrays.of(views).table)
    busier = replace(views[2], num_running=views[2].num_running + 7)
    columns.set(2, busier)
    assert first.column("num_running")[2] == views[2].num_running  # unchanged snapshot
    assert columns.arrays().column("num_running")[2] == busier.num_running
    subset = columns.arrays([3, 1])
    assert subset.ids == (views[3].instance_id, views[1].instance_id)
    assert list(subset.id_rank) == sorted(range(2), key=lambda i: subset.ids[i])


def test_vectorised_estimates_equal_the_per_instance_ones():
    rng = random.Random(7)
    status = StatusEstimator(alpha=0.3)
    views = random_views(rng, 30, 50.0, ordered=True)
    feed([status], views, rng, 50.0)
    arrays = ViewArrays.of(views)
    for joining, priority in ((0, None), (1, None), (1, -1), (1, 1_000), (1, 2**62)):
        q, p, d = status.estimate_arrays(arrays, 51.0, joining, priority)
        for i, v in enumerate(views):
            e = status.estimate(v, 51.0, joining, priority)
            assert (q[i], p[i], d[i]) == (e.queue_delay_s, e.prefill_s_per_token,
                                          e.decode_s_per_token)
    status.forget(views[0].instance_id)
    q, p, d = status.estimate_arrays(arrays, 51.0)
    assert p[0] == views[0].spec.unloaded_prefill_s_per_token


def test_waiting_ahead_per_row_equals_each_views_count():
    """In priority mode only the waiting requests of a smaller or equal priority (and
    those whose priority is unknown) are ahead; under fcfs the whole queue."""
    rng = random.Random(5)
    views = random_views(rng, 40, 0.0, ordered=True)
    assert any(v.waiting_priorities is None and v.num_waiting for v in views)
    columns = ViewColumns()
    for i, v in enumerate(views):
        columns.set(i, v)
    rows = [3, 0, 17, 29]
    for arrays, members in ((ViewArrays.of(views), views), (columns.arrays(), views),
                            (columns.arrays(rows), [views[i] for i in rows])):
        for priority in (-1, 0, 500, 1_000, 60_000, 2**62):
            assert arrays.num_waiting_ahead(priority).tolist() == [
                v.num_waiting_ahead(priority) for v in members]
    view = replace(views[0], num_waiting=6, waiting_priorities=(5, 9, 9, 20))
    assert [view.num_waiting_ahead(p) for p in (4, 5, 9, 30)] == [2, 3, 5, 6]
    assert replace(view, waiting_priorities=None).num_waiting_ahead(4) == 6
    assert replace(view, num_waiting=3).num_waiting_ahead(30) == 3  # never beyond the queue


def test_priority_mode_queue_delay_counts_only_the_requests_ahead():
    status = StatusEstimator()
    view = replace(random_views(random.Random(2), 1, 0.0)[0], num_running=4, num_waiting=4,
                   waiting_priorities=(10, 20, 30, 40))
    iid = view.instance_id
    status.observe_iterations(iid, (0.05,), 0, 4)
    status.on_status(EngineStatus(iid, view.gpu_type, "unified", 0, 1, (), (), 0, 1, 0,
                                  num_finished=11), 0.0)  # 10 departures over 10 s
    whole = status.estimate(view, 10.0).queue_delay_s
    assert whole == pytest.approx(4.0)  # Little's law on the whole queue
    assert status.estimate(view, 10.0, priority=25).queue_delay_s == pytest.approx(2.0)
    assert status.estimate(view, 10.0, priority=5).queue_delay_s == 0.0
    assert status.estimate(replace(view, waiting_priorities=None), 10.0,
                           priority=5).queue_delay_s == whole


def test_kept_estimates_follow_every_change_between_decisions():
    """The estimates kept between calls equal the per-instance ones after reports on
    some instances, counts moving on others, an instance forgotten, and another list
    of instances asked in between."""
    rng = random.Random(11)
    status = StatusEstimator(alpha=0.3)
    views = list(random_views(rng, 24, 0.0))
    columns = ViewColumns()
    for i, v in enumerate(views):
        columns.set(i, v)
    for step in range(60):
        now = 10.0 + step * 0.5
        if rng.random() < 0.5:
            feed([status], tuple(rng.sample(views, 6)), rng, now)
        for i in rng.sample(range(len(views)), 3):
            waiting = rng.choice([0, 0, 2, 9])
            views[i] = replace(views[i], num_waiting=waiting,
                               num_running=rng.choice([0, 3, 64]),
                               waiting_priorities=rng.choice([None, tuple(range(waiting))]))
            columns.set(i, views[i])
        if step % 17 == 5:
            status.forget(views[step % len(views)].instance_id)
        if step % 7 == 0:
            status.estimate_arrays(ViewArrays.of(views[:5]), now)
        arrays = columns.arrays()
        priority = rng.choice([None, 0, 4])
        for joining in (0, 1):
            q, p, d = status.estimate_arrays(arrays, now + 0.1, joining, priority)
            for i, v in enumerate(views):
                e = status.estimate(v, now + 0.1, joining, priority)
                assert (q[i], p[i], d[i]) == (e.queue_delay_s, e.prefill_s_per_token,
                                              e.decode_s_per_token), (step, joining, i)


def test_a_simulated_run_places_every_request_alike_on_the_reference():
    """The whole loop (watchdog moves, finishes, budgets) over a mixed 24-instance
    cluster: the same outcome for every request."""
    from app.experiments.overhead import mixed_cluster
    from app.routing.registry import PolicyKind, RoutingOptions, build_routing
    from app.sim.instance import setups_from_config
    from app.sim.simulator import Simulator
    from app.workloads.slo import assign_slos
    from app.workloads.workload import Content, poisson_workload

    pool = [Content(200 + 300 * (i % 9), 40 + 60 * (i % 7), (i % 5, i)) for i in range(64)]
    workload = poisson_workload(250.0, 4.0, pool, seed=2)
    workload = assign_slos(workload, [0.5 + 0.1 * (i % 13) for i in range(len(workload))], 2.0)
    runs = []
    for reference in (True, False):
        stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(seed=0))
        if reference:
            use_reference(stack.policy)
            use_reference(stack.watchdog)
        sim = Simulator(setups_from_config(mixed_cluster(24)), stack.policy,
                        watchdog=stack.watchdog, seed=0)
        runs.append(sim.run(workload).records)
    plain, columns = runs
    assert [(r.request_id, r.outcome, r.finish_s, r.num_migrations) for r in columns] == [
        (r.request_id, r.outcome, r.finish_s, r.num_migrations) for r in plain]
    assert sum(r.num_migrations for r in plain) > 0  # the watchdog moved some


def test_the_prefix_directory_answers_what_each_cache_would():
    """Random prompts into small LRU caches (evictions included): one directory query
    equals `peek` on every cache, and an instance outside the directory has no hit."""
    from app.engines.prefix import PrefixCache, PrefixDirectory

    rng = random.Random(3)
    directory = PrefixDirectory()
    caches = {f"c{i}": PrefixCache(capacity_tokens=rng.choice([64, 320, 4000]))
              for i in range(70)}  # more than 64 instances: masks wider than a word
    for name, cache in caches.items():
        cache.join(directory, name)
    stems = [tuple(rng.randrange(10**6) for _ in range(30)) for _ in range(6)]
    for _ in range(400):
        stem = rng.choice(stems)
        prompt = stem[:rng.randrange(1, 30)] + tuple(rng.randrange(10**6) for _ in range(3))
        rng.choice(list(caches.values())).insert(prompt, 16)
        query = rng.choice(stems)[:rng.randrange(0, 31)]
        ids = [*rng.sample(list(caches), 20), "absent"]
        cap = rng.randrange(1, 16 * 31)
        hits = directory.hit_tokens(query, ids, 16, cap)
        assert list(hits) == [min(16 * caches[i].peek(query), cap) if i in caches else 0
                              for i in ids]


def test_an_instance_that_joins_the_directory_is_seen_by_a_list_asked_before():
    """The same tuple of ids asked before and after an instance joins: the slots kept
    for the tuple must not keep calling it unknown."""
    from app.engines.prefix import PrefixCache, PrefixDirectory

    directory, prompt = PrefixDirectory(), tuple(range(8))
    ids = ("a", "late")
    early = PrefixCache(capacity_tokens=4096)
    early.join(directory, "a")
    early.insert(prompt[:2], 16)
    assert list(directory.hit_tokens(prompt, ids, 16, 1000)) == [32, 0]
    late = PrefixCache(capacity_tokens=4096)
    late.join(directory, "late")
    late.insert(prompt, 16)
    assert list(directory.hit_tokens(prompt, ids, 16, 1000)) == [32, 128]


def test_warm_up_compiles_every_pass_a_decision_calls():
    """The compile (or cache load) happens when a placer is built, never on a request:
    a run of decisions, moves and fallbacks adds no signature to any compiled pass."""
    from app.engines import prefix
    from app.experiments.overhead import mixed_cluster
    from app.routing import length, status
    from app.routing.goodserve import scoring
    from app.routing.registry import PolicyKind, RoutingOptions, build_routing
    from app.sim.instance import setups_from_config
    from app.sim.simulator import Simulator
    from app.workloads.slo import assign_slos
    from app.workloads.workload import Content, poisson_workload

    stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(seed=0))
    passes = [scoring._instance_terms, scoring._place, scoring._fallback,
              scoring._outcome_rows, status._estimate_row, status._refresh_terms,
              length._scale_of, prefix._leading_tokens]
    compiled = [len(p.signatures) for p in passes]
    pool = [Content(300 + 500 * (i % 5), 50 + 80 * (i % 3), (i % 4, i)) for i in range(32)]
    workload = poisson_workload(150.0, 1.0, pool, seed=1)
    workload = assign_slos(workload, [0.3 + 0.2 * (i % 7) for i in range(len(workload))], 1.5)
    Simulator(setups_from_config(mixed_cluster(12)), stack.policy, watchdog=stack.watchdog,
              seed=0).run(workload)
    assert [len(p.signatures) for p in passes] == compiled
