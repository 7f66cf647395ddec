"""What GoodServe exports as metrics: series names, tags, buckets, and which event
moves which series.

Ray-free: a `MetricFactory` makes the instruments. The Ray Serve shells pass Ray's
(`deployments/metrics.py`: `ray.util.metrics`, so the series appear on Ray's
Prometheus endpoint beside Ray's own, each name prefixed `ray_` by Ray); anything
that exports nothing passes `NullFactory`. Every name starts with `goodserve_`.
Tag values are short enumerations (outcome, reason, GPU type, role) or engine ids,
never request ids, so the number of series stays bounded.

Ray's histograms take positive bucket boundaries only, and Ray reports a histogram's
sum from bucket midpoints: averages read from `_sum / _count` are approximate, the
bucket counts (and quantiles from them) are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Protocol

__all__ = [
    "ControllerMetrics",
    "MetricFactory",
    "MigrationReason",
    "NullFactory",
    "Outcome",
    "RouterMetrics",
]

Tags = Mapping[str, str]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
                     60.0, 120.0, 300.0)
DECISION_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                      0.025, 0.05, 0.1)
# arrival to placement (tokenizing and the prediction's micro-batch wait on top of the
# policy) and the prediction alone: 0.1-50 ms on a loaded replica, seconds when its event
# loop is starved
PLACEMENT_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 0.01, 0.015,
                       0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTE_BUCKETS = (1e6, 1e7, 1e8, 1e9, 1e10, 1e11)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)


class Counter(Protocol):
    def inc(self, value: float = 1.0, tags: Tags | None = None) -> None: ...


class Gauge(Protocol):
    def set(self, value: float, tags: Tags | None = None) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, tags: Tags | None = None) -> None: ...


class MetricFactory(Protocol):
    """Makes instruments; `ray.util.metrics`' constructors have this shape."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Counter: ...

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Gauge: ...

    def histogram(self, name: str, description: str, boundaries: Sequence[float],
                  tag_keys: tuple[str, ...]) -> Histogram: ...


class _Discard:
    def inc(self, value: float = 1.0, tags: Tags | None = None) -> None:
        pass

    def set(self, value: float, tags: Tags | None = None) -> None:
        pass

    def observe(self, value: float, tags: Tags | None = None) -> None:
        pass


class NullFactory:
    """Instruments that record nothing (the simulator, tools without an exporter)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Counter:
        return _Discard()

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Gauge:
        return _Discard()

    def histogram(self, name: str, description: str, boundaries: Sequence[float],
                  tag_keys: tuple[str, ...]) -> Histogram:
        return _Discard()


class Outcome(StrEnum):
    """How a request ended, as `goodserve_requests_total{outcome}` counts it."""

    MET = "met"  # finished within its deadline
    MISSED = "missed"  # finished after its deadline
    BEST_EFFORT = "best_effort"  # finished, had no deadline
    REJECTED = "rejected"  # not admitted (`reason` says why)
    ERROR = "error"  # its engine failed and no other could continue it
    CANCELLED = "cancelled"  # the client went away first


class MigrationReason(StrEnum):
    SLO_RISK = "slo_risk"  # the watchdog moved it to save its deadline
    FAILURE = "failure"  # its engine failed; it continued elsewhere
    DRAIN = "drain"  # its engine left its pool
    OPERATOR = "operator"  # /admin/migrate


INSTANCE_TAGS = ("instance", "gpu_type", "role")


class RouterMetrics:
    """The router's series; one per router replica, all replicas' series summed by
    Prometheus (Ray tags each with the process it came from)."""

    def __init__(self, factory: MetricFactory, policy: str = "unknown") -> None:
        """`policy`: the routing policy's name, the decisions' `policy` tag."""
        f = factory
        self.policy = policy
        self.requests = f.counter(
            "goodserve_requests", "Requests by how they ended (met / missed / best_effort / "
            "rejected / error / cancelled) and, for rejections, why", ("outcome", "reason"))
        self.latency = f.histogram(
            "goodserve_request_latency_seconds", "End-to-end latency of finished requests",
            LATENCY_BUCKETS_S, ("outcome",))
        self.deadline = f.histogram(
            "goodserve_request_deadline_seconds", "Deadline (after arrival) of finished "
            "requests that had one", LATENCY_BUCKETS_S, ())
        self.ttft = f.histogram(
            "goodserve_ttft_seconds", "Time to first token of finished requests",
            LATENCY_BUCKETS_S, ())
        self.slack = f.histogram(
            "goodserve_deadline_slack_seconds", "Deadline requests at finish: time left "
            "(outcome=met) or time late (outcome=missed)", LATENCY_BUCKETS_S, ("outcome",))
        self.output_tokens = f.counter(
            "goodserve_output_tokens", "Output tokens of finished requests", ("outcome",))
        self.goodput_tokens = f.counter(
            "goodserve_goodput_tokens", "Output tokens of requests that met their deadline",
            ())
        self.prompt_tokens = f.counter(
            "goodserve_prompt_tokens", "Prompt tokens of finished requests", ("outcome",))
        self.cached_prompt_tokens = f.counter(
            "goodserve_cached_prompt_tokens", "Prompt tokens of finished requests that their "
            "first engine found in its prefix cache (the usage's cached_tokens)", ())
        self.decisions = f.counter(
            "goodserve_routing_decisions", "Placements by policy and instance",
            ("policy", *INSTANCE_TAGS))
        self.decision_latency = f.histogram(
            "goodserve_routing_decision_seconds", "Time the policy took to place a request "
            "(the prediction not included)", DECISION_BUCKETS_S, ("policy",))
        self.placement_latency = f.histogram(
            "goodserve_routing_arrival_to_placement_seconds", "From the request's arrival "
            "at the router to its placement: tokenizing, the prediction (micro-batch wait "
            "included) and the policy", PLACEMENT_BUCKETS_S, ("policy",))
        self.prediction_latency = f.histogram(
            "goodserve_prediction_seconds", "Output-length prediction per request, "
            "micro-batch wait included", PLACEMENT_BUCKETS_S, ())
        self.length_error = f.histogram(
            "goodserve_output_length_error_tokens", "|predicted - actual| output length of "
            "finished requests, by direction (over / under)", TOKEN_BUCKETS, ("direction",))
        self.length_ratio = f.histogram(
            "goodserve_output_length_ratio", "Predicted / actual output length of finished "
            "requests", RATIO_BUCKETS, ())
        self.migrations = f.counter(
            "goodserve_migrations", "Requests moved between instances, by why and by the path "
            "planned (token ids, or with the prompt's stored KV)", ("reason", "path"))
        self.move_time = f.histogram(
            "goodserve_move_seconds", "From leaving the old engine to the target's first "
            "token, by the path taken", LATENCY_BUCKETS_S, ("path",))
        self.move_bytes = f.histogram(
            "goodserve_move_kv_bytes", "KV bytes each move's target loaded, by the path "
            "taken (0 by token ids)", BYTE_BUCKETS, ("path",))
        self.kv_transfer = f.histogram(
            "goodserve_kv_transfer_seconds", "Prefill-to-decode KV hand-off time",
            LATENCY_BUCKETS_S, ())
        self.kv_bytes = f.counter(
            "goodserve_kv_transfer_bytes", "KV bytes handed from prefill to decode", ())
        gauges = {
            "queue_delay_seconds": "q_g: estimated queueing delay of a request joining now",
            "prefill_seconds_per_token": "p_g: estimated prefill time per prompt token",
            "decode_seconds_per_token": "d_g: estimated decode time per output token",
            "running": "Requests running on the instance",
            "waiting": "Requests waiting on the instance",
            "kv_usage": "Share of the instance's KV blocks in use",
            "iterations_per_second": "Engine iterations per second since the last poll",
            "healthy": "1 while the instance answers the router's polls",
        }
        self.instance = {key: f.gauge(f"goodserve_instance_{key}", text, INSTANCE_TAGS)
                         for key, text in gauges.items()}

    def rejected(self, reason: str) -> None:
        self.requests.inc(tags={"outcome": Outcome.REJECTED, "reason": reason})

    def ended(self, outcome: Outcome) -> None:
        """A request that ended without finishing (error, cancelled)."""
        self.requests.inc(tags={"outcome": outcome, "reason": ""})

    def finished(self, *, arrival_s: float, deadline_s: float, first_token_s: float | None,
                 end_s: float, num_output_tokens: int,
                 predicted_output_tokens: int | None, num_prompt_tokens: int,
                 num_cached_tokens: int = 0) -> Outcome:
        """Count a finished request; returns its outcome."""
        if deadline_s == float("inf"):
            outcome = Outcome.BEST_EFFORT
        else:
            outcome = Outcome.MET if end_s <= deadline_s else Outcome.MISSED
            self.slack.observe(abs(deadline_s - end_s), tags={"outcome": outcome})
            self.deadline.observe(deadline_s - arrival_s)
        self.requests.inc(tags={"outcome": outcome, "reason": ""})
        self.latency.observe(end_s - arrival_s, tags={"outcome": outcome})
        if first_token_s is not None:
            self.ttft.observe(first_token_s - arrival_s)
        self.output_tokens.inc(num_output_tokens, tags={"outcome": outcome})
        self.prompt_tokens.inc(num_prompt_tokens, tags={"outcome": outcome})
        if num_cached_tokens:  # a Ray counter takes no zero step
            self.cached_prompt_tokens.inc(num_cached_tokens)
        if outcome is Outcome.MET:
            self.goodput_tokens.inc(num_output_tokens)
        if predicted_output_tokens is not None and num_output_tokens > 0:
            error = predicted_output_tokens - num_output_tokens
            direction = "over" if error >= 0 else "under"
            self.length_error.observe(abs(error), tags={"direction": direction})
            self.length_ratio.observe(predicted_output_tokens / num_output_tokens)
        return outcome

    def routed(self, instance: Tags, decision_s: float) -> None:
        self.decisions.inc(tags={"policy": self.policy, **instance})
        self.decision_latency.observe(decision_s, tags={"policy": self.policy})

    def placed(self, since_arrival_s: float) -> None:
        """A request was placed `since_arrival_s` after it reached the router."""
        self.placement_latency.observe(since_arrival_s, tags={"policy": self.policy})

    def predicted(self, seconds: float) -> None:
        self.prediction_latency.observe(seconds)

    def migrated(self, reason: MigrationReason, path: str) -> None:
        self.migrations.inc(tags={"reason": reason, "path": path})

    def moved(self, path: str, seconds: float, kv_bytes: float) -> None:
        """A moved request's target produced its first token."""
        self.move_time.observe(seconds, tags={"path": path})
        self.move_bytes.observe(kv_bytes, tags={"path": path})

    def kv_transferred(self, seconds: float, num_bytes: float) -> None:
        self.kv_transfer.observe(seconds)
        self.kv_bytes.inc(num_bytes)

    def instance_state(self, instance: Tags, values: Mapping[str, float]) -> None:
        """Set an instance's gauges (keys of `self.instance`)."""
        for key, value in values.items():
            self.instance[key].set(value, tags=instance)


POOL_TAGS = ("role", "gpu_type")


class ControllerMetrics:
    """The pool controller's series: what it wants, what runs, what it costs."""

    def __init__(self, factory: MetricFactory) -> None:
        f = factory
        self.target = f.gauge("goodserve_pool_target_engines",
                              "Engines the controller wants per pool", POOL_TAGS)
        self.engines = f.gauge("goodserve_pool_engines", "Engines per pool and state "
                               "(starting / active / draining)", (*POOL_TAGS, "state"))
        self.target_cost = f.gauge("goodserve_pool_target_cost_per_hour",
                                   "USD per hour of the targets", ())
        self.cost = f.gauge("goodserve_pool_cost_per_hour",
                            "USD per hour of the engines held now (the budget in use)", ())
        self.budget = f.gauge("goodserve_pool_budget_per_hour",
                              "The configured budget, USD per hour (absent: unlimited)", ())
        self.binding = f.gauge("goodserve_pool_binding_constraint", "1 for what set the last "
                               "targets: rate (the forecast), budget or stock", ("constraint",))
        self.rates = f.gauge("goodserve_pool_rate_rps", "Request rate the last step "
                             "observed, forecast and sized for", ("kind",))
        self.changes = f.counter("goodserve_plan_changes", "Engines the plans started, "
                                 "drained, reactivated, stopped or emptied by migration",
                                 ("action",))

    def step(self, *, targets: Mapping[tuple[str, str], int],
             engines: Mapping[tuple[str, str, str], int], target_cost: float, cost: float,
             budget: float | None, binding: str, rates: Mapping[str, float],
             changes: Mapping[str, int]) -> None:
        for (role, gpu_type), count in targets.items():
            self.target.set(count, tags={"role": role, "gpu_type": gpu_type})
        for (role, gpu_type, state), count in engines.items():
            self.engines.set(count, tags={"role": role, "gpu_type": gpu_type, "state": state})
        self.target_cost.set(target_cost)
        self.cost.set(cost)
        if budget is not None:
            self.budget.set(budget)
        for constraint in BINDING_CONSTRAINTS:
            self.binding.set(float(constraint == binding), tags={"constraint": constraint})
        for kind, rate in rates.items():
            self.rates.set(rate, tags={"kind": kind})
        for action, count in changes.items():
            if count:
                self.changes.inc(count, tags={"action": action})


BINDING_CONSTRAINTS = ("rate", "budget", "stock")
