"""Metrics end to end: `goodserve serve --metrics-export-port` (elastic prefill/decode
pools of simulated engines, a trained length predictor, admission control) scraped by
a real Prometheus (Debian's, `make prometheus`); PromQL sees the key series move, and
every dashboard query returns data."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.dashboards import all_queries, render
from tests.conftest import sse_chunks
from tests.integration.test_app_lifetime import BIN, ROOT, environment, free_port, wait_for

pytestmark = pytest.mark.integration

CONFIG = ROOT / "configs" / "local-sim-pd-autoscale.yaml"
SCRAPE_S = 1


@dataclass(frozen=True)
class Observed:
    url: str  # the OpenAI API
    metrics_url: str  # Ray's Prometheus endpoint
    prometheus_url: str


def observed_config(directory: Path) -> Path:
    """The elastic P/D config with two decode engines (a forced move needs a second),
    a control step every second, a saved history predictor and admission control."""
    from predictor.base import PredictionInput
    from predictor.registry import make_predictor, save_predictors

    predictors = directory / "predictors"
    history = make_predictor("history").fit([PredictionInput("x")] * 3, [40, 50, 60])
    save_predictors({"history": history}, predictors)
    config = yaml.safe_load(CONFIG.read_text())
    config["cluster"]["name"] = "observed"
    config["cluster"]["groups"][1]["count"] = 2
    config["controller"] |= {"interval_s": 1, "startup_s": 1, "scale_down_after_s": 30,
                             "min_engines": {"prefill": 1, "decode": 2}}
    config["routing"] = {"predictor_dir": str(predictors), "predictor_name": "history",
                         "admission_control": True}
    path = directory / "observed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def prometheus_config(directory: Path, metrics_port: int) -> Path:
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "ray", "static_configs": [
            {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }))
    return path


def stop(process: subprocess.Popen, sig: int, timeout_s: float) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> Iterator[Observed]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no `prometheus` binary: install it with `make prometheus`")
    directory = tmp_path_factory.mktemp("observability")
    http_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    server = subprocess.Popen(
        [str(BIN / "goodserve"), "serve", "--config", str(observed_config(directory)),
         "--port", str(http_port), "--metrics-export-port", str(metrics_port),
         "--metrics-report-interval-ms", "500"],
        cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
        stderr=open(directory / "serve.log", "w"), start_new_session=True)
    prometheus = subprocess.Popen(
        [binary, f"--config.file={prometheus_config(directory, metrics_port)}",
         f"--storage.tsdb.path={directory / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}"],
        cwd=directory, stdout=subprocess.DEVNULL, stderr=open(directory / "prom.log", "w"),
        start_new_session=True)
    observed = Observed(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}",
                        f"http://127.0.0.1:{prometheus_port}")
    try:
        wait_for(lambda: _answers(observed.url + "/health"), 240,
                 f"goodserve serve did not start: {(directory / 'serve.log').read_text()[-2000:]}")
        wait_for(lambda: _answers(observed.prometheus_url + "/-/ready"), 60,
                 "Prometheus did not start")
        yield observed
    finally:
        stop(server, signal.SIGINT, 120)  # stops its controller, engines and Ray
        stop(prometheus, signal.SIGTERM, 30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def promql(prometheus_url: str, expr: str) -> list[dict]:
    response = httpx.get(prometheus_url + "/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(prometheus_url: str, expr: str) -> float:
    result = promql(prometheus_url, expr)
    return float(result[0]["value"][1]) if result else 0.0


def complete(url: str, max_tokens: int = 20, slo_s: float = 30.0) -> int:
    response = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "goodserve", "prompt": "tell me about metrics " * 10,
        "max_tokens": max_tokens, "slo_s": slo_s})
    return response.status_code


def send(url: str, count: int, **kwargs: float) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda _: complete(url, **kwargs), range(count)))


def forced_move(url: str) -> dict:
    """Stream a long request and move it once it is decoding; its summary."""
    summary, chunks = None, 0
    body = {"model": "goodserve", "prompt": "move me " * 20, "max_tokens": 150,
            "slo_s": 60.0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for chunk in sse_chunks(response):
            if "goodserve" in chunk:
                summary = chunk["goodserve"]
                continue
            chunks += 1
            if chunks == 4:
                move = httpx.post(url + "/admin/migrate", timeout=30,
                                  json={"request_id": chunk["id"].removeprefix("cmpl-")})
                assert move.status_code == 200, move.text
    assert summary is not None
    return summary


def traffic(url: str, count: int) -> list[int]:
    """`count` servable requests, two with an impossible deadline, one forced move:
    every kind of series the dashboards show moves (the tests run in any order)."""
    codes = send(url, count)
    assert codes.count(200) >= count * 3 // 4, codes  # admission control may turn some away
    assert send(url, 2, max_tokens=500, slo_s=0.001) == [503, 503]
    assert forced_move(url)["num_migrations"] == 1
    return codes


def test_served_traffic_moves_the_series_prometheus_scrapes(observed):
    url, prom = observed.url, observed.prometheus_url
    met = 'sum(ray_goodserve_requests_total{outcome="met"})'
    moves = 'sum(ray_goodserve_migrations_total{reason="operator"})'
    rejections = ('sum(ray_goodserve_requests_total{outcome="rejected",'
                  'reason="slo_unattainable"})')
    before = {expr: scalar(prom, expr) for expr in (met, moves, rejections)}
    codes = traffic(url, 16)

    def moved() -> bool:
        return (scalar(prom, met) >= before[met] + codes.count(200) - 2
                and scalar(prom, moves) >= before[moves] + 1
                and scalar(prom, rejections) >= before[rejections] + 2)

    wait_for(moved, 60, "Prometheus did not see goodput rise, the move and the rejections")
    # Ray's endpoint itself carries the series, next to Ray's own
    text = httpx.get(observed.metrics_url + "/metrics", timeout=30).text
    for series in ("ray_goodserve_requests_total",
                   "ray_goodserve_instance_decode_seconds_per_token",
                   "ray_goodserve_kv_transfer_seconds_bucket",
                   "ray_goodserve_routing_arrival_to_placement_seconds_bucket",
                   "ray_goodserve_pool_target_engines", "ray_serve_"):
        assert series in text, series
    # and the API port serves the same page, where vLLM clients look for it
    page = httpx.get(url + "/metrics", timeout=30)
    assert page.headers["content-type"].startswith("text/plain")
    assert "ray_goodserve_requests_total" in page.text
    # the controller's view: a target and held engines per pool, a binding constraint
    assert scalar(prom, 'sum(ray_goodserve_pool_engines{role="decode",state="active"})') >= 2
    assert scalar(prom, "sum(ray_goodserve_pool_binding_constraint)") == 1


def test_every_dashboard_query_returns_data(observed, tmp_path):
    url, prom = observed.url, observed.prometheus_url
    traffic(url, 8)  # fresh samples inside every rate window

    def empty() -> list[str]:
        return [f"{uid} / {title}: {expr}" for uid, title, expr in all_queries()
                if not promql(prom, expr)]

    missing: list[str] = []

    def all_answer() -> bool:
        missing[:] = empty()
        return not missing

    if not all_answer():
        time.sleep(5 * SCRAPE_S)
        assert all_answer(), "\n".join(missing)
    paths = render(prom, tmp_path, minutes=5)
    assert len(paths) == 4 and all(p.stat().st_size > 20_000 for p in paths)
