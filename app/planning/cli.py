"""`goodserve plan`: SARA pool sizing, goodput allocation and model validation.

    goodserve plan --model llama-3.1-8b --gpu-prefill H800 --gpu-decode A800 --rate 20 \\
        --slo-ttft 1.5 --slo-kv 0.2 --slo-tpot 0.02 --p-slo 0.9 [--budget C] \\
        [--light | --heavy CV] --json
    goodserve plan validate --json

GPU options take a catalog name, a comma-separated list or "auto" (the whole catalog):
with several candidates each pool gets the cheapest type (heterogeneous allocation).
Bad parameters print one line `error: ...` and exit with status 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import typer

from app.planning.allocator import (
    DEFAULT_KV_PRICE_PER_GBPS_HOUR,
    AllocationInputs,
    LengthMoments,
    allocate,
)
from app.planning.distributions import LengthDist
from app.planning.params import DeviceParams, ModelParams, SloTargets
from app.planning.pools import PoolPolicy, device_candidates, plan_for_rate
from app.planning.prefill import PrefillStage
from app.planning.queues import Method
from app.planning.validate import ValidationConfig, run_validation

app = typer.Typer(
    help="SARA: SLO-aware resource allocation for disaggregated serving.",
    pretty_exceptions_enable=False,
)

USAGE_ERROR = 2


def _fail(error: Exception) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(USAGE_ERROR)


def _gpu_list(option: str) -> list[str] | None:
    """ "auto" -> None (whole catalog); otherwise a comma-separated list of names."""
    if option.strip().lower() == "auto":
        return None
    names = [name.strip() for name in option.split(",") if name.strip()]
    if not names:
        raise ValueError(f"no GPU type given in {option!r}")
    return names


def _input_dist(mean: float, light: bool, heavy: float | None) -> LengthDist:
    if light and heavy is not None:
        raise ValueError("--light and --heavy are mutually exclusive")
    if heavy is None:
        return LengthDist.exponential(mean)
    return LengthDist.lognormal(mean, heavy)


def _derived(model: ModelParams, devices: tuple[DeviceParams, ...], input_len: LengthDist):
    """The model constants a reader may want to check against the paper."""
    prefill = PrefillStage(model, devices[0], input_len)
    return {
        "kv_ratio_g": model.kv_ratio,
        "gamma_bytes": model.gamma_bytes,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "weight_bytes": model.weight_bytes,
        "prefill_s_per_token": prefill.seconds_per_token,
        "quadratic_share_at_mean_input": model.quadratic_share(input_len.mean),
    }


@app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    model: str = typer.Option("llama-3.1-8b", help="catalog model name"),
    gpu_prefill: str = typer.Option("H800", help="GPU type(s) for prefill, or auto"),
    gpu_decode: str = typer.Option("A800", help="GPU type(s) for decode, or auto"),
    rate: float = typer.Option(20.0, help="arrival rate to size for, req/s"),
    slo_ttft: float = typer.Option(1.5, help="TTFT threshold tau_pre, s"),
    slo_kv: float = typer.Option(0.2, help="KV transfer threshold tau_KV, s"),
    slo_tpot: float = typer.Option(0.02, help="TPOT threshold tau_dec, s"),
    p_slo: float = typer.Option(0.9, help="probability each SLO must hold"),
    p_mem: float = typer.Option(0.99, help="C2: probability the KV cache fits"),
    p_join: float = typer.Option(0.95, help="C4: probability of direct batch admission"),
    budget: float | None = typer.Option(None, help="USD/h; also maximise goodput under it"),
    light: bool = typer.Option(False, "--light", help="exponential input lengths (default)"),
    heavy: float | None = typer.Option(None, help="log-normal input lengths with this CV"),
    input_mean: float = typer.Option(1024.0, help="mean input length, tokens"),
    output_mean: float = typer.Option(256.0, help="mean output length, tokens"),
    kv_price: float = typer.Option(DEFAULT_KV_PRICE_PER_GBPS_HOUR, help="USD per GB/s-hour"),
    method: Method = typer.Option(Method.REFINED, help="latency approximation"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Size the pools for --rate; with --budget also maximise goodput."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        params = ModelParams.named(model)
        workload = LengthMoments(_input_dist(input_mean, light, heavy), output_mean)
        slo = SloTargets(slo_ttft, slo_kv, slo_tpot, p_slo, p_mem, p_join)
        prefill = device_candidates(_gpu_list(gpu_prefill), params, "prefill")
        decode = device_candidates(_gpu_list(gpu_decode), params, "decode")
        policy = PoolPolicy(headroom=0.0, kv_price_per_gbps_hour=kv_price, method=method)
        result = {
            "model": model,
            "input_len": asdict(workload.input_len),
            "mean_output_len": output_mean,
            "slo": asdict(slo),
            "method": method.value,
            "derived": _derived(params, prefill, workload.input_len),
            "sizing": plan_for_rate(rate, workload, slo, params, prefill, decode, policy).to_dict(),
        }
        if budget is not None:
            inputs = AllocationInputs(
                params, workload, slo, budget, prefill, decode, kv_price, method
            )
            result["goodput"] = allocate(inputs).to_dict()
    except ValueError as error:
        _fail(error)
    typer.echo(json.dumps(result, indent=2) if json_out else _summary(result))


def _pool(count: int, gpus: int, gpu: str) -> str:
    return f"{count} x {gpu}" if gpus == 1 else f"{count} x {gpus}x{gpu}"


def _summary(result: dict) -> str:
    sizing = result["sizing"]
    if not sizing["meets_slo"] and sizing["clamped_by"] != "budget":
        lines = [f"rate {sizing['rate_rps']:g} req/s: unattainable ({sizing['reason']})"]
    else:
        lines = [
            f"rate {sizing['rate_rps']:g} req/s: "
            f"{_pool(sizing['num_prefill'], sizing['gpus_per_prefill'], sizing['prefill_gpu'])}"
            f" prefill, B = {sizing['kv_bandwidth_gbps']:.3g} GB/s, "
            f"{_pool(sizing['num_decode'], 1, sizing['decode_gpu'])} decode "
            f"(N_bat {sizing['max_batch_size']}), {sizing['cost_per_hour']:.2f} USD/h, "
            f"SLO tax {sizing['slo_tax_per_hour']:.2f} USD/h"
        ]
    goodput = result.get("goodput")
    if goodput is not None and not goodput["feasible"]:
        lines.append(f"goodput: infeasible ({goodput['reason']})")
    elif goodput is not None:
        lines.append(
            f"goodput {goodput['goodput_rps']:.4g} req/s within {goodput['budget_per_hour']:g}"
            f" USD/h (binding {goodput['binding_constraint']}): "
            f"{_pool(goodput['num_prefill'], goodput['gpus_per_prefill'], goodput['prefill_gpu'])}"
            f" prefill, B {goodput['kv_bandwidth_gbps']:.3g} GB/s, "
            f"{_pool(goodput['num_decode'], 1, goodput['decode_gpu'])} decode, "
            f"N_bat {goodput['max_batch_size']}, SLO tax {goodput['slo_tax_per_hour']:.2f} USD/h"
        )
    return "\n".join(lines)


@app.command()
def validate(
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
    seed: int = typer.Option(0, help="simulation seed"),
    num_requests: int = typer.Option(
        ValidationConfig.num_requests, help="requests per prefill/KV point (rho <= 0.75)"
    ),
    decode_iterations: int = typer.Option(
        ValidationConfig.decode_iterations, help="iterations per decode point"
    ),
) -> None:
    """Compare analytic and simulated latency quantiles for p_SLO in [0.5, 0.98]."""
    try:
        config = ValidationConfig(
            num_requests=num_requests, decode_iterations=decode_iterations, seed=seed
        )
        result = run_validation(config)
    except ValueError as error:
        _fail(error)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    for stage, cases in result["stages"].items():
        for case, summary in cases.items():
            typer.echo(
                f"{stage:8s} {case:12s} mean_rel_err {summary['mean_rel_err']:.4f} "
                f"max {summary['max_rel_err']:.4f}  paper {summary['paper_mean_rel_err']:.4f} "
                f"max {summary['paper_max_rel_err']:.4f}"
            )


if __name__ == "__main__":
    app()
