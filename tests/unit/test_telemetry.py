"""What the router, controller and dashboards export: each event moves the series it
should, and every dashboard query names a series that exists."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from app.control.controller import ControlStep
from app.control.observe import IntervalStats
from app.control.plan import EngineRecord, EngineState, PlanDiff
from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup
from app.planning.inventory import PoolTargets, Stock
from app.planning.split import EngineKind
from app.routing.registry import build_routing
from app.routing.view import RouteRequest
from app.serving.config import ServeConfig
from app.serving.live_router import EngineLost, LiveRouter, RequestRejected
from app.serving.service import CompletionService
from app.serving.telemetry import ControllerMetrics, MigrationReason, Outcome, RouterMetrics
from deployments.dashboards import DASHBOARDS, GRAFANA_DIR, all_queries, dashboard_json
from tests.unit.metrics_utils import RecordingFactory
from tests.unit.test_live_router import ScriptedEngine, body, drain, request

pytestmark = pytest.mark.unit


def test_a_finished_request_is_met_missed_or_best_effort_with_its_slack_and_error():
    factory = RecordingFactory()
    metrics = RouterMetrics(factory, policy="goodserve")
    met = metrics.finished(arrival_s=0.0, deadline_s=10.0, first_token_s=0.5, end_s=4.0,
                           num_output_tokens=100, predicted_output_tokens=150,
                           num_prompt_tokens=300, num_cached_tokens=256)
    missed = metrics.finished(arrival_s=0.0, deadline_s=2.0, first_token_s=None, end_s=5.0,
                              num_output_tokens=50, predicted_output_tokens=20,
                              num_prompt_tokens=40)
    best = metrics.finished(arrival_s=1.0, deadline_s=float("inf"), first_token_s=1.2,
                            end_s=2.0, num_output_tokens=10, predicted_output_tokens=None,
                            num_prompt_tokens=5)
    assert (met, missed, best) == (Outcome.MET, Outcome.MISSED, Outcome.BEST_EFFORT)
    requests = factory["goodserve_requests"]
    for outcome in ("met", "missed", "best_effort"):
        assert requests.get(outcome=outcome, reason="") == [1.0]
    assert factory["goodserve_deadline_slack_seconds"].get(outcome="met") == [6.0]
    assert factory["goodserve_deadline_slack_seconds"].get(outcome="missed") == [3.0]
    assert factory["goodserve_request_deadline_seconds"].get() == [10.0, 2.0]
    assert factory["goodserve_goodput_tokens"].get() == [100.0]  # the met request's only
    assert factory["goodserve_output_tokens"].get(outcome="missed") == [50.0]
    assert factory["goodserve_prompt_tokens"].get(outcome="met") == [300.0]
    assert factory["goodserve_cached_prompt_tokens"].get() == [256.0]
    assert factory["goodserve_ttft_seconds"].get() == [0.5, pytest.approx(0.2)]
    errors = factory["goodserve_output_length_error_tokens"]
    assert errors.get(direction="over") == [50] and errors.get(direction="under") == [30]
    assert factory["goodserve_output_length_ratio"].get() == [1.5, 0.4]


async def test_the_live_router_counts_outcomes_rejections_moves_and_instance_state():
    factory = RecordingFactory()
    a, b = ScriptedEngine("a", "A40"), ScriptedEngine("b", "H800", fail_at=3)
    router = LiveRouter([a, b], build_routing("goodserve-admission"), poll_interval_s=3600,
                        metrics=RouterMetrics(factory, "goodserve-admission"))
    await router.start()
    running = factory["goodserve_instance_running"]
    assert running.get(instance="a", gpu_type="A40", role="unified") == [0]
    assert factory["goodserve_instance_healthy"].get(
        instance="b", gpu_type="H800", role="unified") == [1.0]
    assert factory["goodserve_instance_decode_seconds_per_token"].get(
        instance="b", gpu_type="H800", role="unified")[0] > 0

    with pytest.raises(RequestRejected):
        await router.submit(request("late", max_tokens=500, slo_s=0.001))
    requests = factory["goodserve_requests"]
    assert requests.get(outcome="rejected", reason="slo_unattainable") == [1.0]

    router.instances["b"].healthy = False  # place it on a
    flight = await router.submit(request("ok", max_tokens=30, slo_s=60.0))
    router.instances["b"].healthy = True
    assert flight.instance_id == "a"
    tags = router.instances["a"].tags
    assert factory["goodserve_routing_decisions"].get(policy="goodserve-admission",
                                                      **tags) == [1.0]
    assert len(factory["goodserve_routing_decision_seconds"].get(
        policy="goodserve-admission")) == 1
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        if len(events) == 2:
            assert router.migrate("ok") == "b"  # operator move; b fails: a failover to a
    assert flight.placement.instance_ids == ["a", "b", "a"]
    assert requests.get(outcome="met", reason="") == [1.0]
    moves = factory["goodserve_migrations"]
    assert moves.get(reason=MigrationReason.OPERATOR, path="token-ids") == [1.0]
    assert moves.get(reason=MigrationReason.FAILURE, path="token-ids") == [1.0]

    router.instances["a"].healthy = False  # only b, which fails at token 3: lost
    router.instances["b"].healthy = True
    lost = await router.submit(request("lost", slo_s=60.0))
    with pytest.raises(EngineLost):
        await drain(router, lost)
    router.instances["a"].healthy = True
    assert requests.get(outcome="error", reason="") == [1.0]

    gone = await router.submit(request("gone", max_tokens=200, slo_s=60.0))
    stream = router.stream(gone)
    await anext(stream)
    await stream.aclose()  # the client went away
    await asyncio.sleep(0.01)
    assert requests.get(outcome="cancelled", reason="") == [1.0]
    router.close()


SLOW_PREDICTION_S = 0.05


async def slow_predict(route: RouteRequest) -> float:
    """A predictor whose micro-batch wait is long next to any policy's time."""
    await asyncio.sleep(SLOW_PREDICTION_S)
    return 20.0


async def test_arrival_to_placement_includes_the_prediction_wait_and_the_policy():
    factory = RecordingFactory()
    router = LiveRouter([ScriptedEngine("a", "A40")], build_routing("goodserve"),
                        predict=slow_predict, poll_interval_s=3600,
                        metrics=RouterMetrics(factory, "goodserve"))
    await router.start()
    await drain(router, await router.submit(request("r", slo_s=60.0)))
    [policy_s] = factory["goodserve_routing_decision_seconds"].get(policy="goodserve")
    [placed_s] = factory["goodserve_routing_arrival_to_placement_seconds"].get(
        policy="goodserve")
    assert placed_s >= SLOW_PREDICTION_S + policy_s
    router.close()


async def test_arrival_to_placement_starts_when_the_replica_received_the_request():
    """The service passes the arrival it is given (the deployment's, before the body is
    read) to the router, so time spent before `complete` counts too."""
    factory = RecordingFactory()
    cluster = ClusterConfig(groups=[InstanceGroup(engine=EngineConfig(gpu_type="A40"))])
    service = CompletionService(ServeConfig(cluster=cluster), [ScriptedEngine("a", "A40")],
                                metrics=factory)
    service.router.predict = slow_predict
    received = time.perf_counter()
    await asyncio.sleep(0.02)  # the body on its way
    reply = await service.complete(body(), chat=False, received_perf_s=received)
    assert reply.status_code == 200
    [placed_s] = factory["goodserve_routing_arrival_to_placement_seconds"].get(
        policy="goodserve")
    assert placed_s >= 0.02 + SLOW_PREDICTION_S
    service.close()


def kind(gpu: str) -> EngineKind:
    return EngineKind(gpu)


def test_a_control_step_exports_targets_held_engines_cost_and_changes():
    h800, a40 = kind("H800"), kind("A40")
    targets = PoolTargets(12.0, {"unified": {h800: 2}}, 7.0, True)
    diff = PlanDiff(start=(("unified", h800),), drain=("e-a40",))
    stats = IntervalStats(0.0, 10.0, 100, 90, 80, 512.0, 0.5, 128.0)
    step = ControlStep(stats, 11.0, targets, diff)
    engines = [EngineRecord("e-h800", "unified", h800, EngineState.ACTIVE, 0.0),
               EngineRecord("e-a40", "unified", a40, EngineState.DRAINING, 0.0)]
    stock = [Stock(h800, 4, 3.5), Stock(a40, 4, 0.8)]
    figures = step.figures(engines, stock, budget_per_hour=12.0)
    assert figures["targets"] == {("unified", "H800"): 2, ("unified", "A40"): 0}
    held = figures["engines"]
    assert held[("unified", "H800", "active")] == 1 and held[("unified", "A40", "draining")] == 1
    assert held[("unified", "H800", "starting")] == 0  # states without engines read 0
    assert figures["cost"] == pytest.approx(4.3) and figures["target_cost"] == 7.0
    assert figures["changes"] == {"start": 1, "drain": 1, "reactivate": 0, "stop": 0,
                                  "migrate": 0}
    assert figures["binding"] == "rate"

    factory = RecordingFactory()
    ControllerMetrics(factory).step(**figures)
    assert factory["goodserve_pool_target_engines"].get(role="unified", gpu_type="A40") == [0]
    assert factory["goodserve_pool_binding_constraint"].get(constraint="rate") == [1.0]
    assert factory["goodserve_pool_binding_constraint"].get(constraint="budget") == [0.0]
    assert factory["goodserve_plan_changes"].get(action="start") == [1.0]
    assert factory["goodserve_plan_changes"].get(action="stop") == []  # no zero increments


SERIES = re.compile(r"ray_(goodserve_\w+?)(_bucket|_total)?\b")


def test_every_dashboard_query_names_a_series_the_product_exports():
    factory = RecordingFactory()
    RouterMetrics(factory)
    ControllerMetrics(factory)
    queries = all_queries()
    assert len(queries) >= 30
    for uid, title, expr in queries:
        names = SERIES.findall(expr)
        assert names, (uid, title, expr)
        for name, suffix in names:
            instrument = factory.instruments.get(name)
            assert instrument is not None, f"{uid} / {title}: no series {name}"
            expected = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
            assert suffix == expected[instrument.kind], (expr, instrument.kind)
    exported = {name for name in factory.instruments}
    shown = {name for _, _, expr in queries for name, _ in SERIES.findall(expr)}
    assert exported - shown == set(), "every exported series is on a dashboard"


def test_committed_dashboards_are_what_the_code_generates():
    for dashboard in DASHBOARDS:
        committed = json.loads((GRAFANA_DIR / dashboard.file_name).read_text())
        assert committed == dashboard_json(dashboard), (
            f"{dashboard.file_name} is stale: run `goodserve dashboards generate`")
        assert committed["uid"] == dashboard.uid and committed["panels"]
        for panel in committed["panels"]:
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])
