"""Goodput on a small heterogeneous cluster with bimodal output lengths, per seed.

    python -m benchmarks.bimodal_goodput [--seeds 0,1,2,3,4] [--slo-scales 1,2,3]
        [--policies goodserve,least-request,...] [--confidence-quantile 0.9]
        [--no-fast-while-cold]

configs/paper-4gpu.yaml, Poisson arrivals at --rate for --duration seconds, prompts of
100-2000 tokens, outputs either a chat (20-120 tokens) or a generation (400-900), half
and half; SLO = scale x solo time on the A800. GoodServe uses its label-free default
predictor (the running history of finished lengths). This is the workload of the
seeded simulation test, over several seeds: it shows how routing copes when a point
estimate of the length is far off for half the requests. Prints met requests per
policy and scale, one column per seed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Annotated

import typer

from app.engines.config import load_cluster_config
from app.experiments.knob_cli import knob_options
from app.experiments.replay import ReplaySpec, parse_policies, run_replay
from app.routing.goodserve import GoodServeConfig
from app.routing.registry import RoutingOptions
from app.workloads.slo import parse_scales
from app.workloads.workload import Content, Workload, poisson_workload

PAPER_CLUSTER = Path(__file__).resolve().parents[1] / "configs" / "paper-4gpu.yaml"
NUM_CONTENTS = 500  # distinct (prompt, output) lengths the arrivals draw from


def mixed_contents(n: int, seed: int) -> list[Content]:
    """Short chats and long generations: deadlines (scale x solo time) differ widely."""
    rng = random.Random(seed)
    return [
        Content(rng.randint(100, 2000), rng.choice([rng.randint(20, 120), rng.randint(400, 900)]))
        for _ in range(n)
    ]


def bimodal_workload(rate: float, duration_s: float, seed: int) -> Workload:
    return poisson_workload(rate, duration_s, mixed_contents(NUM_CONTENTS, seed), seed=seed)


def met_by_seed(
    seeds: list[int], policies: str, scales: str, rate: float, duration_s: float,
    goodserve: GoodServeConfig,
) -> dict[tuple[str, float], list[int]]:
    """(policy, SLO scale) -> met requests, one entry per seed."""
    met: dict[tuple[str, float], list[int]] = {}
    for seed in seeds:
        spec = ReplaySpec(load_cluster_config(PAPER_CLUSTER), parse_policies(policies),
                          parse_scales(scales), seed=seed,
                          routing=RoutingOptions(seed, goodserve))
        for cell in run_replay(spec, bimodal_workload(rate, duration_s, seed)):
            met.setdefault((cell.policy, cell.slo_scale), []).append(cell.summary["met"])
    return met


@knob_options
def main(
    seeds: Annotated[str, typer.Option(help="workload seeds, comma-separated")] = "0,1,2,3,4",
    slo_scales: Annotated[str, typer.Option(help="SLO scales")] = "1,2,3",
    policies: Annotated[str, typer.Option(help="policy names or `all`")] = (
        "goodserve,least-request,round-robin"),
    rate: Annotated[float, typer.Option(min=0.1, help="arrivals per second")] = 20.0,
    duration: Annotated[float, typer.Option(min=1.0, help="arrival window, s")] = 60.0,
    goodserve: GoodServeConfig = GoodServeConfig(),
) -> None:
    try:
        seed_list = [int(s) for s in seeds.split(",")]
        started = time.perf_counter()
        met = met_by_seed(seed_list, policies, slo_scales, rate, duration, goodserve)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"paper-4gpu, {rate:g} req/s for {duration:g} s, bimodal lengths, seeds {seeds}, "
          f"confidence_quantile {goodserve.confidence_quantile:g}, fast_while_cold "
          f"{goodserve.fast_while_cold} "
          f"({time.perf_counter() - started:.0f} s)")
    print("| policy | SLO scale | met per seed |\n|---|---|---|")
    for (policy, scale), counts in met.items():
        print(f"| {policy} | {scale:g} | {' / '.join(str(c) for c in counts)} |")


if __name__ == "__main__":
    typer.run(main)
