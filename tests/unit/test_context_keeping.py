"""Keeping a session's KV through a tool wait (app/routing/context_keeping.py), and the
simulator pinning it where the keeper says so."""

from __future__ import annotations

import pytest

from app.hardware.specs import make_instance
from app.routing.context_keeping import ContextKeeper

pytestmark = pytest.mark.unit

A800 = make_instance("A800", "llama-3.1-8b")


def test_nothing_is_pinned_before_enough_waits_are_seen():
    keeper = ContextKeeper(min_seen=4)
    for _ in range(3):
        keeper.observe_wait("app", 2.0)
    assert keeper.keep_until("app", 8000, A800, now=10.0) is None
    keeper.observe_wait("app", 2.0)
    assert keeper.keep_until("app", 8000, A800, now=10.0) == pytest.approx(12.0)
    assert keeper.keep_until("other", 8000, A800, now=10.0) is None  # waits are per app


def test_a_pin_covers_the_quantile_of_the_waits_seen():
    keeper = ContextKeeper(quantile=0.75, min_seen=1)
    for wait_s in range(1, 101):  # 1..100 s
        keeper.observe_wait("app", float(wait_s))
    assert keeper.expected_wait_s("app") == pytest.approx(75.25)


def test_a_context_is_not_kept_when_holding_it_costs_more_than_recomputing_it():
    keeper = ContextKeeper(min_seen=1)
    keeper.observe_wait("app", 3.0)
    context = 20_000
    prefill_s = A800.solo_phases_s(context, 1)[0]
    held_s = 3.0 * context / A800.kv_capacity_tokens
    assert held_s < prefill_s and keeper.keep_until("app", context, A800, 0.0) == 3.0
    keeper = ContextKeeper(min_seen=1)
    keeper.observe_wait("app", 3600.0)  # an hour-long tool: the blocks are worth more
    assert keeper.keep_until("app", context, A800, 0.0) is None
    assert (keeper.num_pinned, keeper.num_declined) == (0, 1)


def test_the_simulator_pins_session_contexts_through_tool_waits():
    import app.sim.simulator as simulator
    from app.engines.config import load_cluster_config
    from app.experiments.replay import ReplaySpec, build_workload, context_limit_of, run_replay
    from app.routing.registry import PolicyKind, RoutingOptions
    from app.workloads.workload import Arrivals, ContentMode

    made: list[ContextKeeper] = []

    class Recorded(ContextKeeper):
        def __init__(self) -> None:
            super().__init__(min_seen=2)
            made.append(self)

    config = load_cluster_config("configs/paper-4gpu.yaml")
    work = build_workload(arrivals=Arrivals.POISSON, trace=None, prompts=None, rate=0.02,
                          duration_s=600, max_requests=None, seed=3,
                          content=ContentMode.CODING_AGENT,
                          context_limit=context_limit_of(config))
    spec = ReplaySpec(config.model_copy(update={"keep_session_kv": True}),
                      (PolicyKind.GOODSERVE,), (2.0,), seed=3, routing=RoutingOptions(3))
    original = simulator.ContextKeeper
    simulator.ContextKeeper = Recorded  # type: ignore[misc]
    try:
        (kept,) = run_replay(spec, work)
    finally:
        simulator.ContextKeeper = original  # type: ignore[misc]
    (keeper,) = made
    assert keeper.num_pinned > 0 and sum(len(w) for w in keeper._waits.values()) > 0
    assert kept.summary["requests"] == len(work.requests)


def test_a_live_serve_config_refuses_kept_kv():
    from app.engines.config import load_cluster_config
    from app.serving.config import ServeConfig

    cluster = load_cluster_config("configs/paper-4gpu.yaml")
    with pytest.raises(ValueError, match="keep_session_kv runs in the simulator only"):
        ServeConfig(cluster=cluster.model_copy(update={"keep_session_kv": True}))
