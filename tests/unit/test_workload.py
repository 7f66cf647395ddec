"""Trace/prompt loaders (and the one error form every loader shares), arrival processes,
workload assembly and SLO assignment."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.hardware.specs import make_instance
from app.workloads.sessions import load_session_trace
from app.workloads.slo import assign_slos, parse_scales, reference_instance, solo_latencies_s
from app.workloads.workload import (
    Arrivals,
    BurstDistribution,
    Content,
    PromptRow,
    SyntheticArrivals,
    TraceRow,
    Workload,
    WorkloadRequest,
    batch_arrivals,
    burst_sizes,
    gamma_arrivals,
    load_azure,
    load_mooncake,
    load_prompts,
    load_trace,
    make_workload,
    native_rate,
    poisson_arrivals,
    poisson_workload,
    sample_contents,
    scale_and_window,
    spread_within_ticks,
    synthetic_workload,
    text_block_hashes,
    trace_workload,
)

pytestmark = pytest.mark.unit


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def mooncake_row(ts: int = 0, inp: int = 600, out: int = 20, ids=(0, 1)) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(ids)}


# ---- real shared data ---------------------------------------------------------------------


def test_mooncake_conversation_trace(shared_data_dir: Path) -> None:
    rows = load_mooncake(shared_data_dir / "traces" / "mooncake_conversation_trace.jsonl")
    assert len(rows) == 12031
    first = rows[0]
    assert (first.arrival_s, first.content.num_prompt_tokens) == (0.0, 6758)
    assert first.content.num_output_tokens == 500 and first.content.hash_block_size == 512
    assert first.content.block_hashes[:3] == (0, 1, 2)
    assert native_rate(rows) == pytest.approx(3.40, abs=0.01)
    scaled, window = scale_and_window(rows, rate=1.0, duration_s=600.0)
    assert window == 600.0 and max(r.arrival_s for r in scaled) < 600.0
    assert 450 < len(scaled) < 750  # ~1 req/s on average; the trace is bursty


def test_prompt_rows_pair_with_trace_arrivals(shared_data_dir: Path) -> None:
    prompts = load_prompts(shared_data_dir / "prompts" / "prompt_lengths.jsonl")
    assert len(prompts) == 7746
    rows = [TraceRow(float(i), Content(5000, 100)) for i in range(50)]
    a = trace_workload(rows, prompts=prompts, seed=4)
    assert a == trace_workload(rows, prompts=prompts, seed=4)
    assert a != trace_workload(rows, prompts=prompts, seed=5)
    rows_seen = {(p.prompt, p.prompt_tokens, p.output_tokens, p.task) for p in prompts}
    for r in a.requests:  # the same prompt answered by several models: match whole rows
        assert (r.prompt, r.num_prompt_tokens, r.num_output_tokens, r.task) in rows_seen
        assert r.hash_block_size == 16 and r.arrival_s == float(r.request_id[1:])


# ---- malformed input ------------------------------------------------------------------------


@dataclass(frozen=True)
class LoaderCase:
    """A loader, the suffix of its files and one valid row, for the checks every loader
    shares: one error form, `file:line: field 'name': what is wrong`."""

    load: Callable[[Path], list]
    suffix: str
    valid: dict[str, Any]
    count: str  # an integer token count of the row

    def write(self, path: Path, rows: list[dict[str, Any]]) -> Path:
        """JSON lines, or a CSV whose header is the first row's keys."""
        if self.suffix == ".csv":
            lines = [",".join(rows[0]), *(",".join(str(v) for v in r.values()) for r in rows)]
            path.write_text("\n".join(lines) + "\n")
            return path
        return write_jsonl(path, rows)

    @property
    def first_row_line(self) -> int:
        return 2 if self.suffix == ".csv" else 1


MOONCAKE_ROW = {"timestamp": 1500, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]}
AZURE_ROW = {"TIMESTAMP": "2023-11-16 18:15:46.6805900", "ContextTokens": "374",
             "GeneratedTokens": "44"}
PROMPT_ROW = {"prompt_id": "a", "source": "s", "task": "t", "model": "m", "prompt_tokens": 3,
              "output_tokens": 4, "prompt": "hi there"}
SESSION_ROW = {"session_id": "a", "step_id": "0", "input_tokens": 500, "output_tokens": 7}
LOADERS = {
    "mooncake": LoaderCase(load_mooncake, ".jsonl", MOONCAKE_ROW, "input_length"),
    "trace-jsonl": LoaderCase(load_trace, ".jsonl", MOONCAKE_ROW, "output_length"),
    "azure": LoaderCase(load_azure, ".csv", AZURE_ROW, "ContextTokens"),
    "trace-csv": LoaderCase(load_trace, ".csv", AZURE_ROW, "GeneratedTokens"),
    "prompts": LoaderCase(load_prompts, ".jsonl", PROMPT_ROW, "prompt_tokens"),
    "sessions": LoaderCase(load_session_trace, ".jsonl", SESSION_ROW, "input_tokens"),
}
# a count written as text, or as a float: JSON's integer is 12; a CSV cell's, "12"
NOT_INTEGERS = {".jsonl": ["12", 12.0, True], ".csv": ["12.0", "twelve", "1_2"]}


@pytest.mark.parametrize("name", list(LOADERS))
def test_every_loader_rejects_a_count_that_is_not_an_integer(tmp_path, name) -> None:
    case = LOADERS[name]
    for value in NOT_INTEGERS[case.suffix]:
        path = case.write(tmp_path / f"rows{case.suffix}", [case.valid | {case.count: value}])
        expected = f"{path}:{case.first_row_line}: field '{case.count}': " \
                   "Input should be a valid integer"
        with pytest.raises(ValueError) as info:
            case.load(path)
        assert str(info.value) == expected, value


@pytest.mark.parametrize("name", list(LOADERS))
def test_every_loader_names_a_missing_field(tmp_path, name) -> None:
    case = LOADERS[name]
    row = {k: v for k, v in case.valid.items() if k != case.count}
    path = case.write(tmp_path / f"rows{case.suffix}", [row])
    with pytest.raises(ValueError) as info:
        case.load(path)
    assert str(info.value) == f"{path}:{case.first_row_line}: field '{case.count}': " \
                              "Field required"


@pytest.mark.parametrize("name", list(LOADERS))
def test_every_loader_names_the_line_of_a_bad_row(tmp_path, name) -> None:
    case = LOADERS[name]
    rows = [case.valid, case.valid | {case.count: 0}]
    if name == "sessions":  # a second step of the session needs its own id
        rows[1] = rows[1] | {"step_id": "1"}
    path = case.write(tmp_path / f"rows{case.suffix}", rows)
    with pytest.raises(ValueError) as info:
        case.load(path)
    assert str(info.value) == f"{path}:{case.first_row_line + 1}: field '{case.count}': " \
                              "Input should be greater than or equal to 1"


def test_the_trace_loaders_accept_the_valid_forms(tmp_path) -> None:
    """A timestamp may be an integer or a float; hash ids default to none; CSV counts are
    decimal text, a CSV timestamp a datetime or seconds; other keys are ignored."""
    path = write_jsonl(tmp_path / "t.jsonl", [
        MOONCAKE_ROW | {"extra": "ignored"},
        {"timestamp": 2500.5, "input_length": 7, "output_length": 1}])
    rows = load_mooncake(path)
    assert [r.arrival_s for r in rows] == [1.5, 2.5005]
    assert [r.content.block_hashes for r in rows] == [(0, 1), ()]
    assert (rows[1].content.num_prompt_tokens, rows[1].content.num_output_tokens) == (7, 1)
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Other\n12.5,100, 10 ,x\n10,8,4,y\n")
    rows = load_azure(path)
    assert [(r.arrival_s, r.content.num_prompt_tokens, r.content.num_output_tokens)
            for r in rows] == [(0.0, 8, 4), (2.5, 100, 10)]


def test_prompt_rows_accept_integer_ids_and_default_their_labels(tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [
        PROMPT_ROW | {"prompt_id": 17, "extra": 1},
        {"prompt_tokens": 3, "output_tokens": 4, "prompt": "p"}])
    first, second = load_prompts(path)
    assert first == PromptRow("17", "s", "t", "m", 3, 4, "hi there")
    assert second == PromptRow(f"{path}:2", "", "", "", 3, 4, "p")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"timestamp": "0", "input_length": 5, "output_length": 3}',
         "field 'timestamp': Input should be a valid number"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 3}',
         "field 'timestamp': Input should be greater than or equal to 0"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": [1, "a"]}',
         "field 'hash_ids': Input should be a valid integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": null}',
         "field 'hash_ids': Input should be a valid list"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_mooncake_names_file_line_and_field(tmp_path, line, message) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(), "", line])
    with pytest.raises(ValueError) as info:
        load_mooncake(path)
    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)


def test_missing_empty_and_unknown_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="file not found"):
        load_mooncake(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no requests"):
        load_mooncake(write_jsonl(tmp_path / "e.jsonl", [""]))
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "trace.parquet")


def test_azure_csv(tmp_path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.1805900,100,10\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
    )
    rows = load_trace(path)
    assert [r.arrival_s for r in rows] == pytest.approx([0.0, 0.5])
    assert rows[0].content.num_prompt_tokens == 374 and rows[1].content.num_output_tokens == 10
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError) as info:
        load_azure(path)
    assert str(info.value) == (f"{path}:2: field 'TIMESTAMP': Input should be a datetime "
                               "or a number of seconds")


def test_prompt_rows_need_text(tmp_path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt_tokens": 3, "output_tokens": 4}])
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}:1: field 'prompt': Field required"


# ---- arrivals and assembly ----------------------------------------------------------------------


def test_time_scaling_and_windowing() -> None:
    rows = [TraceRow(10.0 + 2 * i, Content(10, 5)) for i in range(11)]  # 0.5 req/s
    scaled, window = scale_and_window(rows, rate=2.0)
    assert [r.arrival_s for r in scaled][:3] == pytest.approx([0.0, 0.5, 1.0])
    assert native_rate(scaled) == pytest.approx(2.0) and window == pytest.approx(5.0)
    kept, window = scale_and_window(rows, rate=2.0, duration_s=2.0)
    assert len(kept) == 4 and window == 2.0
    kept, window = scale_and_window(rows, max_requests=3)
    assert len(kept) == 3 and window == pytest.approx(4.0)
    with pytest.raises(ValueError, match="rate must be > 0"):
        scale_and_window(rows, rate=0.0)
    with pytest.raises(ValueError, match="no requests"):
        scale_and_window(rows, rate=2.0, duration_s=1e-9, max_requests=0)


def test_poisson_arrivals_rate_and_determinism() -> None:
    times = poisson_arrivals(50.0, 200.0, seed=1)
    assert len(times) == pytest.approx(10_000, rel=0.05)
    assert times == poisson_arrivals(50.0, 200.0, seed=1) and times == sorted(times)
    workload = poisson_workload(5.0, 10.0, [Content(7, 3)], seed=2)
    assert workload.duration_s == 10.0 and all(r.num_prompt_tokens == 7 for r in workload.requests)


def _cv(times: list[float]) -> float:
    gaps = np.diff(np.asarray(times))
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("cv", [1.0, 4.0, 13.0])
def test_gamma_arrivals_keep_the_rate_and_reach_the_burstiness(cv: float) -> None:
    times = gamma_arrivals(50.0, 2000.0, cv, seed=5)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 2000.0
    assert gamma_arrivals(50.0, 2000.0, cv, seed=5) == times  # seeded
    assert len(times) / 2000.0 == pytest.approx(50.0, rel=0.15 if cv > 4 else 0.05)
    assert _cv(times) == pytest.approx(cv, rel=0.2)


def test_gamma_arrivals_reject_a_bad_burstiness() -> None:
    with pytest.raises(ValueError, match="burstiness"):
        gamma_arrivals(10.0, 10.0, 0.0, seed=0)


@pytest.mark.parametrize("distribution", list(BurstDistribution))
def test_batch_arrivals_come_in_simultaneous_bursts_at_the_rate(distribution) -> None:
    times = batch_arrivals(40.0, 1000.0, 8.0, distribution, seed=3)
    epochs, sizes = np.unique(times, return_counts=True)
    assert len(times) / 1000.0 == pytest.approx(40.0, rel=0.1)
    assert sizes.mean() == pytest.approx(8.0, rel=0.1) and sizes.min() >= 1
    if distribution == BurstDistribution.FIXED:
        assert set(sizes) == {8}
    else:
        assert sizes.max() > 8
    assert batch_arrivals(40.0, 1000.0, 8.0, distribution, seed=3) == times


def test_burst_sizes_need_a_mean_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="mean burst size"):
        burst_sizes(BurstDistribution.GEOMETRIC, 0.5, 3, np.random.default_rng(0))


def test_synthetic_workload_names_its_process_and_shares_content_draws() -> None:
    pool = [Content(10 + k, 5) for k in range(50)]
    gamma = synthetic_workload(SyntheticArrivals(Arrivals.GAMMA, 20.0, 30.0, burstiness=4.0),
                               pool, seed=2)
    batch = synthetic_workload(SyntheticArrivals(Arrivals.BATCH, 20.0, 30.0, mean_burst=4.0),
                               pool, seed=2)
    assert gamma.name == "gamma-cv4" and batch.name == "batch-geometric4"
    assert gamma.duration_s == 30.0
    first = min(len(gamma), len(batch))
    # content draws depend on the seed only, not on the arrival process
    assert [r.num_prompt_tokens for r in gamma.requests[:first]] == \
        [r.num_prompt_tokens for r in batch.requests[:first]] or first == 0
    with pytest.raises(ValueError, match="not synthetic"):
        SyntheticArrivals(Arrivals.TRACE, 1.0, 1.0).times(0)


def test_sample_contents_cycles_a_seeded_permutation() -> None:
    pool = [Content(n, 1) for n in range(1, 6)]
    picked = sample_contents(pool, 12, seed=0)
    assert sorted(c.num_prompt_tokens for c in picked[:5]) == [1, 2, 3, 4, 5]
    assert picked == sample_contents(pool, 12, seed=0) != sample_contents(pool, 12, seed=1)


def test_make_workload_sorts_and_numbers() -> None:
    workload = make_workload([2.0, 1.0], [Content(5, 1), Content(6, 1)], 3.0, "w")
    assert [(r.request_id, r.arrival_s, r.num_prompt_tokens) for r in workload.requests] == [
        ("r0", 1.0, 6), ("r1", 2.0, 5)]


def test_text_block_hashes_share_prefixes() -> None:
    base = "x" * 200
    a, b = text_block_hashes(base + "aaaa" * 40, 64), text_block_hashes(base + "bbbb" * 40, 64)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert len(text_block_hashes(base, 16)) == 1  # never more blocks than tokens allow


# ---- SLO assignment -----------------------------------------------------------------------------


def test_slo_is_scale_times_solo_time_on_reference() -> None:
    workload = make_workload([0.0, 1.0], [Content(1000, 50), Content(1000, 50)], 1.0, "w")
    reference = reference_instance("llama-3.1-8b")
    assert reference == make_instance("A800", "llama-3.1-8b")
    solo = solo_latencies_s(workload.requests, reference)
    assert solo[0] == solo[1] == reference.solo_latency_s(1000, 50)
    scaled = assign_slos(workload, solo, 2.5)
    assert scaled.requests[1].deadline_s == pytest.approx(1.0 + 2.5 * solo[1])
    with pytest.raises(ValueError, match="> 0"):
        assign_slos(workload, solo, 0.0)


def test_parse_scales() -> None:
    assert parse_scales("1,1.5, 2") == (1.0, 1.5, 2.0)
    with pytest.raises(ValueError, match="bad SLO scale 'a'"):
        parse_scales("1,a")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_scales("1,-2")


def test_demo_workload_is_seeded_and_shares_a_system_prompt():
    from app.experiments.demo import demo_contents, demo_workload

    contents = demo_contents(seed=3)
    assert contents == demo_contents(seed=3) and contents != demo_contents(seed=4)
    shared = [c for i, c in enumerate(contents) if i % 4 == 0]
    assert all(c.block_hashes[:64] == tuple(range(1, 65)) for c in shared)
    assert all(len(c.block_hashes) * 16 <= c.num_prompt_tokens for c in contents)
    workload = demo_workload(rate=3.0, duration_s=20.0, seed=3)
    assert 30 < len(workload) < 90 and workload.duration_s == 20.0


def test_spreading_ticks_moves_each_tick_s_requests_up_to_the_next_tick():
    def request(i: int, at: float) -> WorkloadRequest:
        return WorkloadRequest(f"r{i}", at, 100, 10)

    ticks = [0.0] * 5 + [3.0] * 4 + [6.0] * 3
    work = Workload(tuple(request(i, t) for i, t in enumerate(ticks)), duration_s=9.0)
    spread = spread_within_ticks(work, seed=0)
    assert len(spread) == len(work) and spread.duration_s == 9.0
    arrivals = [r.arrival_s for r in spread.requests]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    by_id = {r.request_id: r.arrival_s for r in spread.requests}
    for i, tick in enumerate(ticks):
        assert tick <= by_id[f"r{i}"] <= tick + 3.0  # the last tick spans the mean gap
    assert spread_within_ticks(work, seed=0) == spread
