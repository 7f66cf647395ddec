"""Defining behaviour of the prefix-cache, Preble, lowest-TPM and Llumnix baselines."""

from __future__ import annotations

import pytest

from app.routing.base import ActiveRequest, Reject
from app.routing.cache_aware import PreblePolicy, PrefixCachePolicy
from app.routing.load_aware import LlumnixBalancer, LlumnixPolicy, LowestTpmPolicy
from app.routing.view import FinishReport
from tests.unit.routing_utils import make_cluster, make_request, make_view

pytestmark = pytest.mark.unit

HASHES = tuple(range(64))  # 64 blocks x 16 tokens = a 1024-token prompt


def three(**kw):
    return [make_view(g, **kw.get(g, {})) for g in ("H800", "A800", "A40")]


def test_prefix_cache_prefers_the_longest_hit():
    policy = PrefixCachePolicy(seed=1)
    cluster = make_cluster(*three(), hits={"A800": 40, "A40": 60})
    assert policy.choose(make_request(9.0, prompt=1024, block_hashes=HASHES), cluster, 0) == "A40"


def test_prefix_cache_falls_back_to_least_loaded_without_a_good_hit_or_when_imbalanced():
    policy = PrefixCachePolicy(seed=1)
    views = three(H800={"running": 5}, A800={"running": 1}, A40={"running": 3})
    request = make_request(9.0, prompt=1024, block_hashes=HASHES)
    assert policy.choose(request, make_cluster(*views, hits={"A40": 10}), 0) == "A800"
    skewed = three(H800={"running": 1}, A800={"running": 4}, A40={"running": 20})
    assert policy.choose(request, make_cluster(*skewed, hits={"A40": 64}), 0) == "H800"


def test_preble_exploits_long_hits_and_explores_by_cost_otherwise():
    policy = PreblePolicy(seed=0)
    request = make_request(9.0, prompt=1024, block_hashes=HASHES)
    assert policy.choose(request, make_cluster(*three(), hits={"A40": 40}), 0) == "A40"
    # short hit -> cost = missed prefill + queued work; the idle fast H800 wins
    views = three(H800={"running": 0}, A800={"running": 30}, A40={"running": 30})
    assert policy.choose(request, make_cluster(*views, hits={"A40": 10}), 0) == "H800"


def test_lowest_tpm_spreads_tokens_and_forgets_after_a_minute():
    policy = LowestTpmPolicy(seed=0)
    cluster = make_cluster(*three())
    chosen = [policy.choose(make_request(9.0, prompt=500, rid=f"r{i}"), cluster, 0.0)
              for i in range(3)]
    assert sorted(chosen) == ["A40", "A800", "H800"]
    policy.on_finish(FinishReport(make_request(9.0), "A40", 5000, 0.1, 1.0), 1.0)
    assert policy.choose(make_request(9.0, prompt=500), cluster, 2.0) != "A40"
    assert policy.tokens_per_window("A40", 120.0) == 0


def test_llumnix_picks_most_free_virtual_memory():
    policy = LlumnixPolicy(seed=0)
    views = three(H800={"free_blocks": 5000}, A800={"free_blocks": 9000},
                  A40={"free_blocks": 9500, "running": 2, "waiting": 6})
    # A40 has the most free blocks now, but its queue will claim them
    assert policy.choose(make_request(9.0), make_cluster(*views), 0) == "A800"


def test_llumnix_balancer_moves_shortest_request_to_emptiest_instance():
    dog = LlumnixBalancer(imbalance_threshold=0.3)
    views = three(H800={"free_blocks": 19000}, A800={"free_blocks": 15000},
                  A40={"free_blocks": 2000, "running": 2})
    long_ = ActiveRequest(make_request(9.0, prompt=4000, rid="long"), "A40", 10, True)
    short = ActiveRequest(make_request(9.0, prompt=300, rid="short"), "A40", 10, True)
    assert dog.check("A40", [long_, short], make_cluster(*views), 0.0) == {"short": "H800"}
    assert dog.check("A800", [long_, short], make_cluster(*views), 0.0) == {}


def test_baselines_reject_what_no_instance_can_hold():
    huge = make_request(9.0, prompt=10_000_000)
    cluster = make_cluster(*three())
    for policy in (PrefixCachePolicy(), PreblePolicy(), LowestTpmPolicy(), LlumnixPolicy()):
        assert isinstance(policy.choose(huge, cluster, 0.0), Reject)
