"""Baseline policies and the policy registry, on hand-built views (no simulator)."""

from __future__ import annotations

from collections import Counter

import pytest

from app.engines.config import EngineRole
from app.engines.messages import EngineStatus
from app.hardware.specs import make_instance
from app.routing.base import Reject
from app.routing.baselines import (
    LeastRequestPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from app.routing.instance_view import InstanceView
from app.routing.registry import POLICY_REGISTRY, SIM_ONLY, PolicyKind, make_policy
from app.routing.view import ClusterView, RouteRequest

pytestmark = pytest.mark.unit

SPEC = make_instance("A40", "llama-3.1-8b")


def make_view(loads: list[int], kv_blocks: list[int] | None = None) -> ClusterView:
    kv_blocks = kv_blocks or [10_000] * len(loads)
    views = tuple(
        InstanceView(
            instance_id=f"i{k}", spec=SPEC, role=EngineRole.UNIFIED, num_waiting=load,
            num_running=0, num_kv_blocks_free=blocks, num_kv_blocks=blocks, kv_block_size=16,
            num_iterations=0, recent_iteration_s=(), recent_queue_wait_s=(), updated_s=0.0,
        )
        for k, (load, blocks) in enumerate(zip(loads, kv_blocks, strict=True))
    )
    return ClusterView(0.0, views, lambda iid, hashes: 0)


def request(num_prompt_tokens: int = 100) -> RouteRequest:
    return RouteRequest("r", 0.0, 10.0, num_prompt_tokens)


def test_least_request_picks_the_emptiest_and_breaks_ties_randomly() -> None:
    policy = LeastRequestPolicy(seed=0)
    assert policy.choose(request(), make_view([3, 1, 2]), 0.0) == "i1"
    picks = Counter(policy.choose(request(), make_view([0, 5, 0]), 0.0) for _ in range(200))
    assert set(picks) == {"i0", "i2"}


def test_p2c_takes_the_less_loaded_of_two_samples() -> None:
    policy = PowerOfTwoPolicy(seed=1)
    picks = Counter(policy.choose(request(), make_view([9, 0, 9, 9]), 0.0) for _ in range(400))
    # the idle instance wins whenever it is sampled: 1 - (3/4 * 2/3) = 1/2 of the time
    assert 150 < picks["i1"] < 250
    assert policy.choose(request(), make_view([4]), 0.0) == "i0"


def test_round_robin_cycles_in_view_order() -> None:
    policy = RoundRobinPolicy()
    view = make_view([5, 5, 5])
    assert [policy.choose(request(), view, 0.0) for _ in range(5)] == [
        "i0", "i1", "i2", "i0", "i1"]


def test_random_is_seeded_and_covers_instances() -> None:
    view = make_view([0] * 4)

    def picks(seed: int) -> list[str]:
        policy = RandomPolicy(seed=seed)
        return [policy.choose(request(), view, 0.0) for _ in range(100)]

    assert picks(7) == picks(7) != picks(8)
    assert set(picks(7)) == {"i0", "i1", "i2", "i3"}


LOAD_BALANCERS = [
    PolicyKind.RANDOM, PolicyKind.P2C, PolicyKind.ROUND_ROBIN, PolicyKind.LEAST_REQUEST,
    PolicyKind.PREFIX_CACHE, PolicyKind.LOWEST_TPM, PolicyKind.PREBLE, PolicyKind.LLUMNIX,
]


@pytest.mark.parametrize("kind", LOAD_BALANCERS)
def test_every_baseline_skips_instances_that_cannot_hold_it(kind: PolicyKind) -> None:
    policy = make_policy(kind, seed=0)
    view = make_view([0, 9, 0], kv_blocks=[10, 10_000, 10])  # 160 tokens on i0 and i2
    assert all(policy.choose(request(1000), view, 0.0) == "i1" for _ in range(10))
    decision = policy.choose(request(10**6), view, 0.0)
    assert isinstance(decision, Reject) and "no instance can hold" in decision.reason
    assert not policy.deadline_aware and not policy.needs_true_output_length


def test_registry_builds_fresh_policies_from_names() -> None:
    assert PolicyKind.from_str(" Round-Robin ") is PolicyKind.ROUND_ROBIN
    a, b = make_policy("p2c", seed=3), POLICY_REGISTRY.get(PolicyKind.P2C, seed=3)
    assert isinstance(a, PowerOfTwoPolicy) and a is not b
    assert set(POLICY_REGISTRY.kinds(include_ablations=True)) == set(PolicyKind)
    assert PolicyKind.GOODSERVE_NO_MIGRATION not in POLICY_REGISTRY.kinds()
    with pytest.raises(ValueError, match="unknown policy 'nope'; known: goodserve, "
                       "goodserve-exact-lengths, random"):
        make_policy("nope")
    assert PolicyKind.from_str("oracle") is PolicyKind.GOODSERVE_EXACT  # its earlier name


def test_instance_view_from_an_engine_status_report() -> None:
    status = EngineStatus(
        engine_id="e1", gpu_type="A40", role="unified", num_waiting=2, num_running=3,
        recent_iteration_s=(0.02,), recent_queue_wait_s=(0.1,), num_kv_blocks_used=10,
        num_kv_blocks_free=90, num_cached_prefix_blocks=0, time_s=4.0, num_iterations=7,
    )
    view = InstanceView.from_status(status, SPEC)
    assert (view.num_outstanding, view.kv_capacity_tokens, view.kv_free_tokens) == (5, 1600, 1440)
    assert view.num_iterations == 7 and view.gpu_type == "A40" and view.updated_s == 4.0


def test_sim_only_lists_exactly_the_policies_that_read_true_lengths() -> None:
    """The live backends refuse SIM_ONLY up front; a policy missing from it would
    fail only when its first request arrives."""
    for kind in POLICY_REGISTRY.kinds(include_ablations=True):
        policy = POLICY_REGISTRY.build(kind).policy
        assert (kind in SIM_ONLY) == policy.needs_true_output_length, kind
