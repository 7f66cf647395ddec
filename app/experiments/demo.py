"""The main job (`make run`): GoodServe serving live on the embedded default cluster.

Starts a local Ray cluster, deploys the Serve router over simulated H800, A800, A40
and 2xV100 engines (`app.main.default_serve_config`), replays a seeded Poisson
workload over HTTP once per policy, and prints what the client measured next to
what the offline simulator predicts for the same workload and the same policy
objects. Needs no data files and no GPU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from app.routing.registry import PolicyKind
from app.workloads.workload import Content, Workload, poisson_workload

DEMO_POLICIES = (PolicyKind.GOODSERVE, PolicyKind.LEAST_REQUEST)


def demo_contents(num: int = 64, seed: int = 0) -> list[Content]:
    """Chat-like requests: log-normal prompt (median ~600) and output (median ~120)
    lengths; every fourth shares a 1024-token system prompt (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = tuple(range(1, 65))  # 64 blocks of 16 tokens
    out = []
    for i in range(num):
        prompt = min(max(int(rng.lognormvariate(6.4, 0.7)), 16), 6000)
        output = min(max(int(rng.lognormvariate(4.8, 0.8)), 8), 800)
        if i % 4 == 0:
            prompt = max(prompt, 1100)
            hashes = shared + tuple(10_000 * (i + 1) + k for k in range((prompt - 1024) // 16))
        else:
            hashes = tuple(10_000 * (i + 1) + k for k in range(prompt // 16))
        out.append(Content(prompt, output, hashes, 16))
    return out


def demo_workload(rate: float, duration_s: float, seed: int = 0) -> Workload:
    return poisson_workload(rate, duration_s, demo_contents(seed=seed), seed=seed, name="demo")


def format_comparison(live: Sequence, sim: Sequence) -> str:
    """One row per (policy, scale): live figures, then the simulator's."""
    cols = ("met", "goodput_rps", "p50_e2e_s", "p99_e2e_s", "migrations")
    head = "policy          scale  " + "  ".join(f"{'live ' + c:>16s}" for c in cols) + "  " \
        + "  ".join(f"{'sim ' + c:>15s}" for c in cols)
    lines = [head]
    for a, b in zip(live, sim, strict=True):
        live_cells = "  ".join(f"{_fmt(a.summary[c]):>16s}" for c in cols)
        sim_cells = "  ".join(f"{_fmt(b.summary[c]):>15s}" for c in cols)
        lines.append(f"{a.policy:15s} {a.slo_scale:5.2f}  {live_cells}  {sim_cells}")
    return "\n".join(lines)


def _fmt(value: float | int) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
