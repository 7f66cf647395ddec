"""A live router replica's arrival-to-placement time under vLLM's serving benchmark.

    python -m benchmarks.live_decision_latency [--rates 5,10,20,40,60,80] [--num-prompts 300]
        [--out results/live-decision-latency]

On local Ray: the default serve config (simulated H800, A800, A40 and 2xV100 engines,
one router replica, GoodServe's policy) with a length predictor behind the
micro-batcher (--predictor-dir, e.g. the trained MoE; else a history predictor saved
here), so each request is parsed, tokenized, predicted and placed by the replica.
`vllm bench serve` (`benchmarks.vllm_bench_serve`: `--backend openai` on
/v1/completions, the random dataset over a tiny BPE tokenizer built here, short
prompts and outputs so the engines are not the limit) sends Poisson arrivals at each
rate in turn. The replica's histograms `goodserve_routing_arrival_to_placement_seconds`
(arrival to placement), `goodserve_prediction_seconds` (the length prediction) and
`goodserve_routing_decision_seconds` (the policy alone) are read from Ray's Prometheus
endpoint before and after each rate; the difference gives the rate's p50 and p99,
interpolated within buckets as Prometheus' `histogram_quantile` does. A rate is kept
up with when every request completed and the achieved request throughput is at least
`KEEP_UP` of the offered rate. Writes `live_decision_latency.json` (setup and per-rate
figures) and a README.md table to `--out`.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from benchmarks.cli import run_command

ROOT = Path(__file__).resolve().parents[1]
PLACEMENT = "goodserve_routing_arrival_to_placement_seconds"
POLICY_ONLY = "goodserve_routing_decision_seconds"
PREDICTION = "goodserve_prediction_seconds"  # untagged: every placement predicts once
KEEP_UP = 0.9  # achieved / offered request rate that counts as keeping up
SERIES = re.compile(r"^ray_(\w+)_bucket\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def histogram_buckets(text: str, name: str, policy: str | None) -> dict[float, float]:
    """Cumulative bucket counts of histogram `name` (for `policy`, when it carries the
    tag) in a Prometheus text exposition, summed over the processes that report it (Ray
    tags each)."""
    buckets: dict[float, float] = {}
    for series, labels, value in SERIES.findall(text):
        tags = dict(LABEL.findall(labels))
        if series == name and tags.get("policy") == policy:
            le = float(tags["le"])
            buckets[le] = buckets.get(le, 0.0) + float(value)
    return buckets


def difference(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    """The observations made between two scrapes."""
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus' `histogram_quantile`: linear within the bucket holding rank q * total
    (from 0 for the first); the highest finite bound when it falls in +Inf; NaN empty."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def history_predictor(directory: Path) -> Path:
    """A saved history predictor (the running mean of finished lengths): the router
    predicts every request through the micro-batcher without a model to load."""
    from predictor.base import PredictionInput
    from predictor.registry import make_predictor, save_predictors

    history = make_predictor("history").fit([PredictionInput("x")] * 3, [8, 8, 8])
    save_predictors({"history": history}, directory)
    return directory


def bench(url: str, tokenizer: Path, rate: float, num_prompts: int, input_len: int,
          output_len: int, result_dir: Path) -> dict[str, Any]:
    """One `vllm bench serve` run at `rate` (its own process and core); its result."""
    name = f"rate-{rate:g}.json"
    command = [sys.executable, "-m", "benchmarks.vllm_bench_serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", "goodserve",
               "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--ignore-eos",
               "--request-rate", str(rate), "--seed", "0", "--disable-tqdm",
               "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads((result_dir / name).read_text())


def scrape(metrics_url: str) -> str:
    return httpx.get(metrics_url, timeout=30).text


def settled(metrics_url: str, policy: str, before: dict[float, float], at_least: float,
            timeout_s: float = 30.0) -> str:
    """The endpoint's text once it counts `at_least` new placements (Ray exports what
    the replica observed once per report interval)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(metrics_url)
        now = histogram_buckets(text, PLACEMENT, policy)
        new = now.get(math.inf, 0.0) - before.get(math.inf, 0.0)
        if new >= at_least or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def figures(rate: float, result: dict[str, Any], placement: dict[float, float],
            prediction: dict[float, float], policy: dict[float, float]) -> dict[str, Any]:
    """One rate's row: vLLM bench's throughput and TTFT, the replica's histograms."""
    achieved = result["request_throughput"]
    return {
        "offered_rps": rate, "achieved_rps": round(achieved, 2),
        "completed": result["completed"], "failed": result["failed"],
        "duration_s": round(result["duration"], 1),
        "output_tokens_per_s": round(result["output_throughput"], 1),
        "ttft_p50_ms": round(result["p50_ttft_ms"], 1),
        "ttft_p99_ms": round(result["p99_ttft_ms"], 1),
        "e2e_p50_ms": round(result["p50_e2el_ms"], 1),
        "placements": int(placement.get(math.inf, 0.0)),
        "arrival_to_placement_p50_ms": ms(bucket_quantile(placement, 0.5)),
        "arrival_to_placement_p99_ms": ms(bucket_quantile(placement, 0.99)),
        "prediction_p50_ms": ms(bucket_quantile(prediction, 0.5)),
        "prediction_p99_ms": ms(bucket_quantile(prediction, 0.99)),
        "policy_p50_ms": ms(bucket_quantile(policy, 0.5)),
        "policy_p99_ms": ms(bucket_quantile(policy, 0.99)),
        "kept_up": result["failed"] == 0 and achieved >= KEEP_UP * rate,
    }


def readme(result: dict[str, Any]) -> str:
    """The results as a short Markdown page."""
    setup = result["setup"]
    rows = [
        f"| {r['offered_rps']:g} | {r['achieved_rps']:.2f} | {r['completed']} / {r['failed']} "
        f"| {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} "
        f"| {r['arrival_to_placement_p50_ms']:.2f} / {r['arrival_to_placement_p99_ms']:.2f} "
        f"| {r['prediction_p50_ms']:.2f} / {r['prediction_p99_ms']:.2f} "
        f"| {r['policy_p50_ms']:.2f} / {r['policy_p99_ms']:.2f} "
        f"| {'yes' if r['kept_up'] else 'no'} |" for r in result["rates"]]
    best = result["highest_kept_up_rps"]
    return "\n".join([
        "# Arrival-to-placement time of a live router replica",
        "",
        f"`{setup['command']}`",
        "",
        f"{setup['engines']} simulated engines behind {setup['router_replicas']} router "
        f"replica ({setup['policy']} policy, {setup['predictor']} length predictor); "
        "`vllm bench serve` on /v1/completions, random dataset, "
        f"{setup['num_prompts']} prompts per rate of {setup['input_len']} tokens "
        f"(tiny BPE tokenizer) and {setup['output_len']} output tokens, Poisson arrivals; "
        f"{setup['cpus']} cores shared by the client, Ray and the engines.",
        "Arrival to placement: from the request reaching the replica (before its body is "
        "read) to its placement, parsing, tokenizing, the prediction and the policy "
        "included; the prediction column is the length prediction (micro-batch wait "
        "included), the policy column the policy alone. All are bucket quantiles of "
        "the replica's Prometheus histograms (Ray's endpoint), interpolated as "
        "`histogram_quantile` does.",
        "",
        "| offered req/s | achieved req/s | completed / failed | TTFT p50 / p99 ms "
        "| arrival to placement p50 / p99 ms | prediction p50 / p99 ms "
        "| policy p50 / p99 ms | kept up |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Highest rate kept up with (achieved >= {KEEP_UP:g} x offered, none failed): "
        + (f"{best:g} req/s." if best is not None else "none of those tried."),
        "",
    ])


def live_decision_latency(
    rates: Annotated[str, typer.Option(help="offered request rates, req/s, in order")] =
        "5,10,20,40,60,80",
    num_prompts: Annotated[int, typer.Option(help="requests per rate")] = 300,
    input_len: Annotated[int, typer.Option(help="prompt tokens (tiny tokenizer)")] = 32,
    output_len: Annotated[int, typer.Option(help="output tokens (ignore_eos)")] = 8,
    port: Annotated[int, typer.Option(help="the OpenAI API's port")] = 8013,
    metrics_port: Annotated[int, typer.Option(help="Ray's Prometheus endpoint")] = 18093,
    out: Annotated[Path | None, typer.Option(help="write the JSON and README.md here")] =
        None,
    predictor_dir: Annotated[Path | None, typer.Option(
        help="a trained predictor directory (`goodserve predictor train`); default: a "
        "history predictor saved here")] = None,
    predictor_name: Annotated[str, typer.Option(help="which of --predictor-dir's")] = "moe",
) -> int:
    """Arrival-to-placement p50 / p99 of a live router replica per offered rate."""
    import ray
    from ray import serve

    from app.engines.tiny_model import TINY_MODEL_NAME, build_tokenizer
    from app.hardware.specs import get_model
    from app.serving.config import default_serve_config
    from benchmarks.live_throughput import deployed
    from deployments.cluster import init_local_ray

    offered = [float(x) for x in rates.split(",") if x.strip()]
    fleet = default_serve_config()
    policy = fleet.routing.policy
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    rows = []
    with tempfile.TemporaryDirectory(prefix="goodserve-decision-latency-") as tmp:
        work = Path(tmp)
        tokenizer = work / "tokenizer"
        build_tokenizer(tokenizer, get_model(TINY_MODEL_NAME).vocab_size)
        if predictor_dir is None:
            predictor_dir, predictor_name = history_predictor(work / "predictors"), "history"
        config = fleet.model_copy(update={"routing": fleet.routing.model_copy(update={
            "predictor_dir": str(predictor_dir), "predictor_name": predictor_name})})
        init_local_ray(config.cluster, metrics_export_port=metrics_port,
                       metrics_report_interval_ms=1000)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            with deployed(config) as engines:
                num_engines = len(engines)
                bench(url, tokenizer, 5.0, 20, input_len, output_len, work)  # warm up
                for rate in offered:
                    text = scrape(metrics_url)
                    placement0 = histogram_buckets(text, PLACEMENT, policy)
                    prediction0 = histogram_buckets(text, PREDICTION, None)
                    policy0 = histogram_buckets(text, POLICY_ONLY, policy)
                    result = bench(url, tokenizer, rate, num_prompts, input_len, output_len,
                                   work)
                    text = settled(metrics_url, policy, placement0, result["completed"])
                    rows.append(figures(
                        rate, result,
                        difference(histogram_buckets(text, PLACEMENT, policy), placement0),
                        difference(histogram_buckets(text, PREDICTION, None), prediction0),
                        difference(histogram_buckets(text, POLICY_ONLY, policy), policy0)))
                    typer.echo(json.dumps(rows[-1]), err=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    kept = [r["offered_rps"] for r in rows if r["kept_up"]]
    result = {
        "setup": {
            "command": " ".join(["python -m benchmarks.live_decision_latency", *sys.argv[1:]]),
            "engines": num_engines, "router_replicas": config.num_router_replicas,
            "policy": policy, "predictor": f"{predictor_name} (micro-batched)",
            "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "arrivals": "Poisson", "cpus": os.cpu_count(), "keep_up": KEEP_UP,
        },
        "rates": rows,
        "highest_kept_up_rps": max(kept) if kept else None,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "live_decision_latency.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "README.md").write_text(readme(result))
    typer.echo(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(live_decision_latency, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
