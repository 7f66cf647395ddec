"""What the ingress in front of the router replicas costs, per request and per streamed
event, with simulated engines.

    python -m benchmarks.ingress_cost [--rates 5,20,40] [--seconds 15] [--out DIR]

On local Ray, the default serve config (simulated H800, A800, A40 and 2xV100 engines)
behind two router replicas, once without an ingress (Serve's proxy reaches the
replicas) and once with one ingress replica in front of them (`ingress_replicas: 1`,
which retries a request on a live replica when the one serving it dies). At each rate,
Poisson arrivals of streamed completions (64 prompt ids, 16 output tokens, no
deadline) for `--seconds`: the client's time to the first token and to the last, p50
and p99, and the ingress replica's CPU time per request and per streamed event. The
cost of the hop is the difference in time to first token at p50 (the request's path
through one more replica) and the ingress' CPU per event (what it adds to each
token's path). Writes `ingress_cost.json` and a README.md table to `--out`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import typer

from benchmarks.live_throughput import client_for, deployed, prompt

OUTPUT_TOKENS = 16
INGRESS_TITLE = "IngressDeployment"


def ingress_cpu_s() -> float:
    """CPU seconds the ingress replicas' processes used so far (by process title)."""
    import psutil

    used = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None and INGRESS_TITLE in " ".join(proc.info["cmdline"] or []):
            used += times.user + times.system
    return used


async def streamed(client: httpx.AsyncClient, model: str, i: int
                   ) -> tuple[float, float, int] | None:
    """(seconds to the first token, to the end, events with a token); None: failed."""
    body = {"model": model, "prompt": prompt(i), "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    sent = time.monotonic()
    first, events = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return None
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    events += 1
                    first = first if first is not None else time.monotonic() - sent
    except httpx.HTTPError:
        return None
    return None if first is None else (first, time.monotonic() - sent, events)


async def load(client: httpx.AsyncClient, model: str, rate: float, seconds: float,
               seed: int) -> list[tuple[float, float, int] | None]:
    """Poisson arrivals at `rate` for `seconds`, each a streamed request."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.5)))
    arrivals = arrivals[arrivals < seconds]
    start = time.monotonic()

    async def one(i: int, at: float) -> tuple[float, float, int] | None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return await streamed(client, model, i)

    return await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))


def percentiles_ms(values: list[float]) -> dict[str, float]:
    ms = np.array(values) * 1e3 if values else np.array([np.nan])
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)}


async def measure(config: Any, rates: list[float], seconds: float, port: int
                  ) -> list[dict[str, Any]]:
    """Each rate's figures for one deployment of `config`."""
    rows = []
    with deployed(config):
        async with client_for(port) as client:
            model = config.served_model_names[0]
            await load(client, model, 5.0, 2.0, seed=99)  # warm connections and replicas
            for k, rate in enumerate(rates):
                cpu_before = ingress_cpu_s()
                results = await load(client, model, rate, seconds, seed=k)
                cpu_s = ingress_cpu_s() - cpu_before
                done = [r for r in results if r is not None]
                events = sum(r[2] for r in done)
                rows.append({
                    "rate": rate, "sent": len(results), "completed": len(done),
                    "first_token": percentiles_ms([r[0] for r in done]),
                    "last_token": percentiles_ms([r[1] for r in done]),
                    "events": events,
                    "ingress_cpu_ms_per_request": round(cpu_s / max(len(done), 1) * 1e3, 3),
                    "ingress_cpu_ms_per_event": round(cpu_s / max(events, 1) * 1e3, 4)})
                typer.echo(f"  {rate:g} req/s: {rows[-1]}")
    return rows


def readme(result: dict[str, Any]) -> str:
    lines = ["# The ingress hop's cost", "",
             "Made by `python -m benchmarks.ingress_cost`; setup in ingress_cost.json.", "",
             "| rate (req/s) | TTFT p50 without / with (ms) | added p50 (ms) | "
             "TTFT p99 without / with (ms) | ingress CPU per request (ms) | "
             "ingress CPU per event (ms) |", "|---|---|---|---|---|---|"]
    for row in result["rates"]:
        off, on = row["without"]["first_token"], row["with"]["first_token"]
        lines.append(f"| {row['rate']:g} | {off['p50_ms']} / {on['p50_ms']} | "
                     f"{row['added_first_token_p50_ms']} | {off['p99_ms']} / {on['p99_ms']} | "
                     f"{row['with']['ingress_cpu_ms_per_request']} | "
                     f"{row['with']['ingress_cpu_ms_per_event']} |")
    return "\n".join(lines) + "\n"


def main(
    rates: str = typer.Option("5,20,40", help="request rates, comma-separated"),
    seconds: float = typer.Option(15.0, min=1.0, help="seconds of arrivals per rate"),
    out: Path = typer.Option(Path("results/ingress-cost"), help="where the figures go"),  # noqa: B008
) -> None:
    """Serve the default config without and with an ingress; time both."""
    import ray

    from app.serving.config import default_serve_config
    from deployments.cluster import init_local_ray
    from deployments.router import free_port

    try:
        offered = [float(r) for r in rates.split(",")]
    except ValueError:
        typer.echo(f"error: --rates must be numbers separated by commas, got {rates!r}",
                   err=True)
        raise typer.Exit(code=2) from None
    base = default_serve_config().model_copy(update={"num_router_replicas": 2})
    init_local_ray(base.cluster)
    port = free_port()
    try:
        from ray import serve

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        figures = {}
        for name, replicas in (("without", 0), ("with", 1)):
            typer.echo(f"ingress {name}:")
            config = base.model_copy(update={"ingress_replicas": replicas})
            figures[name] = asyncio.run(measure(config, offered, seconds, port))
    finally:
        ray.shutdown()
    result = {"setup": {"config": "default (simulated H800, A800, A40, 2xV100)",
                        "router_replicas": 2, "output_tokens": OUTPUT_TOKENS,
                        "prompt_ids": 64, "seconds_per_rate": seconds, "streamed": True,
                        "machine": "this machine's cores shared by client, proxy, "
                                   "replicas and engines"},
              "rates": [{"rate": off["rate"], "without": off, "with": on,
                         "added_first_token_p50_ms": round(
                             on["first_token"]["p50_ms"] - off["first_token"]["p50_ms"], 2)}
                        for off, on in zip(figures["without"], figures["with"], strict=True)]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ingress_cost.json").write_text(json.dumps(result, indent=2))
    (out / "README.md").write_text(readme(result))
    typer.echo(readme(result))


if __name__ == "__main__":
    typer.run(main)
