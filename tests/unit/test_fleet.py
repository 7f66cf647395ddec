"""Several router replicas on one fleet: spreading, each replica's view (its own
placements at once, the others' at its reports), what they share, their watchdogs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from app.routing.base import ActiveRequest, RoutingPolicy, Watchdog
from app.routing.fleet import FleetConfig, RouterFleet, Sharing, Spread
from app.routing.goodserve import JustEnoughPolicy
from app.routing.instance_view import InstanceId
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.routing.view import ClusterView, FinishReport, RouteRequest
from app.sim.simulator import Simulator
from app.workloads.workload import Content, poisson_workload
from tests.unit.routing_utils import make_cluster, make_request, make_view

pytestmark = pytest.mark.unit


class Recorder(RoutingPolicy):
    """Sends every request to `target` and keeps the views, first tokens and finishes it
    was given."""

    def __init__(self, target: InstanceId = "A800") -> None:
        self.target = target
        self.views: list[ClusterView] = []
        self.first_tokens: list[tuple[str, InstanceId, float]] = []
        self.finished: list[str] = []

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> InstanceId:
        self.views.append(view)
        return self.target

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        self.first_tokens.append((request.request_id, instance_id, first_token_s))

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.finished.append(report.request.request_id)


class MoveAll(Watchdog):
    """Moves every request it is shown to `target`; keeps what it was shown."""

    def __init__(self, target: InstanceId) -> None:
        super().__init__(1)
        self.target = target
        self.shown: list[str] = []

    def check(self, instance_id: InstanceId, active: Sequence[ActiveRequest],
              view: ClusterView, now: float) -> Mapping[str, InstanceId]:
        self.shown += [a.request.request_id for a in active]
        return {a.request.request_id: self.target for a in active}


def engines(now: float, a800: tuple[int, int] = (0, 0), h800: tuple[int, int] = (0, 0)):
    """The engines' true state: (running, waiting) per instance."""
    view = make_cluster(make_view("A800", running=a800[0], waiting=a800[1]),
                        make_view("H800", running=h800[0], waiting=h800[1]))
    return replace(view, time_s=now)


def counts(view: ClusterView, iid: str = "A800") -> tuple[int, int]:
    v = view.get(iid)
    return v.num_running, v.num_waiting


def fleet(*policies: RoutingPolicy, sharing: Sharing = Sharing.REPORTS,
          spread: Spread = Spread.RANDOM, watchdogs=None) -> RouterFleet:
    watchdogs = watchdogs or [None] * len(policies)
    config = FleetConfig(len(policies), spread, sharing, report_interval_s=1.0)
    return RouterFleet(list(zip(policies, watchdogs, strict=True)), config, seed=0)


def test_one_router_is_the_plain_policy_and_several_are_a_fleet():
    assert isinstance(build_routing(PolicyKind.GOODSERVE).policy, JustEnoughPolicy)
    stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(3), FleetConfig(4))
    assert isinstance(stack.policy, RouterFleet) and len(stack.policy.replicas) == 4
    assert stack.watchdog is stack.policy.watchdog is not None
    statuses = {id(r.policy.status) for r in stack.policy.replicas}
    assert len(statuses) == 4
    with pytest.raises(ValueError, match="routers"):
        FleetConfig(0)
    with pytest.raises(ValueError, match="report interval"):
        FleetConfig(2, report_interval_s=0.0)


@pytest.mark.parametrize("sharing", [Sharing.REPORTS, Sharing.BUDGETS, Sharing.LEARNING])
def test_sharing_budgets_tells_each_replica_the_others_smallest_slack_at_its_report(sharing):
    stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(0),
                          FleetConfig(2, sharing=sharing, report_interval_s=1.0))
    router = stack.policy
    first, second = router.replicas  # reports at 0, 1, 2 s and at 0.5, 1.5 s
    first.budgets.admit("A800", "tight", 0.05)
    first.budgets.admit("A800", "loose", 3.0)
    second.budgets.admit("H800", "theirs", 1.0)
    router.refresh(first, engines(0.0))  # the first tells 0.05 on the A800
    assert first.budgets.shortest_stall_s("H800") == math.inf  # the second told nothing yet
    router.refresh(second, engines(0.6))
    shared = sharing is not Sharing.REPORTS
    assert second.budgets.shortest_stall_s("A800") == (0.05 if shared else math.inf)
    assert list(second.budgets.shortest_stalls(["A800", "H800"])) == (
        [0.05, 1.0] if shared else [math.inf, 1.0])
    assert second.budgets.own_shortest_stalls() == {"H800": 1.0}  # it tells only its own
    first.budgets.remove("tight")  # known to the second at the first's next report
    router.refresh(first, engines(1.1))
    router.refresh(second, engines(1.6))
    assert second.budgets.shortest_stall_s("A800") == (3.0 if shared else math.inf)
    assert first.budgets.shortest_stall_s("H800") == (1.0 if shared else math.inf)


@pytest.mark.parametrize("sharing", [Sharing.BUDGETS, Sharing.LEARNING])
def test_learning_replicas_take_each_others_finishes_at_their_next_report(sharing):
    """A replica's length estimator learns from the requests another replica placed
    once that finish has reached it (its next report), and only with LEARNING."""
    stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(0),
                          FleetConfig(2, sharing=sharing, report_interval_s=1.0))
    router = stack.policy
    first, second = router.replicas  # reports at 0, 1, 2 s and at 0.5, 1.5 s
    router.refresh(first, engines(0.0))
    router.refresh(second, engines(0.6))
    request = make_request(10.0, rid="theirs", session_id="chat-1")
    router.choose_on(first, replace(request, prompt="a long prompt"), engines(0.7), 0.7)
    report = FinishReport(replace(request, prompt="a long prompt"), "A800", 321, 0.8, 0.9)
    router.on_finish(report, 0.9)

    def learned() -> list[float]:  # its running history of finished lengths
        return second.policy.length._lengths.sorted.tolist()

    assert list(first.policy.length._lengths.sorted) == [321] and learned() == []
    router.refresh(second, engines(1.2))  # not yet its report time (1.5 s)
    assert learned() == []
    router.refresh(second, engines(1.6))
    assert learned() == ([321] if sharing is Sharing.LEARNING else [])
    router.refresh(first, engines(2.1))  # its own finish is not learned twice
    assert list(first.policy.length._lengths.sorted) == [321]


def test_session_spread_keeps_a_session_on_one_replica_and_random_uses_them_all():
    policies = [Recorder() for _ in range(4)]
    router = fleet(*policies, spread=Spread.SESSION)
    for step in range(5):
        router.choose(make_request(10.0, rid=f"s{step}", session_id="chat-7"), engines(0.0), 0.0)
    assert sorted(len(p.views) for p in policies) == [0, 0, 0, 5]
    policies = [Recorder() for _ in range(4)]
    router = fleet(*policies)
    for i in range(200):
        router.choose(make_request(10.0, rid=f"r{i}", session_id="chat-7"), engines(0.0), 0.0)
    assert all(30 < len(p.views) < 70 for p in policies)


def _session_of(router: RouterFleet, index: int) -> str:
    """A session id the session spread sends to replica `index`."""
    return next(f"s{n}" for n in range(100) if router.replica_for(
        make_request(1.0, rid="probe", session_id=f"s{n}")) is router.replicas[index])


def test_a_replica_sees_its_own_placements_at_once_and_the_others_at_its_next_report():
    first, second = Recorder(), Recorder()
    router = fleet(first, second, spread=Spread.SESSION)  # reports: 0, 1, 2 s and 0.5, 1.5 s
    to_first, to_second = _session_of(router, 0), _session_of(router, 1)
    placed = [0]

    def place(rid: str, session: str, now: float) -> None:
        """One request; the engines hold every request placed before it (waiting)."""
        router.choose(make_request(10.0, rid=rid, session_id=session),
                      engines(now, a800=(0, placed[0])), now)
        placed[0] += 1

    for i in range(3):  # the first replica reports at 0 s: it sees all there is
        place(f"a{i}", to_first, 0.0)
    assert counts(first.views[-1]) == (0, 2)
    for i in range(4):  # the second has not reported yet: the first's three are hidden
        place(f"b{i}", to_second, 0.2)
    assert counts(second.views[-1]) == (0, 3)
    place("b-late", to_second, 0.7)  # after its report at 0.5 s it sees all 7
    assert counts(second.views[-1]) == (0, 7)
    place("a-late", to_first, 0.9)  # the first's next report is at 1 s: 5 still hidden
    assert counts(first.views[-1]) == (0, 8 - 5)
    place("a-later", to_first, 1.1)
    assert counts(first.views[-1]) == (0, 9)


def test_a_request_that_left_since_a_replicas_report_stays_in_its_view_until_the_next():
    first, second = Recorder(), Recorder()
    router = fleet(first, second, spread=Spread.SESSION)  # reports: 0, 1 s and 0.5, 1.5 s
    to_first, to_second = _session_of(router, 0), _session_of(router, 1)
    router.choose(make_request(10.0, rid="p0", session_id=to_first), engines(0.0), 0.0)
    router.choose(make_request(10.0, rid="x", session_id=to_second), engines(0.6, a800=(1, 0)),
                  0.6)
    router.choose(make_request(10.0, rid="p1", session_id=to_first),
                  engines(1.1, a800=(2, 0)), 1.1)  # its report at 1 s saw p0 and x
    assert counts(first.views[-1]) == (2, 0)
    router.on_finish(FinishReport(make_request(10.0, rid="x"), "A800", 5, 0.7, 1.2), 1.2)
    router.choose(make_request(10.0, rid="p2", session_id=to_first),
                  engines(1.3, a800=(2, 0)), 1.3)  # x left after its report: still counted
    assert counts(first.views[-1]) == (3, 0)
    router.choose(make_request(10.0, rid="p3", session_id=to_first),
                  engines(2.1, a800=(3, 0)), 2.1)  # its report at 2 s: x is gone
    assert counts(first.views[-1]) == (3, 0)


def test_with_nothing_shared_a_replica_counts_only_its_own_requests():
    first, second = Recorder(), Recorder()
    router = fleet(first, second, sharing=Sharing.NOTHING)
    for i in range(20):  # the engines hold every earlier request, as waiting
        router.choose(make_request(10.0, rid=f"r{i}"), engines(3.0 * i, a800=(0, i)), 3.0 * i)
    for p in (first, second):
        assert sum(counts(p.views[-1])) == len(p.views) - 1


def test_a_finish_reaches_the_replica_that_placed_it_and_frees_its_count():
    first, second = Recorder(), Recorder()
    router = fleet(first, second)
    request = make_request(10.0, rid="done")
    router.choose(request, engines(0.0), 0.0)
    owner = router.owner["done"]
    assert owner.own["A800"] == 1
    router.on_finish(FinishReport(request, "A800", 10, 0.1, 0.5), 0.5)
    assert owner.own["A800"] == 0 and "done" not in router.owner
    finished = [p.finished for p in (first, second)]
    assert sorted(finished) == [[], ["done"]]


def test_a_first_token_reaches_only_the_replica_that_placed_it():
    policies = [Recorder(), Recorder(), Recorder()]
    router = fleet(*policies)
    requests = [make_request(10.0, rid=f"r{i}") for i in range(12)]
    for r in requests:
        router.choose(r, engines(0.0), 0.0)
    owners = {rid: o.policy for rid, o in router.owner.items()}
    assert len(set(map(id, owners.values()))) > 1  # spread over several replicas
    for k, r in enumerate(requests):
        router.on_first_token(r, "A800", 0.1 * k, 0.1 * k)
    router.on_first_token(make_request(10.0, rid="unknown"), "A800", 2.0, 2.0)
    for p in policies:
        assert p.first_tokens == [(r.request_id, "A800", pytest.approx(0.1 * k))
                                  for k, r in enumerate(requests)
                                  if owners[r.request_id] is p]
    assert router.owner.keys() == owners.keys()  # still placed until they finish


def test_each_replicas_watchdog_checks_only_the_requests_it_placed():
    policies, watchdogs = [Recorder(), Recorder()], [MoveAll("H800"), MoveAll("H800")]
    router = fleet(*policies, watchdogs=watchdogs)
    requests = [make_request(10.0, rid=f"r{i}") for i in range(10)]
    for r in requests:
        router.choose(r, engines(0.0), 0.0)
    owners = dict(router.owner)
    active = [ActiveRequest(r, "A800", 3, True) for r in requests]
    moves = router.watchdog.check("A800", active, engines(0.1), 0.1)
    assert moves == {r.request_id: "H800" for r in requests}
    for replica in router.replicas:
        shown = set(replica.watchdog.shown)
        assert shown == {rid for rid, o in owners.items() if o is replica}
        assert replica.own["A800"] == 0 and replica.own["H800"] == len(shown)


def test_a_simulated_fleet_serves_every_request():
    pool = [Content(200 + 30 * (i % 9), 40 + 10 * (i % 5), (i,)) for i in range(100)]
    workload = poisson_workload(40.0, 10.0, pool, seed=1)
    from app.engines.config import load_cluster_config

    cluster = load_cluster_config(Path(__file__).resolve().parents[2] / "configs" /
                                  "paper-4gpu.yaml")
    for routers in (1, 4):
        stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(1), FleetConfig(routers))
        result = Simulator.from_config(cluster, stack.policy, watchdog=stack.watchdog,
                                       seed=1).run(workload)
        assert len(result.records) == len(workload)
        assert all(r.finish_s is not None for r in result.records)
        if routers > 1:
            assert not stack.policy.owner  # every finish reached its replica
            assert all(sum(r.own.values()) == 0 for r in stack.policy.replicas)
