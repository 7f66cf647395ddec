"""Routing policy and watchdog interfaces, shared by the live router and the simulator.

A policy is one method, `choose(request, view, now)`; the substrate owns queues,
clocks and transport. Policies never read a clock and own their random state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from app.engines.messages import EngineStatus
from app.routing.instance_view import InstanceId
from app.routing.view import ClusterView, FinishReport, RouteRequest, StepReport


class RejectCode(StrEnum):
    """Why a request was not served, as a short code (metrics tag, API error type)."""

    SLO_UNATTAINABLE = "slo_unattainable"  # admission control: no instance meets it
    CONTEXT_TOO_LONG = "context_too_long"  # no instance can hold prompt + output
    NO_INSTANCE = "no_instance"  # no healthy instance to route to


@dataclass(frozen=True)
class Reject:
    """A routing decision not to serve the request (admission control)."""

    reason: str
    code: RejectCode = RejectCode.SLO_UNATTAINABLE


RouteDecision = InstanceId | Reject


class StepListener:
    """Black-box feedback a substrate delivers; no-ops unless overridden."""

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        """Called with every iteration of every instance, in order per instance and
        before any decision after it: one report per iteration, or per stretch of a
        decode run (status estimators learn here; `now` is the last one's end)."""

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        """Called once per request when `instance_id` produced its first output token
        (a prefill engine's, in P/D), at `first_token_s` on the substrate's clock:
        what a router hears as the stream starts (its TTFT, the end of its prefill).
        A substrate calls it only on listeners that override it."""

    def on_finish(self, report: FinishReport, now: float) -> None:
        """Called when a request produced its last token."""

    def on_drop(self, request: RouteRequest, now: float) -> None:
        """Called when a request ended without finishing (client gone, engine lost):
        forget it, and learn nothing from its truncated length."""

    def on_status(self, status: EngineStatus, now: float) -> None:
        """Called with each polled engine report (the live router's feedback path;
        the simulator delivers `on_step` instead)."""


def overrides(listener: StepListener, callback: str) -> bool:
    """Whether `listener` implements the `StepListener` callback `callback` (a substrate
    calls only those that do, and builds no report for the others)."""
    return getattr(type(listener), callback) is not getattr(StepListener, callback)


@dataclass(frozen=True)
class Listeners:
    """The routing stack's parts a substrate gives feedback to, each object once (one
    may play two parts), and per costly callback those that implement it, so the
    simulator and the live router wire them alike."""

    every: tuple[StepListener, ...]
    step: tuple[StepListener, ...]  # implement `on_step`
    first_token: tuple[StepListener, ...]  # implement `on_first_token`
    finish: tuple[StepListener, ...]  # implement `on_finish`

    @classmethod
    def of(cls, *parts: StepListener | None) -> Listeners:
        """The listeners among `parts` (None: a part the stack lacks), in order."""
        every = tuple({id(x): x for x in parts if x is not None}.values())
        return cls(every, *(tuple(x for x in every if overrides(x, callback))
                             for callback in ("on_step", "on_first_token", "on_finish")))


class RoutingPolicy(StepListener, ABC):
    """Picks an instance for each request.

    Class attributes tell the substrate what the policy needs, so it can skip work:
    `needs_true_output_length` fills `RouteRequest.true_output_tokens` (exact lengths only);
    `deadline_aware = False` promises the decisions ignore deadlines, which lets the
    replay harness score one run at several SLO scales.
    """

    needs_true_output_length: ClassVar[bool] = False
    deadline_aware: ClassVar[bool] = True

    @abstractmethod
    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        """Return the id of one instance in `view.instances`, or `Reject(reason)`.

        `view` lists only the candidates (right role, under any admission cap) and
        is immutable; `now` is the substrate's clock (virtual or wall seconds).
        """


@dataclass(frozen=True)
class ActiveRequest:
    """A request in flight on an instance, as the watchdog sees it."""

    request: RouteRequest
    instance_id: InstanceId
    num_generated_tokens: int
    is_running: bool  # False while waiting (or preempted) in the engine queue


class Watchdog(StepListener, ABC):
    """Periodic SLO check that may move requests to other instances.

    The substrate calls `check` every `check_period_iterations` iterations of an
    instance (tau unless a watchdog checks more often than it moves), between
    iterations. A migration aborts the request on its instance and re-adds
    it on the target by token IDs (prompt + generated so far); the target
    re-prefills them, no KV is copied. A check reads other instances through its
    `view`: a substrate may build their part only when the check reads it (the
    simulator applies their engines' iterations up to the check first).
    """

    needs_true_output_length: ClassVar[bool] = False

    def __init__(self, tau_iterations: int = 50) -> None:
        if tau_iterations < 1:
            raise ValueError(f"tau_iterations must be >= 1, got {tau_iterations}")
        self.tau_iterations = tau_iterations

    @property
    def check_period_iterations(self) -> int:
        """How often the substrate calls `check`, in iterations of an instance."""
        return self.tau_iterations

    @abstractmethod
    def check(
        self,
        instance_id: InstanceId,
        active: Sequence[ActiveRequest],
        view: ClusterView,
        now: float,
    ) -> Mapping[str, InstanceId]:
        """Return request_id -> target instance id for the requests to migrate now.

        `view` lists the instances of the same pool (including the source).
        """
