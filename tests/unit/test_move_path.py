"""Each move takes the path estimated faster: recomputing the uncached context on the
target, or loading its KV over the link (behind the transfers already queued there)."""

from __future__ import annotations

import pytest

from app.hardware import make_instance
from app.kv_link import KvLink
from app.routing.move_path import MovePath, MoveRule, plan_move, recompute_s

pytestmark = pytest.mark.unit

H800 = make_instance("H800", "llama-3.1-8b")
KV_PER_TOKEN = H800.model.kv_bytes_per_token  # 128 KiB for Llama-3.1-8B


def test_estimates_are_the_prefill_and_the_transfer_plus_one_step():
    plan = plan_move(H800, 60_000, 10_000, KvLink(25.0), now=5.0, kv_reachable=True)
    assert KV_PER_TOKEN == 131_072
    assert plan.token_ids_s == pytest.approx(
        H800.solo_phases_s(60_000, 1, num_cached_tokens=10_000)[0])
    assert plan.num_kv_bytes == 50_000 * KV_PER_TOKEN
    transfer_s = 50_000 * KV_PER_TOKEN / 25e9  # 0.262 s
    assert plan.kv_s == pytest.approx(transfer_s + H800.decode_time_per_token_s(60_000))
    assert plan.path is MovePath.KV and plan.kv_s < plan.token_ids_s
    assert plan.estimate_s == plan.kv_s


def test_a_slow_or_busy_link_sends_the_move_by_token_ids():
    slow = plan_move(H800, 2_000, 0, KvLink(0.1), now=0.0, kv_reachable=True)
    assert slow.path is MovePath.TOKEN_IDS and slow.num_kv_bytes == 0
    assert slow.kv_s is not None and slow.kv_s > slow.token_ids_s
    busy = KvLink(25.0)
    busy.enqueue(0.0, 100e9)  # 4 s of transfers ahead
    queued = plan_move(H800, 60_000, 0, busy, now=1.0, kv_reachable=True)
    assert queued.path is MovePath.TOKEN_IDS
    assert queued.kv_s == pytest.approx(3.0 + 60_000 * KV_PER_TOKEN / 25e9
                                        + H800.decode_time_per_token_s(60_000))


def test_no_reachable_kv_or_the_token_ids_rule_recomputes():
    lost = plan_move(H800, 60_000, 0, KvLink(25.0), now=0.0, kv_reachable=False)
    assert lost.path is MovePath.TOKEN_IDS and lost.kv_s is None
    ruled = plan_move(H800, 60_000, 0, KvLink(25.0), now=0.0, kv_reachable=True,
                      rule=MoveRule.TOKEN_IDS)
    assert ruled.path is MovePath.TOKEN_IDS
    forced = plan_move(H800, 2_000, 0, KvLink(0.1), now=0.0, kv_reachable=True,
                       rule=MoveRule.KV)
    assert forced.path is MovePath.KV and forced.num_kv_bytes == 2_000 * KV_PER_TOKEN


def test_a_fully_cached_context_costs_one_token_either_way():
    plan = plan_move(H800, 4_096, 4_096, KvLink(25.0), now=0.0, kv_reachable=True)
    assert plan.token_ids_s == pytest.approx(recompute_s(H800, 4_096, 4_095))
    assert plan.kv_s == pytest.approx(H800.decode_time_per_token_s(4_096))


def test_cached_tokens_outside_the_context_are_an_error():
    with pytest.raises(ValueError, match="outside the context"):
        plan_move(H800, 100, 101, KvLink(25.0), now=0.0, kv_reachable=True)


def test_kv_must_save_a_whole_iteration_of_the_target():
    """512 tokens on an H800 over 50 GB/s: loading is a few ms faster than the prefill,
    less than one decode step, so the move recomputes; at 2,048 tokens it loads."""
    short = plan_move(H800, 512, 0, KvLink(50.0), now=0.0, kv_reachable=True)
    step_s = H800.decode_time_per_token_s(512)
    assert short.kv_s is not None and short.kv_s < short.token_ids_s < short.kv_s + step_s
    assert short.path is MovePath.TOKEN_IDS
    longer = plan_move(H800, 2_048, 0, KvLink(50.0), now=0.0, kv_reachable=True)
    assert longer.path is MovePath.KV
