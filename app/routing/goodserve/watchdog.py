"""GoodServe's SLO watchdog: keeps admitted requests' budgets current and moves the
requests that would miss their deadline to a stronger instance, by token IDs."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from numba import njit

from app.routing.base import ActiveRequest, Watchdog
from app.routing.budgets import SlackBudgets
from app.routing.goodserve.admissions import RecentAdmissions
from app.routing.goodserve.config import GoodServeConfig, LengthReestimate
from app.routing.goodserve.placer import JustEnoughPlacer
from app.routing.goodserve.scoring import Candidate, capability_s_per_token
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.length import OutputLengthEstimator
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, FinishReport, RouteRequest


class SloWatchdog(Watchdog):
    """Every `budget_refresh_iterations`: refresh the budgets of an instance's
    requests; every tau iterations also migrate those that would miss their deadline.

    Expected finish of an active request = now + (queue delay if still waiting) +
    re-estimated remaining tokens x d_g of its instance (`reestimate`: the arrival
    estimate given the tokens generated, or the predictor again), all of an instance's
    requests in one numpy pass. A request on track gets its
    budget (slack) recomputed from its progress and re-estimated length (a budget
    fixed at admission forgets the slack a request gains by running ahead). One that
    would miss moves to the just-enough choice among *stronger* instances whose
    estimate (re-prefill of prompt + generated ids, then the remaining decode) still
    meets the deadline, at most `max_migrations_per_request` times; if it stays, it
    loses its protection (it would close the instance to requests that can make it).

    Two additions gate a move. `migration_margin` moves only requests whose expected
    lateness exceeds that fraction of their time left. The migration cost gate
    (`migration_cost_quantile`) refuses moves to a contended target (one that
    recently turned away an arrival) whose T there exceeds that quantile of the T of
    the new requests recently placed there: one saved request must not displace
    more than one typical arrival.

    The substrate calls `check` every gcd(tau, refresh) iterations; moves happen when
    the instance has done another tau iterations since the last move check; between
    them a late request only loses its budget.
    """

    def __init__(
        self,
        status: StatusEstimator,
        length: OutputLengthEstimator,
        config: GoodServeConfig = GoodServeConfig(),
        budgets: SlackBudgets | None = None,
        admissions: RecentAdmissions | None = None,
    ) -> None:
        super().__init__(config.tau_iterations)
        self.config = config.for_length(length)
        self._check_period = math.gcd(config.tau_iterations, config.budget_refresh_iterations)
        self._move_epochs: dict[InstanceId, int] = {}  # num_iterations // tau at last move
        self.status = status
        self.length = length
        self.budgets = budgets if budgets is not None else SlackBudgets()
        self.admissions = admissions if admissions is not None else RecentAdmissions(config)
        self.placer = JustEnoughPlacer(status, self.config, self.budgets, self.admissions)
        self.needs_true_output_length = length.needs_true_output_length
        self.req_to_num_migrations: dict[str, int] = {}
        # the length estimator learns from running requests' progress (history)
        self._tracks_progress = (type(length).on_progress
                                 is not OutputLengthEstimator.on_progress)
        warm_up()

    @property
    def check_period_iterations(self) -> int:
        return self._check_period

    def _crossed_tau(self, source: InstanceView) -> bool:
        """True once per tau iterations of `source` (by its iteration count, so a
        poller that sees several check periods at once still moves on time)."""
        epoch = source.num_iterations // self.tau_iterations
        if epoch <= self._move_epochs.get(source.instance_id, 0):
            return False
        self._move_epochs[source.instance_id] = epoch
        return True

    def check(
        self,
        instance_id: InstanceId,
        active: Sequence[ActiveRequest],
        view: ClusterView,
        now: float,
    ) -> Mapping[str, InstanceId]:
        source = view.get(instance_id)
        may_move = self._check_period == self.tau_iterations or self._crossed_tau(source)
        stronger: list[InstanceView] | None = None  # listed when a request first needs it
        moves: dict[str, InstanceId] = {}
        # one pass over the requests; rows as `_lateness` reads them
        columns = np.array([(a.request.deadline_s, math.inf if a.request.max_output_tokens
                             is None else a.request.max_output_tokens, a.is_running,
                             a.num_generated_tokens) for a in active],
                           dtype=np.float64).reshape(len(active), 4)
        watched = active
        has_deadline = np.isfinite(columns[:, 0])
        if not has_deadline.all():
            watched = [active[i] for i in np.flatnonzero(has_deadline)]
            columns = columns[has_deadline]
        if not watched:
            return moves
        estimate = self.status.estimate(source, now, joining=0)
        requests = [a.request for a in watched]
        counts = [a.num_generated_tokens for a in watched]
        if self._tracks_progress:
            self.length.on_progress({r.request_id: a.num_generated_tokens
                                     for r, a in zip(requests, watched, strict=True)})
        mode = self.config.reestimate
        if mode == LengthReestimate.REPREDICT:
            predicted = self.length.predict_totals(requests, counts)
        else:
            predicted = self.length.conditional_totals(requests, counts)
        predicted = np.asarray(predicted, dtype=np.float64)
        totals, late_s, time_left_s = _lateness(predicted, columns,
                                                estimate.queue_delay_s,
                                                estimate.decode_s_per_token, now)
        if mode == LengthReestimate.AT_RISK and (late_s > 0).any():
            risky = np.flatnonzero(late_s > 0)
            predicted[risky] = self.length.predict_totals([requests[i] for i in risky],
                                                          [counts[i] for i in risky])
            totals, late_s, time_left_s = _lateness(predicted, columns,
                                                    estimate.queue_delay_s,
                                                    estimate.decode_s_per_token, now)
        # what an on-track request can afford now is its budget
        budgets = [(r.request_id, -late) for r, late in zip(requests, late_s.tolist(),
                                                             strict=True) if late <= 0]
        self.budgets.admit_many(instance_id, [rid for rid, _ in budgets],
                                [slack for _, slack in budgets])
        for index in np.flatnonzero(~(late_s <= 0)):
            item, rid = watched[index], requests[index].request_id
            target = None
            if may_move and late_s[index] > self.config.migration_margin * max(
                    time_left_s[index], 0.0):
                if stronger is None:
                    stronger = stronger_than(source, view)
                if stronger:
                    target = self._target(item, float(totals[index]), stronger, view, now)
            if target is None:  # it stays, unprotected
                self.budgets.remove(rid)
                continue
            self.placer.admit(item.request, target)
            moves[rid] = target.instance_id
            self.req_to_num_migrations[rid] = self.req_to_num_migrations.get(rid, 0) + 1
        return moves

    def on_finish(self, report: FinishReport, now: float) -> None:
        self.req_to_num_migrations.pop(report.request.request_id, None)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self.req_to_num_migrations.pop(request.request_id, None)

    def _target(
        self,
        item: ActiveRequest,
        total: float,
        stronger: Sequence[InstanceView],
        view: ClusterView,
        now: float,
    ) -> Candidate | None:
        """The just-enough choice among stronger instances for the resumed request,
        if it has a move left and the move is affordable there."""
        if self.req_to_num_migrations.get(item.request.request_id, 0) >= (
            self.config.max_migrations_per_request
        ):
            return None
        resumed = _as_resumed(item.request, item.num_generated_tokens)
        holding = [v for v in stronger if v.can_hold(resumed.num_context_tokens)]
        chosen, _ = self.placer.score(resumed, holding, view, now).place(total)
        if chosen is None or not self._affordable(chosen):
            return None
        return chosen

    def _affordable(self, target: Candidate) -> bool:
        """The target has capacity to spare, or the move costs it no more than its
        typical recent arrival."""
        quantile = self.config.migration_cost_quantile
        if quantile >= 1.0 or not self.admissions.contended(target.instance_id):
            return True
        return target.latency_s <= self.admissions.quantile_s(target.instance_id, quantile)


def stronger_than(source: InstanceView, view: ClusterView) -> list[InstanceView]:
    """The instances that decode faster than `source`: where a late request may move
    (read off the view's capability column)."""
    capability = view.arrays.column("unloaded_decode_s_per_token")
    faster = np.flatnonzero(capability < capability_s_per_token(source.spec))
    return [view.instances[i] for i in faster]


def _as_resumed(request: RouteRequest, num_generated: int) -> RouteRequest:
    """The request as a migration target sees it: prompt + generated ids to re-prefill."""
    return replace(request, num_generated_tokens=num_generated)


@njit(cache=True)
def _lateness(predicted, columns, queue_s, decode_s, now):
    """(totals bounded by max_tokens, expected lateness, time left) of an instance's
    requests in one pass: remaining tokens x d_g past the deadline, less the queue
    delay still ahead of those waiting. `columns` rows: (deadline, max_tokens or inf,
    running, generated tokens), read off the requests in one pass."""
    n = len(predicted)
    totals, late, time_left = np.empty(n), np.empty(n), np.empty(n)
    for i in range(n):
        cap = columns[i, 1]
        totals[i] = predicted[i] if predicted[i] <= cap else cap
        remaining = max(totals[i] - columns[i, 3], 1.0)
        waiting = 0.0 if columns[i, 2] else queue_s
        time_left[i] = columns[i, 0] - now - waiting
        late[i] = remaining * decode_s - time_left[i]
    return totals, late, time_left


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the watchdog's pass before its first
    check."""
    _lateness(np.ones(1), np.ones((1, 4)), 0.0, 1.0, 0.0)
