"""What a live router reports of its requests: its counters, the load report the pool
controller takes, and the finishes the routing stack and the other replicas learn from.

The router tells `RouterReports` as requests arrive, move and end; the controller and
the other replicas take what it gathered since they last asked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from app.control.observe import LoadReport
from app.engines.prefix import PREFIX_BLOCK_SIZE
from app.routing.base import Listeners, RejectCode, RoutingPolicy
from app.routing.finish_log import DEFAULT_FINISH_CAPACITY, lengths_of, shareable
from app.routing.instance_view import InstanceId
from app.routing.view import FinishReport, RouteRequest
from app.serving.flight import Flight, FlightState
from app.serving.instances import InstanceTracker
from app.serving.telemetry import MigrationReason, Outcome, RouterMetrics


@dataclass
class RouterCounters:
    """Totals since start (for metrics and tests); `RouterReports.counters` hands out
    a copy."""

    num_routed: int = 0
    num_rejected: int = 0
    num_finished: int = 0
    num_dropped: int = 0
    num_migrations: int = 0  # SLO-risk and operator moves
    num_drain_migrations: int = 0  # moves off engines leaving their pool
    num_failovers: int = 0
    num_in_flight: int = 0  # set in the copy
    num_reattached: int = 0  # taken over from another router replica


class RouterReports:
    """Counts a router's requests and gathers what others take from it: the load report
    (arrivals, completions, agent steps) and, with a status feed, the finishes to tell
    the other replicas."""

    def __init__(self, policy: RoutingPolicy, listeners: Listeners, tracker: InstanceTracker,
                 metrics: RouterMetrics, clock: Callable[[], float], *,
                 tell_finishes: bool) -> None:
        self.policy = policy
        self.listeners = listeners
        self.tracker = tracker
        self.metrics = metrics
        self.clock = clock
        self.tell_finishes = tell_finishes
        self.totals = RouterCounters()
        self.load_report = LoadReport()  # arrivals, completions, steps since the last take
        # finishes not yet told to the other replicas (with a status feed: a board);
        # bounded, so a feed that stopped asking costs no more than this
        self.finished_to_tell: deque[FinishReport] = deque(maxlen=DEFAULT_FINISH_CAPACITY)

    # ---- told by the router --------------------------------------------------------
    def rejected(self, route: RouteRequest, code: RejectCode) -> None:
        """A request the policy declined (or nothing could serve) still arrived."""
        self.load_report.arrival(route.num_prompt_tokens)
        self.totals.num_rejected += 1
        self.metrics.rejected(code)

    def arrived(self, route: RouteRequest, computed_on: InstanceId) -> None:
        """A routed request into the load report. An agent step also reports its arrival
        to the session's count and the prompt tokens `computed_on` (the engine that
        computes its prompt) is not believed to cache, by this router's prefix index
        (before the step's own blocks go in)."""
        if route.session_id is None:
            self.load_report.arrival(route.num_prompt_tokens)
            return
        cached = self.tracker.prefix_blocks(computed_on, route.block_hashes) * PREFIX_BLOCK_SIZE
        self.load_report.arrival(route.num_prompt_tokens,
                                 max(route.num_prompt_tokens - cached, 1))
        self.load_report.step_issued(route.session_id, route.arrival_s)

    def routed(self) -> None:
        self.totals.num_routed += 1

    def reattached(self) -> None:
        self.totals.num_reattached += 1

    def moved(self, reason: MigrationReason) -> None:
        """An asked migration was carried out (drains are counted apart)."""
        if reason is MigrationReason.DRAIN:
            self.totals.num_drain_migrations += 1
        else:
            self.totals.num_migrations += 1

    def failed_over(self) -> None:
        self.totals.num_failovers += 1

    def finished(self, flight: Flight, now: float) -> None:
        """A flight's last token came: its completion, its metrics, the routing stack's
        feedback and, with a status feed, the finish for the other replicas."""
        output = flight.output
        self.totals.num_finished += 1
        end_s = now if output.finish_s is None else output.finish_s
        self.load_report.completion(len(output.token_ids), end_s <= flight.route.deadline_s)
        report = FinishReport(flight.route, flight.instance_id, len(output.token_ids),
                              output.first_token_s, end_s)
        self.metrics.finished(
            arrival_s=flight.request.arrival_s, deadline_s=flight.route.deadline_s,
            first_token_s=output.first_token_s, end_s=end_s,
            num_output_tokens=len(output.token_ids),
            predicted_output_tokens=flight.route.predicted_output_tokens,
            num_prompt_tokens=flight.route.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens)
        for listener in self.listeners.finish:
            listener.on_finish(report, now)
        if self.tell_finishes:
            self.finished_to_tell.append(shareable(report))

    def dropped(self, flight: Flight, now: float) -> None:
        """A flight ended unfinished (cancelled or lost): the routing stack forgets it
        and learns nothing from its truncated length."""
        self.totals.num_dropped += 1
        self.metrics.ended(Outcome.ERROR if flight.state is FlightState.LOST
                           else Outcome.CANCELLED)
        for listener in self.listeners.every:
            listener.on_drop(flight.route, now)

    def step_done(self, flight: Flight, now: float) -> None:
        """An agent step's end into the load report, with its context (prompt + output).
        Whether the answer ends the session is the tool parser's to say, which reads the
        reply after the stream is over: the step is reported as not ending it, and the
        API layer tells a final answer apart (`session_answered`); a session without
        one ends once it is silent for the controller's idle time-out. A request of no
        session is no step."""
        if flight.route.session_id is None:
            return
        output = flight.output
        finished = flight.state is FlightState.FINISHED and output.finish_s is not None
        end_s = output.finish_s if finished else now
        self.load_report.step_done(flight.route.session_id, end_s,
                                   flight.route.num_prompt_tokens + len(output.token_ids),
                                   ends_session=False)

    def session_answered(self, session_id: str) -> None:
        """A step of `session_id` ended with the session's final answer (the API layer
        read no tool call in a reply that could make one): into the load report, so the
        controller stops counting the session open."""
        self.load_report.session_answered(session_id, self.clock())

    # ---- taken by others -----------------------------------------------------------
    def counters(self, num_in_flight: int) -> RouterCounters:
        return replace(self.totals, num_in_flight=num_in_flight)

    def take_finished(self) -> list[FinishReport]:
        """The requests this router saw finish since the last call, for the other
        replicas' length estimators (`finish_log`)."""
        reports = list(self.finished_to_tell)
        self.finished_to_tell.clear()
        return reports

    def learn_finished(self, reports: Sequence[FinishReport]) -> None:
        """Requests other replicas saw finish: the length estimator learns from them as
        from its own (nothing else here knew them)."""
        length = lengths_of(self.policy)
        if length is None:
            return
        now = self.clock()
        for report in reports:
            length.on_finish(report, now)

    def take_load_report(self) -> LoadReport:
        """Arrivals, completions and agent steps' events since the last call (for the
        pool controller)."""
        report, self.load_report = self.load_report, LoadReport()
        return report
