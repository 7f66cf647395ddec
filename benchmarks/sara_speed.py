"""Time the SARA allocator: one goodput allocation and one controller pool sizing.

Every repetition perturbs the mean input length by a relative 1e-9, so the planner's
memoised spectra never hit: the figures are cold-start times. Fixed GPU types are the
< 50 ms target; "auto" (heterogeneous choice over the catalog) is reported alongside.
Usage: python -m benchmarks.sara_speed [--repeats 7] [--json]
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Annotated

import typer

from app.planning import (
    AllocationInputs,
    LengthDist,
    LengthMoments,
    Method,
    ModelParams,
    Observation,
    PoolPolicy,
    SloTargets,
    allocate,
    device_candidates,
    size_pools,
)
from benchmarks.cli import run_command

MODEL = "llama-3.1-8b"
SLO = SloTargets(ttft_s=1.5, kv_s=0.2, tpot_s=0.02, p_slo=0.9)
BUDGET_PER_HOUR = 30.0
TAILS = {"light": None, "heavy_cv1.5": 1.5, "heavy_cv2": 2.0}


def _input_len(cv: float | None, mean: float) -> LengthDist:
    return LengthDist.exponential(mean) if cv is None else LengthDist.lognormal(mean, cv)


def time_allocate(
    cv: float | None, method: Method, gpus: tuple[str, str] | None, repeats: int
) -> list[float]:
    """`gpus` = (prefill, decode) types; None lets the allocator pick from the catalog."""
    params = ModelParams.named(MODEL)
    prefill = device_candidates([gpus[0]] if gpus else None, params, "prefill")
    decode = device_candidates([gpus[1]] if gpus else None, params, "decode")
    times = []
    for i in range(repeats):
        workload = LengthMoments(_input_len(cv, 1024.0 * (1 + 1e-9 * i)), 256.0)
        inputs = AllocationInputs(
            params, workload, SLO, BUDGET_PER_HOUR, prefill, decode, method=method
        )
        start = time.perf_counter()
        allocate(inputs)
        times.append(time.perf_counter() - start)
    return times


def time_size_pools(cv: float | None, method: Method, repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        observation = Observation(20.0, 1024.0 * (1 + 1e-9 * i), cv or 1.0, 256.0)
        start = time.perf_counter()
        size_pools(
            observation,
            SLO,
            model=MODEL,
            prefill_gpu="H800",
            decode_gpu="A800",
            policy=PoolPolicy(method=method),
        )
        times.append(time.perf_counter() - start)
    return times


def run(repeats: int) -> list[dict]:
    rows = []
    for tail, cv in TAILS.items():
        for method in Method:
            cases = {
                "allocate H800/A800": time_allocate(cv, method, ("H800", "A800"), repeats),
                "allocate auto": time_allocate(cv, method, None, repeats),
                "size_pools H800/A800": time_size_pools(cv, method, repeats),
            }
            for case, times in cases.items():
                rows.append(
                    {
                        "case": case,
                        "tail": tail,
                        "method": method.value,
                        "min_ms": 1e3 * min(times),
                        "median_ms": 1e3 * statistics.median(times),
                    }
                )
    return rows


def speed(
    repeats: Annotated[int, typer.Option()] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON rows")] = False,
) -> None:
    """Print the allocator's cold-start times, as a table or as JSON rows."""
    rows = run(repeats)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(
            f"{row['case']:22s} {row['tail']:12s} {row['method']:8s} "
            f"min {row['min_ms']:7.1f} ms  median {row['median_ms']:7.1f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    return run_command(speed, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
