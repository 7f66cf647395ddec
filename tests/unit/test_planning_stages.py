"""Stage models of the SARA planner: literal values, monotonicity, the C1-C4 region."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.kv import KvStage
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.prefill import PrefillStage
from app.planning.queues import Method

pytestmark = pytest.mark.unit


def make_model() -> ModelParams:
    """Llama-3.1-8B's shape with round weights."""
    return ModelParams("toy-8b", 32, 4096, 14336, 0.25, 16, 16e9, ffn_matrices=3)


def make_device(mults_per_s: float = 3e14, price: float = 2.0) -> DeviceParams:
    return DeviceParams("X", mults_per_s, 1.2e12, 80e9, price)


def make_slo(**overrides) -> SloTargets:
    values = {"ttft_s": 1.5, "kv_s": 0.2, "tpot_s": 0.02, "p_slo": 0.9}
    values.update(overrides)
    return SloTargets(**values)


def test_model_symbols_match_the_paper() -> None:
    model = make_model()
    assert model.gamma_bytes == 32 * 4096 * 16 / 4  # N_layer N_mod N_bits / 4
    assert model.kv_bytes_per_token == 131072.0  # g gamma: 2 x 32 layers x 1024 x 2 bytes
    # N_mul(L) = N_layer[(2+2g) L N_mod^2 + (L^2+L) N_mod + m L N_mod N_hid], m = 3 here
    assert model.num_mults(10) == 32 * (2.5 * 10 * 4096**2 + 110 * 4096 + 3 * 10 * 4096 * 14336)
    assert model.quadratic_share(1024) < 0.026  # the paper's "below 2.6%" regime


def test_prefill_alpha_literal() -> None:
    stage = PrefillStage(make_model(), make_device(), LengthDist.exponential(1000))
    per_token = 32 * (2.5 * 4096**2 + (3 * 14336 + 1) * 4096)
    assert stage.seconds_per_token == pytest.approx(per_token / 3e14)
    assert stage.service.mean == pytest.approx(1000 * per_token / 3e14)


@pytest.mark.parametrize("method", list(Method))
def test_prefill_more_traffic_never_needs_fewer_instances(method: Method) -> None:
    stage = PrefillStage(make_model(), make_device(), LengthDist.lognormal(1024, 2.0))
    sizes = [
        stage.min_instances(rate, 0.3, 0.9, method).num_instances
        for rate in (1.0, 10.0, 20.0, 40.0, 60.0, 80.0)
    ]
    assert sizes == sorted(sizes)
    assert sizes[-1] > sizes[0]


@pytest.mark.parametrize("method", list(Method))
def test_prefill_tighter_slo_never_needs_fewer_instances(method: Method) -> None:
    stage = PrefillStage(make_model(), make_device(), LengthDist.lognormal(1024, 2.0))
    by_tau = [stage.min_instances(40.0, tau, 0.9, method).num_instances for tau in (2, 0.6, 0.3)]
    by_p = [stage.min_instances(40.0, 0.3, p, method).num_instances for p in (0.5, 0.9, 0.98)]
    assert by_tau == sorted(by_tau)
    assert by_p == sorted(by_p)


def test_prefill_min_instances_is_the_boundary() -> None:
    stage = PrefillStage(make_model(), make_device(), LengthDist.lognormal(1024, 1.5))
    sizing = stage.min_instances(300.0, 0.12, 0.95)
    assert sizing.binding == "ttft_slo"
    assert sizing.num_instances > stage.stability_floor(300.0)
    assert stage.meets_slo(300.0, sizing.num_instances, 0.12, 0.95, Method.REFINED)
    assert not stage.meets_slo(300.0, sizing.num_instances - 1, 0.12, 0.95, Method.REFINED)


def test_prefill_unattainable_slo_returns_none() -> None:
    stage = PrefillStage(make_model(), make_device(), LengthDist.exponential(1024))
    assert stage.min_instances(1.0, stage.service.mean * 0.01, 0.9) is None


def test_kv_paper_bandwidth_closed_form_literal() -> None:
    stage = KvStage(make_model(), LengthDist.exponential(1024))
    bytes_per_request = 131072.0 * 1024
    expected = bytes_per_request * (20 + math.log(10) / 0.2)  # lambda m + m ln(1/(1-p)) / tau
    sizing = stage.min_bandwidth(20.0, 0.2, 0.9, Method.PAPER)
    assert sizing.bandwidth_bytes_per_s == pytest.approx(expected)


def test_kv_refined_equals_paper_for_exponential_lengths() -> None:
    """Exponential L_i makes the KV link M/M/1, where the closed form is exact."""
    stage = KvStage(make_model(), LengthDist.exponential(1024))
    paper = stage.min_bandwidth(20.0, 0.2, 0.9, Method.PAPER).bandwidth_bytes_per_s
    refined = stage.min_bandwidth(20.0, 0.2, 0.9, Method.REFINED).bandwidth_bytes_per_s
    assert refined == pytest.approx(paper, rel=1e-3)


@pytest.mark.parametrize("method", list(Method))
def test_kv_bandwidth_monotone_and_above_stability_floor(method: Method) -> None:
    stage = KvStage(make_model(), LengthDist.lognormal(2048, 2.0))
    by_rate = [stage.min_bandwidth(r, 0.2, 0.9, method).bandwidth_bytes_per_s for r in (5, 20, 50)]
    by_p = [stage.min_bandwidth(20, 0.2, p, method).bandwidth_bytes_per_s for p in (0.5, 0.9, 0.99)]
    assert by_rate == sorted(by_rate) and by_p == sorted(by_p)
    assert all(b > stage.stability_floor(r) for b, r in zip(by_rate, (5, 20, 50), strict=True))


def test_kv_refined_bandwidth_meets_slo_exactly() -> None:
    stage = KvStage(make_model(), LengthDist.lognormal(2048, 2.0))
    bandwidth = stage.min_bandwidth(20.0, 0.2, 0.9).bandwidth_bytes_per_s
    assert stage.latency_cdf(20.0, bandwidth, 0.2) == pytest.approx(0.9, abs=1e-3)
    assert stage.latency_cdf(20.0, bandwidth * 0.98, 0.2) < 0.9


def make_decode(input_len: LengthDist | None = None) -> DecodeStage:
    return DecodeStage(make_model(), make_device(), input_len or LengthDist.exponential(1024), 256)


def test_decode_p0_and_throughput_saturation() -> None:
    stage = make_decode()
    assert stage.p0 == pytest.approx(1 - math.exp(-1 / 256))
    gammas = [stage.token_throughput(2, n) for n in (1, 16, 256, 4096, 1 << 20)]
    assert gammas == sorted(gammas)  # dGamma/dN > 0
    assert gammas[-1] == pytest.approx(stage.saturation_throughput(2), rel=1e-3)
    # Gamma_max = k_d B_HBM / (g gamma (l_i + E[age]))
    assert stage.saturation_throughput(2) == pytest.approx(
        2 * 1.2e12 / (131072 * (1024 + 1 / stage.p0))
    )


@pytest.mark.parametrize("method", list(Method))
def test_decode_c1_cap_is_the_tpot_boundary(method: Method) -> None:
    stage = make_decode(LengthDist.lognormal(1024, 2.0))
    cap = stage.max_batch_tpot(2, 0.02, 0.9, method)
    assert cap > 0
    assert stage.tpot_quantile(2, cap, 0.9, method) <= 0.02 * (1 + 1e-3)
    assert stage.tpot_quantile(2, cap + 1, 0.9, method) > 0.02 * (1 - 1e-3)


def test_decode_region_bounds_move_the_right_way_with_devices() -> None:
    stage = make_decode()
    slo = make_slo()
    bounds = [stage.batch_bounds(k, 20.0, slo, Method.REFINED) for k in (2, 3, 4)]
    assert [b.c1_max for b in bounds] == sorted(b.c1_max for b in bounds)  # C1 grows with k_d
    assert [b.c4_min for b in bounds] == sorted((b.c4_min for b in bounds), reverse=True)
    assert all(b.c4_min >= b.c3_min for b in bounds)  # C4 is tighter than C3


def test_decode_c3_is_the_stability_boundary() -> None:
    stage = make_decode()
    n = stage.min_batch_stable(2, 20.0)
    capacity = lambda size: size * stage.p0 / stage.mean_iteration_s(2, size)  # noqa: E731
    assert capacity(n) > 20.0 >= capacity(n - 1)


@pytest.mark.parametrize("method", list(Method))
def test_decode_devices_monotone_in_rate_and_tpot(method: Method) -> None:
    stage = make_decode(LengthDist.lognormal(1024, 1.5))
    by_rate = [stage.min_devices(r, make_slo(), method).num_devices for r in (1, 10, 20, 40)]
    by_tpot = [
        stage.min_devices(20, make_slo(tpot_s=t), method).num_devices for t in (0.05, 0.02, 0.015)
    ]
    assert by_rate == sorted(by_rate) and by_rate[-1] > by_rate[0]
    assert by_tpot == sorted(by_tpot)


def test_decode_sizing_has_a_feasible_batch() -> None:
    stage = make_decode()
    sizing = stage.min_devices(20.0, make_slo())
    assert 1 <= sizing.min_batch_size <= sizing.max_batch_size
    below = stage.batch_bounds(sizing.num_devices - 1, 20.0, make_slo(), Method.REFINED)
    assert not below.feasible


def test_occupancy_is_over_dispersed_by_the_feedback() -> None:
    stage = make_decode(LengthDist.lognormal(4096, 2.0))
    refined = stage.occupancy(2, 5.0, Method.REFINED)
    paper = stage.occupancy(2, 5.0, Method.PAPER)
    assert refined.mean == pytest.approx(paper.mean)
    assert refined.variance > paper.variance == pytest.approx(paper.mean)
    assert stage.occupancy(2, 1e6) is None  # beyond p0 Gamma_max: unstable


def test_tpot_mixture_is_below_full_batch() -> None:
    stage = make_decode()
    probs = np.array([0.5, 0.9])
    full = stage.tpot_quantiles(2, 128, probs)
    loaded = stage.tpot_quantiles(2, 128, probs, rate_rps=10.0)
    assert np.all(loaded < full)


@pytest.mark.parametrize(
    "overrides", [{"ttft_s": 0.0}, {"p_slo": 1.0}, {"p_mem": 0.0}, {"tpot_s": -1.0}]
)
def test_bad_slo_parameters_are_rejected(overrides: dict) -> None:
    with pytest.raises(ValueError):
        make_slo(**overrides)


def test_bad_lengths_are_rejected() -> None:
    with pytest.raises(ValueError):
        LengthDist.lognormal(-5.0, 1.0)
    with pytest.raises(ValueError):
        LengthDist(100.0, 2.0)  # an exponential has cv 1
    with pytest.raises(ValueError):
        DecodeStage(make_model(), make_device(), LengthDist.exponential(10), 0.0)
