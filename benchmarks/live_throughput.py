"""The live path's throughput and the router's added latency, with simulated engines.

    python -m benchmarks.live_throughput [--replicas 1,2,4] [--seconds 10] [--out DIR]

On local Ray, with simulated engines and short requests (64 prompt ids, 8 output
tokens, no deadline):
- **added latency**: one H800 engine behind one router replica; Poisson arrivals at
  `--rate` (below saturation) sent through the router's HTTP API, and the same requests
  sent straight to the engine actor from the same process: p50 and p99 end-to-end
  latency of each, and the difference (one engine, so the policy's choice of GPU does
  not enter it);
- **throughput**: the default serve config (four engines: H800, A800, A40, 2xV100)
  behind 1, 2, 4 router replicas, `--concurrency` clients sending back to back for
  `--seconds`, each request with a `--slo` deadline: completed requests per second
  and their latency.
Each part's CPU use (router replicas, HTTP proxy, engine actors, Serve controller,
Ray's own processes, the client), in cores, is sampled to say where the limit is.
Everything shares this machine's cores: the client, the HTTP proxy, the router
replicas and the engine actors (which run their iterations in real time).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

APP_NAME = "goodserve-throughput"
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 8


@dataclass(frozen=True)
class LoadResult:
    completed: int
    failed: int
    seconds: float
    latency_s: np.ndarray

    def summary(self) -> dict[str, Any]:
        lat = self.latency_s * 1e3 if len(self.latency_s) else np.array([np.nan])
        return {"completed": self.completed, "failed": self.failed,
                "requests_per_s": round(self.completed / self.seconds, 1),
                "p50_ms": round(float(np.percentile(lat, 50)), 1),
                "p99_ms": round(float(np.percentile(lat, 99)), 1)}


async def open_loop(send: Callable[[int], Awaitable[bool]], rate: float, seconds: float,
                    seed: int = 0) -> LoadResult:
    """Poisson arrivals at `rate` for `seconds`; each `send(i)` is timed."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.5)))
    arrivals = arrivals[arrivals < seconds]
    start = time.monotonic()

    async def one(i: int, at: float) -> tuple[bool, float]:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        ok = await send(i)
        return ok, time.monotonic() - sent

    results = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return _result(results, time.monotonic() - start)


async def closed_loop(send: Callable[[int], Awaitable[bool]], concurrency: int,
                      seconds: float) -> LoadResult:
    """`concurrency` clients, each sending its next request when the last one ends."""
    start = time.monotonic()
    results: list[tuple[bool, float]] = []
    counter = iter(range(10**9))

    async def client() -> None:
        while time.monotonic() - start < seconds:
            sent = time.monotonic()
            ok = await send(next(counter))
            results.append((ok, time.monotonic() - sent))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return _result(results, time.monotonic() - start)


def _result(results: Sequence[tuple[bool, float]], seconds: float) -> LoadResult:
    latency = np.array([t for ok, t in results if ok])
    return LoadResult(len(latency), sum(not ok for ok, _ in results), seconds, latency)


def prompt(i: int) -> list[int]:
    return [2 + (i * 31 + k) % 1000 for k in range(PROMPT_TOKENS)]


def router_sender(client: httpx.AsyncClient, model: str,
                  slo_s: float | None = None) -> Callable[[int], Awaitable[bool]]:
    async def send(i: int) -> bool:
        body: dict[str, Any] = {"model": model, "prompt": prompt(i),
                                "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                                "temperature": 0.0}
        if slo_s is not None:
            body["slo_s"] = slo_s
        try:
            reply = await client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    return send


def engine_sender(actors: Sequence[Any]) -> Callable[[int], Awaitable[bool]]:
    """Straight to the engine actors, in turn, as the router's engine client calls them."""
    from app.engines.messages import EngineRequest, SamplingSpec
    from deployments.engine import generate_on

    sampling = SamplingSpec(max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    async def send(i: int) -> bool:
        request = EngineRequest(f"direct-{i}", prompt(i), sampling)
        try:
            async for _ in generate_on(actors[i % len(actors)], request):
                pass
        except Exception:  # noqa: BLE001 - counted as a failure
            return False
        return True

    return send


PARTS = (("router replicas", "ServeReplica"), ("HTTP proxy", "ProxyActor"),
         ("engine actors", "EngineActor"), ("Serve controller", "ServeController"),
         ("Ray (gcs, raylet)", "gcs_server"), ("Ray (gcs, raylet)", "raylet"))


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far, per part of the serving stack (by process title) and
    by this process (the client)."""
    import os

    import psutil

    used: dict[str, float] = {"client": 0.0}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        title = " ".join(proc.info["cmdline"] or [])
        times = proc.info["cpu_times"]
        if times is None:
            continue
        part = ("client" if proc.info["pid"] == os.getpid()
                else next((name for name, key in PARTS if key in title), None))
        if part is not None:
            used[part] = used.get(part, 0.0) + times.user + times.system
    return used


@contextmanager
def deployed(config: Any) -> Iterator[list[Any]]:
    """The router application for `config` on fresh engines; yields the engine actors."""
    import ray
    from ray import serve

    from deployments.controller import stop_controller
    from deployments.router import build_app

    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    try:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(f"{config.cluster.name}-"))
        yield [ray.get_actor(n, namespace="goodserve") for n in names]
    finally:
        serve.delete(APP_NAME)
        stop_controller(config.cluster.name)


def client_for(port: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120.0, limits=limits)


async def added_latency(config: Any, rate: float, seconds: float, port: int) -> dict[str, Any]:
    """One engine: the same Poisson requests through the router and straight to it."""
    with deployed(config) as actors:
        async with client_for(port) as client:
            via_router = router_sender(client, config.served_model_names[0])
            direct = engine_sender(actors)
            await open_loop(via_router, rate, 2.0)  # warm the connections and the replica
            routed = (await open_loop(via_router, rate, seconds, seed=1)).summary()
            straight = (await open_loop(direct, rate, seconds, seed=1)).summary()
    return {"engine": config.cluster.groups[0].engine.gpu_type, "rate": rate,
            "via_router": routed, "direct": straight,
            "added_p50_ms": round(routed["p50_ms"] - straight["p50_ms"], 1),
            "added_p99_ms": round(routed["p99_ms"] - straight["p99_ms"], 1)}


async def saturated(config: Any, seconds: float, concurrency: int, port: int,
                    slo_s: float) -> dict[str, Any]:
    """`concurrency` clients through the router, each request with a deadline (without
    one every GPU is just enough and the weakest takes them all); the cores used."""
    with deployed(config) as actors:
        async with client_for(port) as client:
            send = router_sender(client, config.served_model_names[0], slo_s)
            await open_loop(send, 10.0, 2.0)
            before = cpu_seconds()
            result = await closed_loop(send, concurrency, seconds)
            after = cpu_seconds()
    busy = {k: round((after[k] - before.get(k, 0.0)) / result.seconds, 2) for k in after}
    return {"replicas": config.num_router_replicas, "engines": len(actors),
            "concurrency": concurrency, "slo_s": slo_s} | result.summary() | {
                "cores_busy": busy}


def main(
    replicas: str = typer.Option("1,2,4", help="router replica counts to measure"),
    rate: float = typer.Option(20.0, help="open-loop rate for the latency comparison"),
    seconds: float = typer.Option(10.0, help="seconds per measurement"),
    concurrency: int = typer.Option(64, help="closed-loop clients"),
    slo: float = typer.Option(1.0, help="the throughput requests' deadline, seconds"),
    port: int = typer.Option(8011),
    out: Path | None = typer.Option(None, help="write live_throughput.json here"),
) -> None:
    """Router replica throughput and added latency on local Ray with simulated engines."""
    import ray
    from ray import serve

    from app.serving.config import default_serve_config
    from deployments.cluster import init_local_ray

    counts = [int(x) for x in replicas.split(",") if x.strip()]
    fleet = default_serve_config()
    one = fleet.model_copy(update={"cluster": fleet.cluster.model_copy(
        update={"groups": fleet.cluster.groups[:1]})})
    init_local_ray(fleet.cluster)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        latency = asyncio.run(added_latency(one, rate, seconds, port))
        typer.echo(json.dumps(latency), err=True)
        rows = []
        for n in counts:
            config = fleet.model_copy(update={"num_router_replicas": n})
            rows.append(asyncio.run(saturated(config, seconds, concurrency, port, slo)))
            typer.echo(json.dumps(rows[-1]), err=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"added_latency": latency, "throughput": rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "live_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    typer.run(main)
