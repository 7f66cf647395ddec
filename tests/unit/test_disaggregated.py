"""Disaggregated placement: least-TTFT prefill, decode placed on the KV arrival time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.engines.config import EngineRole
from app.hardware.kv_link import KvLink
from app.routing.base import Reject, RoutingPolicy
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy, PdPlacement
from app.routing.goodserve import GoodServeConfig, make_goodserve
from app.routing.goodserve.latency import for_context, score_instances
from app.routing.instance_view import InstanceId
from app.routing.length import TrueLength
from app.routing.status import StatusEstimator
from app.routing.view import ClusterView, RouteRequest
from tests.unit.routing_utils import make_cluster, make_request, make_view

pytestmark = pytest.mark.unit


def role_view(gpu: str, role: EngineRole, instance_id: str | None = None, **kw):
    return replace(make_view(gpu, instance_id=instance_id, **kw), role=role)


class Recorder(RoutingPolicy):
    """Decode policy that takes the first instance and remembers what it was asked."""

    def __init__(self) -> None:
        self.seen: list[RouteRequest] = []

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> InstanceId:
        self.seen.append(request)
        return view.instances[0].instance_id


def test_prefill_goes_where_queue_plus_uncached_prefill_is_least():
    status = StatusEstimator()
    policy = LeastTtftPolicy(status)
    views = [role_view("H800", EngineRole.PREFILL, waiting=4),
             role_view("A800", EngineRole.PREFILL)]
    request = make_request(100.0, prompt=4000, block_hashes=tuple(range(250)))
    assert policy.choose(request, make_cluster(*views), 0.0) == "H800"  # faster prefill
    status.observe_queue_wait("H800", 5.0, 0.0)  # its queue holds prompts for 5 s
    assert policy.choose(request, make_cluster(*views), 0.0) == "A800"
    status.forget("H800")
    assert policy.choose(request, make_cluster(*views), 0.0) == "H800"
    cached = make_cluster(*views, hits={"A800": 250})  # the whole prompt cached there
    assert policy.choose(request, cached, 0.0) == "A800"
    huge = make_request(100.0, prompt=10**9)
    assert isinstance(policy.choose(huge, make_cluster(*views), 0.0), Reject)


def test_decode_estimate_waits_for_the_kv_and_computes_no_prefill():
    status = StatusEstimator()
    view = make_cluster(role_view("A40", EngineRole.DECODE))
    plain = make_request(100.0, prompt=4000, out=50)
    delivered = replace(plain, kv_ready_s=2.0)
    (without,) = score_instances(plain, view.instances, view, status, 50, 0.5, None, 1.0)
    (with_kv,) = score_instances(delivered, view.instances, view, status, 50, 0.5, None, 1.0)
    # its decode per token at its own 4k context (`for_context`)
    estimate = for_context(status.estimate(view.instances[0], 0.5), view.instances[0].spec,
                           delivered, 0)
    assert with_kv.latency_s == pytest.approx(1.5 + estimate.queue_delay_s
                                              + 50 * estimate.decode_s_per_token)
    assert with_kv.stall_s == 0.0 and without.stall_s > 0.0  # no prefill compute to charge
    late = replace(plain, kv_ready_s=0.1)  # already there: no wait
    (now_ready,) = score_instances(late, view.instances, view, status, 50, 0.5, None, 1.0)
    assert now_ready.latency_s == pytest.approx(with_kv.latency_s - 1.5)


def test_the_decode_policy_is_told_when_the_kv_arrives_link_queue_included():
    link = KvLink(bandwidth_gbps=1.0)
    link.enqueue(0.0, 3e9)  # the link is busy for 3 s
    decode = Recorder()
    prefill = LeastTtftPolicy()
    placer = DisaggregatedPlacer(prefill, decode, link)
    prefill_view = make_cluster(role_view("H800", EngineRole.PREFILL))
    decode_view = make_cluster(role_view("A40", EngineRole.DECODE))
    request = make_request(100.0, prompt=2000)
    placement = placer.place(request, prefill_view, decode_view, 1.0)
    assert isinstance(placement, PdPlacement)
    ttft = prefill.ttft_s(request, prefill_view.instances[0], prefill_view, 1.0)
    kv_bytes = 2000 * prefill_view.instances[0].spec.model.kv_bytes_per_token
    assert placement.ttft_s == pytest.approx(ttft)
    assert placement.kv_transfer_s == pytest.approx(3.0 + kv_bytes / 1e9 - (1.0 + ttft))
    assert decode.seen[0].kv_ready_s == pytest.approx(3.0 + kv_bytes / 1e9)
    assert link.busy_until_s == 3.0  # placing reserves nothing: the transfer is queued later
    assert request.kv_ready_s is None


def test_a_tight_deadline_decodes_on_the_fast_gpu_a_loose_one_on_the_slow_gpu():
    policy, _ = make_goodserve(TrueLength(), GoodServeConfig())
    placer = DisaggregatedPlacer(LeastTtftPolicy(), policy, KvLink(25.0))
    prefill_view = make_cluster(role_view("H800", EngineRole.PREFILL))
    decode_view = make_cluster(role_view("H800", EngineRole.DECODE, "H800-d"),
                               role_view("A40", EngineRole.DECODE, "A40-d"))
    probe = make_request(1e9, prompt=2000, out=300)
    scored = {c.instance_id: c.latency_s for c in score_instances(
        replace(probe, kv_ready_s=0.0), decode_view.instances, decode_view, policy.status,
        300, 0.0, None, 1.0)}
    assert scored["A40-d"] > 2 * scored["H800-d"]
    tight = replace(probe, request_id="tight", deadline_s=2 * scored["H800-d"])
    loose = replace(probe, request_id="loose", deadline_s=20 * scored["A40-d"])
    assert placer.place(tight, prefill_view, decode_view, 0.0).decode_instance == "H800-d"
    assert placer.place(loose, prefill_view, decode_view, 0.0).decode_instance == "A40-d"
