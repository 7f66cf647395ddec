"""Several router replicas on one fleet: each decides on its own state and view.

A user who outgrows one router runs more Ray Serve replicas. Each keeps its own policy
state (GoodServe's status estimator, admission budgets, strongest-GPU reservation and
watchdog) and sees the other replicas' placements only through what the engines report.
`RouterFleet` is that fleet as one policy, so the simulator (and `goodserve overhead`)
run it like any other:
- a request goes to one replica, at random (Serve's proxy) or by a hash of its session
  (a session-affine load balancer; lone requests at random);
- a replica sees its own placements at once and the other replicas' at its next
  report, every `report_interval_s` (the replicas' report times are staggered); with
  `Sharing.NOTHING` it never sees them and counts only its own requests;
- with `Sharing.BUDGETS` a replica also tells the others, at each of its reports, the
  smallest slack its requests have on each engine (GoodServe's do-no-harm budgets), and
  takes theirs: a replica then does not stall another's admitted requests;
- with `Sharing.LEARNING` (the default, as live replicas share) it also learns, at each
  report, from the requests the others saw finish since its last one (its length
  estimator learns from every finish, `finish_log`);
- every engine iteration reaches every replica's status estimator (engines publish
  once, replicas follow); a first token and a finish reach the replica that placed the
  request (its policy and its watchdog: the fleet's watchdog learns nothing of its own);
- each replica's watchdog checks only the requests that replica placed.
The view a replica routes on is the engines' state at the decision less what it has
not seen: the others' requests placed since its last report are taken out (waiting
first), and those that were there at its report and have left since are kept in (as
running). One replica alone sees exactly what a single router sees.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from app.engines.messages import EngineStatus
from app.routing.arrays import COLUMNS
from app.routing.base import ActiveRequest, Reject, RouteDecision, RoutingPolicy, Watchdog
from app.routing.budgets import SlackBudgets, budgets_of, smallest_stalls
from app.routing.finish_log import FinishLog, lengths_of
from app.routing.instance_view import InstanceId
from app.routing.view import ClusterView, FinishReport, RouteRequest, StepReport

DEFAULT_REPORT_INTERVAL_S = 0.1  # the live router's engine poll period
RUNNING, WAITING = COLUMNS.index("num_running"), COLUMNS.index("num_waiting")


class Spread(StrEnum):
    """How requests are spread over the replicas."""

    RANDOM = "random"  # Ray Serve's proxy
    SESSION = "session"  # a session-affine balancer: a hash of session_id


class Sharing(StrEnum):
    """What the replicas know beyond their own placements."""

    NOTHING = "nothing"  # the engines' speeds, not their queues
    REPORTS = "reports"  # the engines' reported queues, every report interval
    BUDGETS = "budgets"  # reports, and each other's smallest slack per engine
    LEARNING = "learning"  # budgets, and each other's finishes (`finish_log`)


@dataclass(frozen=True)
class FleetConfig:
    """How many router replicas, how requests reach them, what they share."""

    num_routers: int = 1
    spread: Spread = Spread.RANDOM
    sharing: Sharing = Sharing.LEARNING
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S

    def __post_init__(self) -> None:
        if self.num_routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.num_routers}")
        if not (self.report_interval_s > 0 and math.isfinite(self.report_interval_s)):
            raise ValueError(f"report interval must be > 0 s, got {self.report_interval_s}")


@dataclass
class Replica:
    """One router replica: its policy and watchdog, and what it does not yet know.

    The engines' reports are the truth at the decision, less what this replica has not
    seen: the other replicas' requests placed since its last report (`hidden`; with
    nothing shared, all of the others' requests) and plus those that were there at its
    report and have left since (`ghosts`)."""

    policy: RoutingPolicy
    watchdog: Watchdog | None
    offset_s: float  # its report times are offset_s + n x the interval
    own: Counter[InstanceId] = field(default_factory=Counter)  # its requests per engine
    hidden: Counter[InstanceId] = field(default_factory=Counter)
    ghosts: Counter[InstanceId] = field(default_factory=Counter)
    report_index: int = -1
    finish_cursor: int = 0  # the fleet's finish log read up to here

    @property
    def listeners(self) -> list[RoutingPolicy | Watchdog]:
        """What learns from the engines' feedback: the policy, and the watchdog when it
        is another object."""
        if self.watchdog is None or self.watchdog is self.policy:
            return [self.policy]
        return [self.policy, self.watchdog]

    @property
    def budgets(self) -> SlackBudgets | None:
        return budgets_of(self.policy)

    def refresh(self, now: float, interval_s: float) -> bool:
        """Its report, when a report time has passed (True then): from now it knows
        every request the engines hold."""
        index = math.floor((now - self.offset_s) / interval_s)
        if index <= self.report_index:
            return False
        self.report_index = index
        self.hidden.clear()
        self.ghosts.clear()
        return True

    def view(self, current: ClusterView, unseen: Mapping[InstanceId, int] | None = None
             ) -> ClusterView:
        """The engines `current` lists, as this replica knows them; `unseen` (engine ->
        requests) replaces `hidden` when it knows none of the others' requests."""
        hidden = self.hidden if unseen is None else unseen
        changed = {iid for iid, n in hidden.items() if n} | {
            iid for iid, n in self.ghosts.items() if n}
        if not changed:
            return current
        arrays = current.arrays
        rows = {iid: arrays.row_of[iid] for iid in changed if iid in arrays.row_of}
        if not rows:
            return current
        views, table = list(current.instances), arrays.table.copy()
        for iid, i in rows.items():
            v = views[i]
            hide = min(hidden.get(iid, 0), v.num_outstanding)
            waiting = v.num_waiting - min(hide, v.num_waiting)
            running = v.num_running - (hide - (v.num_waiting - waiting)) + self.ghosts[iid]
            views[i] = replace(v, num_running=running, num_waiting=waiting)
            table[i, RUNNING], table[i, WAITING] = running, waiting
        return ClusterView(current.time_s, tuple(views), current.prefix_lookup,
                           current.kv_capacity_floor_tokens,
                           replace(arrays, table=table),
                           current.prefix_directory)


class RouterFleet(RoutingPolicy):
    """`len(replicas)` router replicas behind one balancer, as one policy."""

    def __init__(self, replicas: Sequence[tuple[RoutingPolicy, Watchdog | None]],
                 config: FleetConfig, seed: int = 0) -> None:
        if len(replicas) != config.num_routers:
            raise ValueError(f"{config.num_routers} routers configured, {len(replicas)} given")
        self.config = config
        step = config.report_interval_s / config.num_routers
        self.replicas = [Replica(p, w, k * step) for k, (p, w) in enumerate(replicas)]
        self.owner: dict[str, Replica] = {}  # request id -> the replica that placed it
        self.where: dict[str, InstanceId] = {}  # request id -> where it was placed
        # request id -> each replica's report index when it was placed (hidden from a
        # replica until that replica's next report)
        self.placed_at: dict[str, tuple[int, ...]] = {}
        self.outstanding: Counter[InstanceId] = Counter()  # every replica's, per engine
        self.told: dict[int, dict[InstanceId, float]] = {}  # replica -> its slack per engine
        self.finishes = FinishLog()  # what each replica saw finish, for the others
        self._rng = random.Random(seed)
        policies = [p for p, _ in replicas]
        self.needs_true_output_length = any(p.needs_true_output_length for p in policies)
        self.deadline_aware = any(p.deadline_aware for p in policies)
        self.watchdog = (FleetWatchdog(self) if any(w is not None for _, w in replicas)
                         else None)

    def replica_for(self, request: RouteRequest) -> Replica:
        """A request's replica: the one that placed it before (a re-route), else by the
        spread."""
        known = self.owner.get(request.request_id)
        if known is not None:
            return known
        if self.config.spread is Spread.SESSION and request.session_id is not None:
            index = zlib.crc32(request.session_id.encode()) % len(self.replicas)
        else:
            index = self._rng.randrange(len(self.replicas))
        return self.replicas[index]

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        return self.choose_on(self.replica_for(request), request, view, now)

    def choose_on(self, replica: Replica, request: RouteRequest, view: ClusterView,
                  now: float) -> RouteDecision:
        """`replica`'s decision (its refresh, view and policy) for `request`."""
        self.refresh(replica, view)
        decision = replica.policy.choose(request, self.view_of(replica, view), now)
        self.record(replica, request, decision)
        return decision

    def record(self, replica: Replica, request: RouteRequest, decision: RouteDecision) -> None:
        """`replica` placed `request` (unless it rejected it): the others see it at their
        next report."""
        if isinstance(decision, Reject):
            return
        if request.request_id in self.owner:  # re-routed: it left where it was
            self._left(request.request_id)
        self.owner[request.request_id] = replica
        self._placed(request.request_id, decision)

    def view_of(self, replica: Replica, view: ClusterView) -> ClusterView:
        """The engines as `replica` knows them (`Replica.view`)."""
        if self.config.sharing is Sharing.NOTHING:
            return replica.view(view, {iid: n - replica.own[iid]
                                       for iid, n in self.outstanding.items()})
        return replica.view(view)

    def _placed(self, request_id: str, instance_id: InstanceId) -> None:
        owner = self.owner[request_id]
        self.where[request_id] = instance_id
        self.placed_at[request_id] = tuple(r.report_index for r in self.replicas)
        self.outstanding[instance_id] += 1
        owner.own[instance_id] += 1
        for r in self.replicas:
            if r is not owner:
                r.hidden[instance_id] += 1

    def _left(self, request_id: str) -> None:
        """The request left its engine: a replica that had not seen it arrive stops
        hiding it; one that had seen it keeps it as a ghost until its next report."""
        owner, instance_id = self.owner[request_id], self.where.pop(request_id)
        placed_at = self.placed_at.pop(request_id)
        self.outstanding[instance_id] -= 1
        owner.own[instance_id] -= 1
        for r, index in zip(self.replicas, placed_at, strict=True):
            if r is owner:
                continue
            if r.report_index == index:
                r.hidden[instance_id] -= 1
            else:
                r.ghosts[instance_id] += 1

    def refresh(self, replica: Replica, view: ClusterView) -> None:
        """The replica's report, when one is due: the engines' figures and, sharing
        budgets, the smallest slack per engine it tells the others and takes from
        them (what each told at its own last report)."""
        if not replica.refresh(view.time_s, self.config.report_interval_s):
            return
        length = lengths_of(replica.policy)
        if self.config.sharing is Sharing.LEARNING and length is not None:
            replica.finish_cursor, learned = self.finishes.since(replica.finish_cursor,
                                                                  str(id(replica)))
            for report in learned:
                length.on_finish(report, view.time_s)
        budgets = replica.budgets
        if self.config.sharing not in (Sharing.BUDGETS, Sharing.LEARNING) or budgets is None:
            return
        self.told[id(replica)] = budgets.own_shortest_stalls()
        budgets.take_others(smallest_stalls(
            stalls for key, stalls in self.told.items() if key != id(replica)))

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        for replica in self.replicas:
            for listener in replica.listeners:
                listener.on_step(instance_id, report, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        for replica in self.replicas:
            for listener in replica.listeners:
                listener.on_status(status, now)

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        replica = self.owner.get(request.request_id)
        if replica is not None:
            for listener in replica.listeners:
                listener.on_first_token(request, instance_id, first_token_s, now)

    def on_finish(self, report: FinishReport, now: float) -> None:
        replica = self._forget(report.request.request_id)
        if replica is not None:
            for listener in replica.listeners:
                listener.on_finish(report, now)
            if self.config.sharing is Sharing.LEARNING:
                self.finishes.tell(str(id(replica)), [report])

    def on_drop(self, request: RouteRequest, now: float) -> None:
        replica = self._forget(request.request_id)
        if replica is not None:
            for listener in replica.listeners:
                listener.on_drop(request, now)

    def moved(self, request_id: str, target: InstanceId) -> None:
        """A replica's watchdog moved one of its requests."""
        self._left(request_id)
        self._placed(request_id, target)

    def _forget(self, request_id: str) -> Replica | None:
        if request_id not in self.owner:
            return None
        self._left(request_id)
        return self.owner.pop(request_id)


class FleetWatchdog(Watchdog):
    """Each replica's watchdog over the requests that replica placed."""

    def __init__(self, fleet: RouterFleet) -> None:
        self.fleet = fleet
        periods = {w.check_period_iterations for r in fleet.replicas
                   if (w := r.watchdog) is not None}
        super().__init__(min(periods))

    @property
    def check_period_iterations(self) -> int:
        return self.tau_iterations

    def check(self, instance_id: InstanceId, active: Sequence[ActiveRequest],
              view: ClusterView, now: float) -> Mapping[str, InstanceId]:
        by_replica: dict[int, list[ActiveRequest]] = {}
        for item in active:
            replica = self.fleet.owner.get(item.request.request_id)
            if replica is not None and replica.watchdog is not None:
                by_replica.setdefault(id(replica), []).append(item)
        moves: dict[str, InstanceId] = {}
        for replica in self.fleet.replicas:
            mine = by_replica.get(id(replica))
            if not mine:
                continue
            self.fleet.refresh(replica, view)
            assert replica.watchdog is not None
            for request_id, target in replica.watchdog.check(
                    instance_id, mine, self.fleet.view_of(replica, view), now).items():
                self.fleet.moved(request_id, target)
                moves[request_id] = target
        return moves
