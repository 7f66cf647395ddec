"""The deployed peers (llm-d predicted latency, Preble with rebalancing, session affinity,
Dynamo's KV router), each on hand-computed cases from its source's rules."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from app.engines.messages import EngineStatus, PrefillTotals
from app.routing.base import Reject
from app.routing.cache_aware import PreblePolicy
from app.routing.kv_router import KvRouterPolicy, softmax_pick
from app.routing.predicted_latency import (
    LatencyFeatures,
    OnlineLatencyModel,
    PredictedLatencyConfig,
    PredictedLatencyPolicy,
    composite_scores,
    headroom_scores,
    latency_scores,
)
from app.routing.registry import PolicyKind, make_policy
from app.routing.session_affinity import HashRing, SessionAffinityPolicy, ring_point
from app.routing.view import FinishReport
from tests.unit.routing_utils import SPECS, make_cluster, make_request, make_view

pytestmark = pytest.mark.unit

HASHES = tuple(range(64))  # 64 blocks x 16 tokens = a 1024-token prompt


def three(**kw):
    return [make_view(g, **kw.get(g, {})) for g in ("H800", "A800", "A40")]


def finish(request, instance_id: str, first_token_s: float, num_output_tokens: int = 11,
           tpot_s: float = 0.02) -> FinishReport:
    finish_s = first_token_s + tpot_s * (num_output_tokens - 1)
    return FinishReport(request, instance_id, num_output_tokens, first_token_s, finish_s)


def computed(instance_id: str, num_prompt_tokens: int) -> EngineStatus:
    """An engine report that counts `num_prompt_tokens` prompt tokens computed so far."""
    return EngineStatus(
        engine_id=instance_id, gpu_type=instance_id, role="unified", num_waiting=0,
        num_running=1, recent_iteration_s=(), recent_queue_wait_s=(), num_kv_blocks_used=0,
        num_kv_blocks_free=20_000, num_cached_prefix_blocks=0,
        prefill=PrefillTotals(num_tokens=num_prompt_tokens))


# --- Dynamo KV router ---------------------------------------------------------------


def test_dynamo_kv_router_picks_the_lowest_prefill_plus_decode_blocks():
    policy = KvRouterPolicy(seed=0)
    target = make_request(9.0, prompt=1024, rid="r", block_hashes=HASHES)
    hits = {"H800": 0, "A800": 32, "A40": 48}  # cached blocks
    cached = [16 * hits[g] for g in ("H800", "A800", "A40")]
    blocks = policy.blocks_of(target)
    # idle workers: logit = uncached tokens / 16 + the request's 64 new blocks
    # H800 1024/16 + 64 = 128; A800 512/16 + 64 = 96; A40 256/16 + 64 = 80
    assert policy.logits(target, blocks, three(), cached) == [128, 96, 80]
    assert policy.choose(target, make_cluster(*three(), hits=hits), 0.0) == "A40"
    policy.on_finish(finish(target, "A40", 1.0), 2.0)

    busy = make_request(9.0, prompt=640, rid="busy", block_hashes=tuple(range(1000, 1040)))
    assert policy.choose(busy, make_cluster(make_view("A40")), 0.0) == "A40"
    # A40 now holds busy's 40 blocks and, until its prefill completes, its 640 prefill
    # tokens: A40 (640 + 256)/16 + (40 + 64) = 160 > A800's 96
    assert policy.logits(target, blocks, three(), cached) == [128, 96, 160]
    assert policy.choose(target, make_cluster(*three(), hits=hits), 0.0) == "A800"
    policy.on_finish(finish(target, "A800", 1.0), 2.0)
    # from busy's first token only its blocks count: 256/16 + 104
    policy.on_first_token(busy, "A40", 2.0, 2.0)
    assert policy.logits(target, blocks, three(), cached)[2] == 120

    twin = make_request(9.0, prompt=1024, rid="twin",
                        block_hashes=HASHES[:32] + tuple(range(5000, 5032)))
    policy.choose(twin, make_cluster(make_view("A40")), 0.0)
    # distinct blocks: 40 + 64 active, of the target's 64 only 32 are new; twin's 1024
    # prompt tokens wait to be computed: (1024 + 256)/16 + 104 + 32 = 216
    assert policy.logits(target, blocks, three(), cached)[2] == 216
    policy.on_first_token(twin, "A40", 3.0, 3.0)
    assert policy.logits(target, blocks, three(), cached)[2] == 152
    policy.on_finish(finish(busy, "A40", 1.0), 2.0)
    policy.on_drop(twin, 2.0)
    assert policy.logits(target, blocks, three(), cached) == [128, 96, 80]  # all forgotten


def test_dynamo_counts_each_prefill_in_full_until_that_requests_first_token():
    # Dynamo drops a request's prefill tokens at its first token (mark_prefill_completed),
    # so a long context in chunked prefill counts in full while it runs, whatever the
    # engine has computed, and a short prompt scheduled beside it stops counting first
    policy = KvRouterPolicy(seed=0)
    a40 = make_cluster(make_view("A40"))
    long = make_request(9.0, prompt=8192, rid="long", block_hashes=tuple(range(512)))
    short = make_request(9.0, prompt=512, rid="short", block_hashes=tuple(range(900, 932)))
    assert policy.choose(long, a40, 0.0) == policy.choose(short, a40, 0.0) == "A40"
    probe = make_request(9.0, prompt=160, rid="probe", block_hashes=tuple(range(700, 710)))
    running = [make_view("A40", running=2)]  # both admitted: neither is waiting

    def logit() -> float:
        return policy.logits(probe, policy.blocks_of(probe), running, [0])[0]

    # (8192 + 512 + 160)/16 prefill + (512 + 32 + 10) blocks = 554 + 554
    assert logit() == 1108
    policy.on_status(computed("A40", 8704), 1.0)  # both computed, no first token yet
    assert logit() == 1108
    policy.on_first_token(short, "A40", 1.5, 1.5)  # short's first: (8192 + 160)/16 + 554
    assert logit() == 1076
    policy.on_first_token(long, "A40", 2.0, 2.0)  # then long's: 160/16 + 554
    assert logit() == 564
    policy.on_first_token(long, "A40", 2.5, 2.5)  # heard once: nothing more to drop
    assert logit() == 564
    # short fails over after its first token: no other will come, so no prefill counts
    assert policy.choose(replace(short, num_generated_tokens=8), a40, 3.0) == "A40"
    assert logit() == 564


def test_dynamo_softmax_sampling_follows_range_normalized_logits():
    # logits 80, 96, 128: range 48, weights e^0, e^(-16/48), e^(-48/48) = 1, .7165, .3679
    # -> probabilities .4798, .3437, .1765; cumulative .4798, .8235, 1
    assert [softmax_pick([80, 96, 128], 1.0, s) for s in (0.47, 0.5, 0.82, 0.83)] == [
        0, 1, 1, 2]
    assert softmax_pick([5, 5, 5], 1.0, 0.7) == 2  # equal logits: uniform
    hot = KvRouterPolicy(seed=3, router_temperature=1.0)
    request = make_request(9.0, prompt=1024, block_hashes=HASHES)
    cluster = make_cluster(*three(), hits={"A800": 32, "A40": 48})
    picks = [hot.choose(request, cluster, 0.0) for _ in range(50)]
    assert set(picks) == {"H800", "A800", "A40"}  # same request id: each re-route replaces


# --- session affinity ---------------------------------------------------------------


def sessions(n: int = 300):
    return [make_request(9.0, prompt=100, rid=f"q{j}", session_id=f"s{j}") for j in range(n)]


def placement(policy, views, requests) -> dict[str, str]:
    cluster = make_cluster(*views)
    return {r.session_id: policy.choose(r, cluster, 0.0) for r in requests}


def test_session_ring_moves_only_the_sessions_of_the_instance_that_left():
    policy = SessionAffinityPolicy()
    views = [make_view("H800", instance_id=f"e{k}") for k in range(4)]
    before = placement(policy, views, sessions())
    after = placement(policy, [v for v in views if v.instance_id != "e2"], sessions())
    moved = {s for s in before if before[s] != after[s]}
    assert moved and moved == {s for s in before if before[s] == "e2"}
    assert placement(policy, views, sessions()) == before  # it comes back: so do they


def test_session_ring_join_moves_sessions_only_onto_the_new_instance():
    policy = SessionAffinityPolicy()
    views = [make_view("H800", instance_id=f"e{k}") for k in range(4)]
    before = placement(policy, views, sessions())
    after = placement(policy, [*views, make_view("A40", instance_id="e4")], sessions())
    moved = {s for s in before if before[s] != after[s]}
    assert all(after[s] == "e4" for s in moved)
    assert 0.1 < len(moved) / len(before) < 0.35  # about 1/5 with 160 points per node


def test_session_whose_owner_cannot_hold_it_goes_where_it_would_if_the_owner_left():
    policy = SessionAffinityPolicy()
    views = [make_view("H800", instance_id=f"e{k}") for k in range(4)]
    owners = placement(policy, views, sessions(60))
    for request in sessions(60):
        owner = owners[request.session_id]
        tiny = [make_view("H800", instance_id=v.instance_id, total_blocks=1, free_blocks=1)
                if v.instance_id == owner else v for v in views]
        fallback = policy.choose(request, make_cluster(*tiny), 0.0)
        gone = policy.choose(
            request, make_cluster(*[v for v in views if v.instance_id != owner]), 0.0)
        assert fallback == gone != owner


def clockwise_from(key: str, nodes, vnodes: int) -> list[str]:
    """The ring walk by brute force: every point sorted, those after the key's hash
    first, then the rest, each node at its first appearance."""
    points = sorted((ring_point(f"{n}-{k}"), n) for n in nodes for k in range(vnodes))
    position = ring_point(key)
    clockwise = [n for p, n in points if p > position] + [n for p, n in points if p <= position]
    return list(dict.fromkeys(clockwise))


@pytest.mark.parametrize("vnodes", [2, 160])
def test_ring_walk_visits_nodes_in_the_brute_force_clockwise_order(vnodes: int):
    ring = HashRing(vnodes)
    for nodes in ([f"e{k}" for k in range(24)], [f"e{k}" for k in range(24) if k % 5],
                  [f"e{k}" for k in range(30)]):  # built, shrunk, then grown
        ring.sync(nodes)
        # with 2 points per node many keys wrap past the last point; with 160 a few
        # dozen keys already cross many nodes' arcs (the brute force is the slow part)
        for j in range(200 if vnodes == 2 else 40):
            assert list(ring.walk(f"s{j}")) == clockwise_from(f"s{j}", nodes, vnodes)


def test_requests_without_a_session_go_to_the_lowest_qps_instance():
    policy = SessionAffinityPolicy()
    cluster = make_cluster(*[make_view("H800", instance_id=i) for i in "abc"])
    lone = make_request(9.0, prompt=100)
    # never-routed instances first (view order), then fewest routed in the last 60 s;
    # at 61.5 s a's times 0 and 1 have left the window, b keeps 2 and c keeps 3
    times = [0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 61.5]
    assert [policy.choose(lone, cluster, t) for t in times] == list("abcabca")


# --- Preble ------------------------------------------------------------------------


def test_preble_e2_exploits_long_hits_and_explores_by_load_eviction_and_prefill():
    request = make_request(9.0, prompt=1024, rid="x", block_hashes=HASHES)
    # exploit: A40 caches 640 tokens > 384 missed, so the request joins A40's prefix
    assert PreblePolicy().choose(request, make_cluster(*three(), hits={"A40": 40}), 0) == "A40"

    policy = warmed_up_preble()
    # explore (A40 caches 480 < 544 missed): cost = L + M + P, prefill s/token from the
    # specs: H800 2.5196e-5, A800 7.5206e-5, A40 1.5803e-4; H800 TPOT 8.9365e-3
    # L(H800) = warm's prefill 1024 x 2.5196e-5 + 45 running tokens x 8.9365e-3 = .427943
    # H800 .427943 + 1024 x 2.5196e-5 = .453744; A800 1024 x 7.5206e-5 = .077010;
    # A40 544 x 1.5803e-4 = .085966 -> A800
    views, hits = three(), {"A40": 30}
    costs = [policy.cost_s(v, request, 16 * hits.get(v.instance_id, 0)) for v in views]
    assert costs == pytest.approx([0.453744, 0.077010, 0.085966], rel=1e-4)
    assert policy.choose(request, make_cluster(*views, hits=hits), 0.0) == "A800"
    # M: with 160 free KV tokens on A800, 864 of its 1024 missed tokens evict cached ones:
    # A800 (864 + 1024) x 7.5206e-5 = .141989 > A40's .085966
    policy = warmed_up_preble()
    full = three(A800={"free_blocks": 10})
    assert policy.cost_s(full[1], request, 0) == pytest.approx(0.141989, rel=1e-4)
    assert policy.choose(request, make_cluster(*full, hits=hits), 0.0) == "A40"


def warmed_up_preble() -> PreblePolicy:
    """A Preble with one 1024-token request running on H800 (its own prefix group)."""
    policy = PreblePolicy()
    warm = make_request(9.0, prompt=1024, rid="w", block_hashes=tuple(range(1000, 1064)))
    assert policy.choose(warm, make_cluster(make_view("H800")), 0.0) == "H800"
    return policy


def shared_prefix_requests(group: int, num: int):
    """Requests sharing a 768-token prefix (48 of 64 blocks), the first one alone."""
    prefix = tuple(range(1000 * group, 1000 * group + 64))
    first = make_request(9.0, prompt=1024, rid=f"g{group}-0", block_hashes=prefix)
    rest = [make_request(9.0, prompt=1024, rid=f"g{group}-{k}",
                         block_hashes=prefix[:48] + tuple(range(10**6 * (group + 1) + 16 * k,
                                                                10**6 * (group + 1) + 16 * k + 16)))
            for k in range(1, num)]
    return first, rest, prefix[47]


def route_five_groups_onto_a(policy: PreblePolicy) -> list:
    """100 requests in 5 prefix groups, all on `a` (20 per group, round robin)."""
    only_a = make_cluster(make_view("H800", instance_id="a"))
    both = make_cluster(make_view("H800", instance_id="a"), make_view("H800", instance_id="b"),
                        hits={"a": 48})
    groups = [shared_prefix_requests(g, 21) for g in range(5)]
    for first, _, _ in groups:
        assert policy.choose(first, only_a, 0.0) == "a"  # explores; alone
    for k in range(19):
        for _, rest, _ in groups:
            assert policy.choose(rest[k], both, 1.0) == "a"  # exploits a's cached prefix
    return groups


def test_preble_rebalances_groups_off_an_overloaded_instance():
    policy = PreblePolicy(seed=0)
    groups = route_five_groups_onto_a(policy)
    # the 100th request reaches 50 per instance: a carries five equal shared groups of
    # cost c, b none. a 5c >= 1.5 x 0: move the cheapest (first) -> a 4c, b c; 4c >= 1.5c
    # and 4c - c >= c + c: move the second -> a 3c, b 2c; 3c - c < 2c + c: stop
    allocation = {key: set(policy.load.allocation[key]) for _, _, key in groups}
    assert list(allocation.values()) == [{"b"}, {"b"}, {"a"}, {"a"}, {"a"}]
    both = make_cluster(make_view("H800", instance_id="a"), make_view("H800", instance_id="b"),
                        hits={"a": 48})
    # group 0 now goes to b although its prefix is cached on a
    assert policy.choose(groups[0][1][19], both, 2.0) == "b"


def test_preble_does_not_rebalance_before_fifty_requests_per_instance():
    policy = PreblePolicy(seed=0, min_routed_per_instance=51)  # 100 routed < 51 x 2
    groups = route_five_groups_onto_a(policy)
    assert all(policy.load.allocation[key] == {"a"} for _, _, key in groups)


def test_llm_d_latency_scorer_on_hand_computed_headrooms():
    # SLOs 1.0 s / 0.05 s; predicted TTFT .2 .6 .9 and TPOT .02 .03 .04:
    # |headroom| TTFT .8 .4 .1 (min .1, range .7) -> 1, .4286, 0
    #            TPOT .03 .02 .01 (min .01, range .02) -> 1, .5, 0
    # blend .8 TTFT + .2 TPOT -> 1, .4429, 0
    # "least": int(100 (1 - blend)) + 1 -> 1, 56, 101; "most": int(100 blend) + 1 -> 101, 45, 1
    headrooms = [(0.8, 0.03), (0.4, 0.02), (0.1, 0.01)]
    assert headroom_scores(headrooms, 0.8, 0.2, True) == [0.01, 0.56, 1.01]
    assert headroom_scores(headrooms, 0.8, 0.2, False) == [1.01, 0.45, 0.01]
    # equal TTFT headroom: its weight goes to TPOT; |.75 .5 .25| -> 1 - (1, .5, 0)
    assert headroom_scores([(0.3, 0.75), (0.3, 0.5), (0.3, 0.25)], 0.8, 0.2, True) == [
        0.01, 0.51, 1.01]


def endpoints_with(policy, predictions, request, views, dispatched=()):
    """Endpoints as the policy builds them, with the given (TTFT, TPOT) predictions."""
    class Fixed:
        def predict(self, features, now):
            return tuple(zip(*predictions, strict=True))

    for k, view in enumerate(views):
        if view.instance_id in dispatched:
            policy.choose(make_request(9.0, rid=f"busy{k}"), make_cluster(view), 0.0)
    policy.model = Fixed()
    return policy.endpoints(request, views, make_cluster(*views), 0.0)


def test_llm_d_negative_headroom_prefers_idle_then_the_least_severe_deficit():
    config = PredictedLatencyConfig()
    request = make_request(9.0, ttft_slo_s=0.5, tpot_slo_s=0.05)
    # H800 misses TTFT only, A800 misses TPOT only, A40 misses both; all busy
    predictions = [(0.7, 0.04), (0.3, 0.08), (0.9, 0.09)]
    busy = endpoints_with(PredictedLatencyPolicy(), predictions, request, three(),
                          dispatched={"H800", "A800", "A40"})
    assert [e.meets_slo for e in busy] == [False, False, False]
    scores = latency_scores(busy, config)
    assert scores[1] > 0 and scores[0] == scores[2] == 0  # the TPOT-only bucket wins
    idle = endpoints_with(PredictedLatencyPolicy(), predictions, request, three(),
                          dispatched={"H800", "A800"})
    assert [s > 0 for s in latency_scores(idle, config)] == [False, False, True]


def test_llm_d_prefix_affinity_sticks_unless_the_sticky_ttft_is_5s_worse():
    config = PredictedLatencyConfig(affinity_exploration_probability=0.0,
                                    epsilon_explore_negative=0.0)
    request = make_request(9.0, prompt=1024, block_hashes=HASHES, ttft_slo_s=3.0)
    views = three()[:2]
    cluster = make_cluster(*views, hits={"H800": 64})  # H800 caches it all: score 1 >= .99
    # sticky H800 at 1 s vs A800 at 2 s: H800 is kept alone, although "least" headroom
    # alone would pack onto A800 (headroom 1 s < 2 s); sticky at 7 s is > 5 s worse than
    # A800's 1 s: stickiness breaks, and the tier filter drops H800 (misses 3 s)
    for predictions, expected in (([(1.0, 0.01), (2.0, 0.01)], "H800"),
                                  ([(7.0, 0.01), (1.0, 0.01)], "A800")):
        policy = PredictedLatencyPolicy(config=config)
        endpoints_with(policy, predictions, request, views)
        assert policy.choose(request, cluster, 0.0) == expected


def test_llm_d_scores_the_cold_start_by_the_composite_fallback():
    views = [make_view("H800", waiting=4), make_view("A40", free_blocks=2_000)]
    policy = PredictedLatencyPolicy()
    endpoints = policy.endpoints(make_request(9.0), views, make_cluster(*views), 0.0)
    assert all(e.ttft_s is None for e in endpoints)
    # (free KV + queue relative to the longest + prefix score) / 3, rounded to 1/100:
    # H800 (.5 + 0 + 0) / 3 = .1667 -> .17; A40 (.1 + 1 + 0) / 3 = .3667 -> .37
    assert composite_scores(endpoints, policy.config) == [0.17, 0.37]


def test_llm_d_regressor_learns_and_the_headroom_filter_drops_the_endpoint_that_would_miss():
    config = PredictedLatencyConfig(epsilon_explore_negative=0.0,
                                    affinity_exploration_probability=0.0)
    policy = PredictedLatencyPolicy(seed=0, config=config)
    noise = random.Random(0)
    for k in range(120):  # TTFT = .05 + .1 x waiting +- .02, TPOT = .01 + .002 x waiting
        waiting = k % 16
        request = make_request(9.0, prompt=512, rid=f"t{k}")
        cluster = make_cluster(make_view("A40", instance_id="x", waiting=waiting))
        assert policy.choose(request, cluster, 0.0) == "x"
        ttft_s = 0.05 + 0.1 * waiting + noise.uniform(-0.02, 0.02)
        policy.on_first_token(request, "x", ttft_s, ttft_s)
        policy.on_finish(finish(request, "x", ttft_s, tpot_s=0.01 + 0.002 * waiting), 5.0)
    views = [make_view("A40", instance_id="slow", waiting=14),
             make_view("A40", instance_id="fast", waiting=1)]
    request = make_request(9.0, prompt=512, rid="probe", ttft_slo_s=0.8, tpot_slo_s=0.1)
    # the first fetch, at 10 s, brings a model fitted on all of them
    slow, fast = policy.endpoints(request, views, make_cluster(*views), 10.0)
    # p90 boosting lumps the lightly loaded levels (all below the running quantile share
    # one gradient), so the fast endpoint is over-predicted but still far below the slow
    assert slow.ttft_s == pytest.approx(1.45, abs=0.1)
    assert fast.ttft_s < 0.6 < slow.ttft_s - 0.8
    assert slow.tpot_s > fast.tpot_s
    assert not slow.meets_slo and fast.meets_slo
    assert {policy.choose(request, make_cluster(*views), 10.0) for _ in range(20)} == {"fast"}
    policy.config = replace(config, epsilon_explore_negative=1.0)  # always probe the misses
    assert policy.choose(request, make_cluster(*views), 10.0) == "slow"
    policy.on_drop(request, 11.0)  # forgotten: nothing in flight any more
    plain = make_request(9.0, prompt=512, rid="plain")
    endpoints = policy.endpoints(plain, views, make_cluster(*views), 11.0)
    assert [e.num_dispatched for e in endpoints] == [0, 0]
    # without SLOs the headroom is minus the prediction: the fast endpoint scores higher
    assert latency_scores(endpoints, config) == [0.01, 1.01]


def test_llm_d_sends_the_ttft_sample_at_the_first_token_and_the_tpot_at_the_finish():
    # llm-d's streaming mode trains TTFT at the first token
    # (processFirstTokenForLatencyPrediction); TPOT here is the finish's mean
    sent: list[tuple[float | None, float | None, float]] = []

    class Recording(OnlineLatencyModel):
        def add(self, features, ttft_s, tpot_s, now):
            sent.append((ttft_s, tpot_s, now))
            super().add(features, ttft_s, tpot_s, now)

    policy = PredictedLatencyPolicy(seed=0, model=Recording())
    cluster = make_cluster(make_view("A40", instance_id="x"))
    requests = [replace(make_request(9.0, prompt=512, rid=f"t{k}"), arrival_s=0.1 * k)
                for k in range(10)]
    for r in requests:
        policy.choose(r, cluster, r.arrival_s)
    for k, r in enumerate(requests):  # each first token .3 s after its arrival
        policy.on_first_token(r, "x", r.arrival_s + 0.3, 1.0 + 0.1 * k)
    assert sent == [(pytest.approx(0.3), None, pytest.approx(1.0 + 0.1 * k)) for k in range(10)]
    probe = make_request(9.0, prompt=512, rid="probe")
    # the fetch at 10 s fits the ten TTFTs: the endpoints have predictions before any finish
    assert policy.endpoints(probe, cluster.instances, cluster, 9.9)[0].ttft_s is None
    assert policy.endpoints(probe, cluster.instances, cluster, 10.0)[0].ttft_s is not None
    sent.clear()
    # 11 tokens, 10 gaps of .02 s after the first; a one-token request sends nothing
    policy.on_finish(finish(requests[0], "x", 0.3, num_output_tokens=11, tpot_s=0.02), 2.5)
    policy.on_finish(finish(requests[1], "x", 0.4, num_output_tokens=1), 2.6)
    assert sent == [(None, pytest.approx(0.02), 2.5)]


def test_llm_d_model_in_use_is_fitted_at_each_fetch_on_the_samples_received_before_it():
    # the prediction servers fetch the training server's model every
    # MODEL_SYNC_INTERVAL_SEC (here 1 s), fitted on all it holds once it holds 10;
    # between fetches the model of the last fetch answers
    model = OnlineLatencyModel(model_sync_interval_s=1.0)
    row = LatencyFeatures(kv_cache_percentage=0.5, input_token_length=512,
                          num_request_waiting=0, num_request_running=1,
                          prefill_tokens_in_flight=512, prefix_cache_score=0.0)
    for k in range(10):  # ten TTFTs of .1 s between 0.1 and 0.55 s
        model.add(row, 0.1, None, 0.1 + 0.05 * k)
    assert model.predict([row], 0.99) is None  # no tick since they came: still cold
    ttft, tpot = model.predict([row], 1.0)  # tick 1 fits them: p90 of ten .1 s is .1 s
    assert ttft[0] == pytest.approx(0.1) and tpot[0] == 0.0  # no TPOT sample yet
    for _ in range(30):
        model.add(row, 0.5, 0.02, 1.2)
    assert model.predict([row], 1.99)[0][0] == pytest.approx(0.1)  # tick 1's model
    # tick 2: TTFT p90 of 10 x .1 and 30 x .5 s is .5 s; TPOT p90 of 30 x .02 s
    ttft, tpot = model.predict([row], 2.0)
    assert ttft[0] == pytest.approx(0.5) and tpot[0] == pytest.approx(0.02)


def test_llm_d_fits_a_fetch_only_when_a_prediction_reads_its_model():
    # a fetch whose model no prediction reads before the next fetch is never fitted;
    # the one a prediction reads is fitted then, on the samples received before it
    fitted: list[int] = []

    class Counting(OnlineLatencyModel):
        def _fit(self, rows):
            fitted.append(len(rows))
            return super()._fit(rows)

    model = Counting(model_sync_interval_s=1.0)
    row = LatencyFeatures(kv_cache_percentage=0.5, input_token_length=512,
                          num_request_waiting=0, num_request_running=1,
                          prefill_tokens_in_flight=512, prefix_cache_score=0.0)
    for k in range(10):
        model.add(row, 0.1, None, 0.1 * k)
    for _ in range(20):  # tick 1 passes unread
        model.add(row, 0.5, None, 1.5)
    model.add(row, 0.5, None, 2.5)  # tick 2: the 30 samples before it are its model's
    assert fitted == []
    ttft, _ = model.predict([row], 2.6)
    assert fitted == [30, 0]  # TTFT on 30 samples; no TPOT sample
    assert ttft[0] == pytest.approx(0.5)  # p90 of 10 x .1 and 20 x .5 s
    model.predict([row], 2.9)  # tick 2's model again
    model.predict([row], 3.5)  # tick 3 holds one new sample: fitted anew
    assert fitted == [30, 0, 31, 0]
    model.predict([row], 4.5)  # tick 4 holds none: tick 3's model, no fit
    assert fitted == [30, 0, 31, 0]


# --- every peer ----------------------------------------------------------------------


PEERS = [PolicyKind.LLM_D, PolicyKind.PREBLE, PolicyKind.SESSION_AFFINITY,
         PolicyKind.DYNAMO_KV]


@pytest.mark.parametrize("kind", PEERS)
def test_every_peer_routes_only_where_the_request_fits(kind: PolicyKind):
    policy = make_policy(kind, seed=0)
    views = [make_view("A40", instance_id="i0", total_blocks=10, free_blocks=10),
             make_view("A40", instance_id="i1"),
             make_view("A40", instance_id="i2", total_blocks=10, free_blocks=10)]
    cluster = make_cluster(*views)
    for k in range(10):
        request = make_request(9.0, prompt=1000, rid=f"r{k}", session_id=f"s{k % 3}")
        assert policy.choose(request, cluster, float(k)) == "i1"
    decision = policy.choose(make_request(9.0, prompt=10**6), cluster, 10.0)
    assert isinstance(decision, Reject) and "no instance can hold" in decision.reason
    assert policy.deadline_aware == (kind is PolicyKind.LLM_D)
    assert not policy.needs_true_output_length


def test_specs_used_in_the_hand_computations():
    assert SPECS["H800"].unloaded_prefill_s_per_token == pytest.approx(2.5196e-5, rel=1e-4)
    assert SPECS["A800"].unloaded_prefill_s_per_token == pytest.approx(7.5206e-5, rel=1e-4)
    assert SPECS["A40"].unloaded_prefill_s_per_token == pytest.approx(1.5803e-4, rel=1e-4)
    assert SPECS["H800"].unloaded_decode_s_per_token == pytest.approx(8.9365e-3, rel=1e-4)
