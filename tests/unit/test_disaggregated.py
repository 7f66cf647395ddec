"""Disaggregated placement: least-TTFT prefill, decode placed on the KV arrival time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.engines.config import EngineRole
from app.hardware.kv_link import KvLink
from app.routing.base import Reject, RoutingPolicy
from app.routing.disaggregated import DisaggregatedPlacer, LeastTtftPolicy, PdPlacement
from app.routing.goodserve import GoodServeConfig, make_goodserve
from app.routing.goodserve.scoring import InstanceScorer
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


def scores(request: RouteRequest, view: ClusterView, status: StatusEstimator,
           now: float) -> InstanceScorer:
    return InstanceScorer.build(request, view.instances, view, status, now, None, 1.0)


def test_decode_estimate_waits_for_the_kv_and_computes_no_prefill():
    status = StatusEstimator()
    view = make_cluster(role_view("A40", EngineRole.DECODE))
    plain = make_request(100.0, prompt=4000, out=50)
    delivered = replace(plain, kv_ready_s=2.0)
    without, with_kv = (scores(r, view, status, 0.5) for r in (plain, delivered))
    # the queue and its decode per token at its own 4k context, and no prefill
    assert with_kv.latency_s(50)[0] == pytest.approx(1.5 + with_kv.queue_s[0]
                                                     + 50 * with_kv.decode_s[0])
    assert with_kv.decode_s[0] > status.estimate(view.instances[0], 0.5).decode_s_per_token
    assert with_kv.stall_s[0] == 0.0 and without.stall_s[0] > 0.0  # no prefill to charge
    late = replace(plain, kv_ready_s=0.1)  # already there: no wait
    now_ready = scores(late, view, status, 0.5)
    assert now_ready.latency_s(50)[0] == pytest.approx(with_kv.latency_s(50)[0] - 1.5)


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
    scorer = scores(replace(probe, kv_ready_s=0.0), decode_view, policy.status, 0.0)
    scored = dict(zip(scorer.arrays.ids, scorer.latency_s(300).tolist(), strict=True))
    assert scored["A40-d"] > 2 * scored["H800-d"]
    tight = replace(probe, request_id="tight", deadline_s=2 * scored["H800-d"])
    loose = replace(probe, request_id="loose", deadline_s=20 * scored["A40-d"])
    assert placer.place(tight, prefill_view, decode_view, 0.0).decode_instance == "H800-d"
    assert placer.place(loose, prefill_view, decode_view, 0.0).decode_instance == "A40-d"
