"""Each move takes the path estimated faster: recomputing the uncached context on the
target, or loading the reachable KV over the link (behind the transfers already queued
there) and computing the rest."""

from __future__ import annotations

import pytest

from app.hardware.kv_link import KvLink
from app.hardware.specs import make_instance
from app.routing.move_path import MovePath, MoveRule, batch_stall_s, plan_move, recompute_s

pytestmark = pytest.mark.unit

H800 = make_instance("H800", "llama-3.1-8b")
KV_PER_TOKEN = H800.model.kv_bytes_per_token  # 128 KiB for Llama-3.1-8B


def plan(context, cached=0, gbps=25.0, loadable=None, link=None, now=0.0, **kwargs):
    return plan_move(H800, context, cached, link or KvLink(gbps), now,
                     num_loadable_tokens=context if loadable is None else loadable, **kwargs)


def test_estimates_are_the_prefill_and_the_transfer_plus_the_last_token():
    moved = plan(60_000, cached=10_000, now=5.0)
    assert KV_PER_TOKEN == 131_072
    assert moved.token_ids_s == pytest.approx(
        H800.solo_phases_s(60_000, 1, num_cached_tokens=10_000)[0])
    assert moved.num_kv_bytes == 50_000 * KV_PER_TOKEN
    transfer_s = 50_000 * KV_PER_TOKEN / 25e9  # 0.262 s
    assert moved.kv_s == pytest.approx(transfer_s + recompute_s(H800, 60_000, 60_000))
    assert moved.path is MovePath.KV and moved.kv_s < moved.token_ids_s
    assert moved.estimate_s == moved.kv_s


def test_a_partly_loadable_context_computes_the_rest():
    """Live, the connector holds the prompt's blocks: the generated tokens are computed."""
    moved = plan(60_000, loadable=59_000)
    assert moved.num_kv_bytes == 59_000 * KV_PER_TOKEN
    assert moved.kv_s == pytest.approx(59_000 * KV_PER_TOKEN / 25e9
                                       + recompute_s(H800, 60_000, 59_000))


def test_a_slow_or_busy_link_sends_the_move_by_token_ids():
    slow = plan(2_000, gbps=0.1)
    assert slow.path is MovePath.TOKEN_IDS and slow.num_kv_bytes == 0
    assert slow.kv_s is not None and slow.kv_s > slow.token_ids_s
    busy = KvLink(25.0)
    busy.enqueue(0.0, 100e9)  # 4 s of transfers ahead
    queued = plan(60_000, link=busy, now=1.0)
    assert queued.path is MovePath.TOKEN_IDS
    assert queued.kv_s == pytest.approx(3.0 + 60_000 * KV_PER_TOKEN / 25e9
                                        + recompute_s(H800, 60_000, 60_000))


def test_nothing_loadable_beyond_the_cache_or_the_token_ids_rule_recomputes():
    lost = plan(60_000, loadable=0)
    assert lost.path is MovePath.TOKEN_IDS and lost.kv_s is None
    cached = plan(60_000, cached=30_000, loadable=20_000)
    assert cached.path is MovePath.TOKEN_IDS and cached.kv_s is None
    ruled = plan(60_000, rule=MoveRule.TOKEN_IDS)
    assert ruled.path is MovePath.TOKEN_IDS
    forced = plan(2_000, gbps=0.1, rule=MoveRule.KV)
    assert forced.path is MovePath.KV and forced.num_kv_bytes == 2_000 * KV_PER_TOKEN


def test_kv_must_save_a_whole_iteration_of_the_target():
    """512 tokens on an H800 over 50 GB/s: loading is a few ms faster than the prefill,
    less than one decode step, so the move recomputes; at 2,048 tokens it loads."""
    short = plan(512, gbps=50.0)
    step_s = H800.decode_time_per_token_s(512)
    assert short.kv_s is not None and short.kv_s < short.token_ids_s < short.kv_s + step_s
    assert short.path is MovePath.TOKEN_IDS
    assert plan(2_048, gbps=50.0).path is MovePath.KV


def test_a_recompute_is_charged_with_the_stall_it_puts_on_the_running_batch():
    """A 4k context over a link slow enough that loading is the slower path for the
    moved request alone: on an idle target it recomputes; with 32 requests running,
    each of which would wait for the prefill, the load (which stalls none) wins."""
    step_s = H800.decode_time_per_token_s(4_000)
    alone = plan(4_000, gbps=1.5)
    assert alone.kv_s is not None and alone.kv_s > alone.token_ids_s
    assert alone.path is MovePath.TOKEN_IDS and alone.token_ids_stall_s == 0.0
    busy = plan(4_000, gbps=1.5, num_running_on_target=32)
    assert busy.token_ids_stall_s == pytest.approx(32 * (busy.token_ids_s - step_s))
    assert busy.kv_stall_s == 0.0  # the whole context loads: nothing left to compute
    assert busy.path is MovePath.KV
    assert busy.estimate_s == busy.kv_s  # the request's own time, not the batch's


def test_a_prefill_within_one_iteration_stalls_nobody():
    assert batch_stall_s(0.010, 0.012, 64) == 0.0
    assert batch_stall_s(0.030, 0.010, 4) == pytest.approx(0.080)
    short = plan(62, num_running_on_target=64)  # a chat prompt: about one H800 step
    assert short.token_ids_stall_s < 64 * 0.001


def test_token_counts_outside_the_context_are_an_error():
    with pytest.raises(ValueError, match="cached tokens 101 outside"):
        plan(100, cached=101)
    with pytest.raises(ValueError, match="loadable tokens 101 outside"):
        plan(100, loadable=101)
    with pytest.raises(ValueError, match="running requests -1"):
        plan(100, num_running_on_target=-1)
