"""Disaggregated placement: a prefill instance, then a decode instance that knows when
the prompt's KV will reach it.

For each request the prefill pool's policy (least estimated time to first token) picks
where the prompt is computed; the expected TTFT there plus the KV transfer on the link
(`KvLink`, FIFO) give when the KV is ready on the decode side (`RouteRequest.kv_ready_s`),
and the decode pool's policy (GoodServe: just-enough) places the decode on that
estimate. The simulator and the live router call the same `DisaggregatedPlacer`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from app.engines.messages import EngineStatus
from app.hardware.kv_link import KvLink
from app.routing.base import Reject, RoutingPolicy
from app.routing.baselines import no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest, StepReport


class LeastTtftPolicy(RoutingPolicy):
    """Prefill pool: the instance with the least estimated time to first token, from
    the same black-box status estimates GoodServe's T uses (ties: view order)."""

    def __init__(self, status: StatusEstimator | None = None) -> None:
        self.status = status if status is not None else StatusEstimator()

    def ttft_s(self, request: RouteRequest, inst: InstanceView, view: ClusterView,
               now: float) -> float:
        """Queue + prefill of the uncached prompt on `inst`: T's first two terms."""
        estimate = self.status.estimate(inst, now, priority=request.priority)
        hit = view.prefix_hit_tokens(inst.instance_id, request)
        if request.kv_ready_s is not None:
            return estimate.queue_delay_s
        uncached = max(request.num_context_tokens - hit, 1)
        return estimate.queue_delay_s + uncached * estimate.prefill_s_per_token

    def least_ttft(self, request: RouteRequest, view: ClusterView,
                   now: float) -> tuple[InstanceView, float] | Reject:
        """The instance with the least estimated TTFT, and that estimate."""
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        return min(((v, self.ttft_s(request, v, view, now)) for v in candidates),
                   key=lambda pair: pair[1])

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> InstanceId | Reject:
        best = self.least_ttft(request, view, now)
        return best if isinstance(best, Reject) else best[0].instance_id

    def on_step(self, instance_id: InstanceId, report: StepReport, now: float) -> None:
        self.status.on_step(instance_id, report, now)

    def on_status(self, status: EngineStatus, now: float) -> None:
        self.status.on_status(status, now)


@dataclass(frozen=True)
class PdPlacement:
    """Where a request's two stages go, and what the router expected of them."""

    prefill_instance: InstanceId
    decode_instance: InstanceId
    ttft_s: float  # estimated time to first token on the prefill instance
    kv_transfer_s: float  # expected transfer time after it, link queueing included


class DisaggregatedPlacer:
    """Places both stages of a request: `prefill_policy` on the prefill pool, then
    `decode_policy` on the decode pool for the request with its KV arrival time."""

    def __init__(self, prefill_policy: LeastTtftPolicy, decode_policy: RoutingPolicy,
                 link: KvLink) -> None:
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.link = link

    def place(self, request: RouteRequest, prefill_view: ClusterView,
              decode_view: ClusterView, now: float) -> PdPlacement | Reject:
        best = self.prefill_policy.least_ttft(request, prefill_view, now)
        if isinstance(best, Reject):
            return best
        inst, ttft_s = best
        first_token = now + ttft_s
        num_bytes = request.num_prompt_tokens * inst.spec.model.kv_bytes_per_token
        kv_ready = self.link.expected_done_s(first_token, num_bytes)
        decode = self.decode_policy.choose(replace(request, kv_ready_s=kv_ready), decode_view,
                                           now)
        if isinstance(decode, Reject):
            return decode
        return PdPlacement(inst.instance_id, decode, ttft_s, kv_ready - first_token)
