"""Prefill/decode split of a fixed inventory (SARA's stage models at k = 1) and the
benchmark's config rewriting."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from app.engines.config import ClusterConfig, EngineRole, load_cluster_config
from app.hardware.specs import make_instance
from app.planning.allocator import LengthMoments
from app.planning.decode import DecodeStage
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.search import max_feasible_rate
from app.planning.split import (
    EngineKind,
    engine_capacity,
    kv_capacity,
    split_inventory,
    stage_slos,
)
from benchmarks.goodput_experiments import REPO
from benchmarks.pd_vs_unified import (
    every_prefill_pool,
    inventory,
    read_csv,
    report,
    split_label,
    with_split,
    write_csv,
)

pytestmark = pytest.mark.scripts

LLAMA = ModelParams.named("llama-3.1-8b")
CHAT = LengthMoments(LengthDist.from_moments(300.0, 1.5), 300.0)
SLO = SloTargets(ttft_s=0.05, kv_s=0.05, tpot_s=0.03, p_slo=0.9)
PAPER = {EngineKind("H800"): 1, EngineKind("A800"): 1, EngineKind("A40"): 1,
         EngineKind("V100", 2): 1}


def test_max_feasible_rate_finds_the_boundary_of_a_decreasing_predicate():
    assert max_feasible_rate(lambda r: r <= 37.0, 100.0) == pytest.approx(37.0, rel=2e-3)
    assert max_feasible_rate(lambda r: False, 100.0) == 0.0
    with pytest.raises(ValueError, match="upper rate"):
        max_feasible_rate(lambda r: True, 0.0)


def test_faster_gpus_serve_more_in_both_stages_and_tp_adds_decode_capacity():
    h800, a800, a40 = (engine_capacity(EngineKind(g), LLAMA, CHAT, SLO)
                       for g in ("H800", "A800", "A40"))
    assert h800.prefill_rps > a800.prefill_rps > a40.prefill_rps
    assert h800.decode_rps > a800.decode_rps > 0
    loose = SloTargets(ttft_s=0.5, kv_s=0.5, tpot_s=0.03, p_slo=0.9)
    one, two = (engine_capacity(EngineKind("V100", tp), LLAMA, CHAT, loose) for tp in (1, 2))
    assert two.decode_rps > one.decode_rps and two.prefill_rps > one.prefill_rps


def test_out_of_reach_targets_give_zero_capacity():
    # an unloaded prefill of the mean prompt on a V100 is ~40 ms: a 1 ms TTFT is out of reach
    tight = SloTargets(ttft_s=0.001, kv_s=0.05, tpot_s=0.03, p_slo=0.9)
    assert engine_capacity(EngineKind("V100"), LLAMA, CHAT, tight).prefill_rps == 0.0
    # llama-2-70b (~138 GB of weights) does not fit one A40's 48 GB: no decode there
    big = ModelParams.named("llama-2-70b")
    assert engine_capacity(EngineKind("A40"), big, CHAT, SLO).decode_rps == 0.0
    assert kv_capacity(LLAMA, CHAT, SloTargets(0.05, 1e-7, 0.03, 0.9), 25.0) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        kv_capacity(LLAMA, CHAT, SLO, 0.0)


def test_the_split_is_the_best_of_every_split_by_the_stage_capacities():
    split = split_inventory(PAPER, LLAMA, CHAT, SLO, 25.0)
    caps = {c.kind.name: c for c in split.capacities}
    names = sorted(caps)
    best = 0.0
    for roles in itertools.product((True, False), repeat=len(names)):
        if all(roles) or not any(roles):
            continue
        prefill = sum(caps[n].prefill_rps for n, p in zip(names, roles, strict=True) if p)
        decode = sum(caps[n].decode_rps for n, p in zip(names, roles, strict=True) if not p)
        best = max(best, min(prefill, decode, split.kv_rps))
    assert split.goodput_rps == pytest.approx(best)
    assert split.goodput_rps == min(split.prefill_rps, split.decode_rps, split.kv_rps)
    assert set(split.prefill) | set(split.decode) == set(names)
    assert not set(split.prefill) & set(split.decode)


def test_long_prompts_take_more_engines_to_prefill_than_long_outputs():
    long_prompts = LengthMoments(LengthDist.from_moments(4000.0, 1.0), 20.0)
    long_outputs = LengthMoments(LengthDist.from_moments(50.0, 1.0), 800.0)
    loose = SloTargets(ttft_s=2.0, kv_s=2.0, tpot_s=0.05, p_slo=0.9)
    eight = {EngineKind("A800"): 8}
    by_prompts = split_inventory(eight, LLAMA, long_prompts, loose, 100.0)
    by_outputs = split_inventory(eight, LLAMA, long_outputs, loose, 100.0)
    assert by_prompts.prefill["A800"] > by_outputs.prefill["A800"]
    two = split_inventory({EngineKind("A800"): 2}, LLAMA, CHAT, SLO, 25.0)
    assert two.prefill == {"A800": 1} and two.decode == {"A800": 1}
    assert [two.role_of(EngineKind("A800"), i) for i in range(2)] == ["prefill", "decode"]


def test_when_no_split_meets_the_slos_ties_go_to_the_larger_capacity():
    # a TPOT below every GPU's unloaded step: decode capacity is zero everywhere
    impossible = SloTargets(ttft_s=0.05, kv_s=0.05, tpot_s=1e-4, p_slo=0.9)
    split = split_inventory(PAPER, LLAMA, CHAT, impossible, 25.0)
    assert split.goodput_rps == 0.0 and split.binding == "decode"
    assert split.prefill_rps == pytest.approx(sum(c.prefill_rps for c in split.capacities))
    assert split.decode  # every split keeps an engine in each pool


def test_the_schedulers_batch_cap_bounds_decode_capacity():
    uncapped = engine_capacity(EngineKind("H800"), LLAMA, CHAT, SLO)
    capped = engine_capacity(EngineKind("H800", 1, 32), LLAMA, CHAT, SLO)
    assert 0 < capped.decode_rps < uncapped.decode_rps
    assert capped.prefill_rps == uncapped.prefill_rps
    # stability with at most 32 running requests (C3): lambda < 32 p0 / E[T_d(32)]
    decode = DecodeStage(LLAMA, DeviceParams.named("H800"), CHAT.input_len, CHAT.mean_output_len)
    assert capped.decode_rps < 32 * decode.p0 / decode.mean_iteration_s(1, 32)


def test_split_input_errors():
    with pytest.raises(ValueError, match="share max_num_seqs"):
        split_inventory({EngineKind("H800", 1, 64): 1, EngineKind("H800", 1, 128): 1}, LLAMA,
                        CHAT, SLO, 25.0)
    with pytest.raises(ValueError, match="at least two engines"):
        split_inventory({EngineKind("H800"): 1}, LLAMA, CHAT, SLO, 25.0)
    with pytest.raises(ValueError, match="candidate splits"):
        split_inventory({EngineKind(g): 200 for g in ("H800", "A800", "A40")}, LLAMA, CHAT,
                        SLO, 25.0)
    with pytest.raises(ValueError, match="tp"):
        EngineKind("H800", 0)


def test_stage_targets_scale_with_the_deadline_scale():
    reference = make_instance("A800", "llama-3.1-8b")
    one, two = (stage_slos(reference, CHAT, s) for s in (1.0, 2.0))
    assert two.ttft_s == pytest.approx(2 * one.ttft_s)
    assert two.tpot_s == pytest.approx(2 * one.tpot_s)
    assert one.kv_s == one.ttft_s
    assert one.tpot_s == pytest.approx(reference.decode_time_per_token_s(450))
    with pytest.raises(ValueError, match="scale"):
        stage_slos(reference, CHAT, 0.0)


def test_a_split_rewrites_the_unified_cluster_into_pools_of_the_same_engines():
    cluster = load_cluster_config(REPO / "configs" / "paper-4gpu.yaml")
    capped = {EngineKind(k.gpu, k.tp, 256): n for k, n in PAPER.items()}
    assert inventory(cluster) == Counter(capped)
    pools = every_prefill_pool(inventory(cluster))
    assert len(pools) == 2**4 - 2
    pd = with_split(cluster, {"H800": 1, "V100x2": 1})
    assert isinstance(pd, ClusterConfig) and pd.mode == "disaggregated"
    roles = {(e.gpu_type, e.tp): e.role for e in pd.engines()}
    assert roles == {("H800", 1): EngineRole.PREFILL, ("V100", 2): EngineRole.PREFILL,
                     ("A800", 1): EngineRole.DECODE, ("A40", 1): EngineRole.DECODE}
    assert split_label({"H800": 1, "V100x2": 1}) == "H800+V100x2"
    assert split_label({"A800": 3}) == "3xA800"


def test_the_report_rebuilds_from_its_csvs(tmp_path):
    splits = [{"seed": 3, "slo_scale": 2.0, "ttft_s": 0.027, "tpot_s": 0.0267, "kv_s": 0.027,
               "p_slo": 0.9, "prefill_pool": "A40+A800", "decode_pool": "H800+V100x2",
               "model_goodput_rps": 125.9, "binding": "prefill"}]
    cells = [{"seed": 3, "slo_scale": 2.0, "cluster": "unified", "sara_pick": False,
              "requests": 100, "met": 90, "goodput_rps": 150.0},
             {"seed": 3, "slo_scale": 2.0, "cluster": "A40+A800", "sara_pick": True,
              "requests": 100, "met": 30, "goodput_rps": 50.0}]
    write_csv(tmp_path / "splits.csv", splits)
    write_csv(tmp_path / "goodput.csv", cells)
    assert read_csv(tmp_path / "goodput.csv") == cells
    report(tmp_path, {"rate_rps": 190}, read_csv(tmp_path / "splits.csv"), cells)
    text = (tmp_path / "report.md").read_text()
    assert "| 2 | 150.0 | 50.0 | 0.33 | A40+A800 | - | - |" in text
    assert (tmp_path / "goodput.png").exists()
