"""Figures like the SARA paper's, from the planning models (no simulation).

- fig4_feasible_region.png: C1-C4 bounds on N_bat against k_d (paper Fig. 4).
- fig6_scaling.png: token throughput vs N_bat, TTFT vs L_i, TPOT vs L_i and total
  decode time vs l_o (paper Fig. 6).
- fig7_slo_tax.png: minimum k_p, B and k_d vs p_SLO for light and heavy tails, with
  the stability-only floors; the gap is the SLO tax (paper Fig. 7).

GPT-3 175B is not in app.hardware.specs's catalog; its shape is declared here for the
paper's examples. Usage: python -m benchmarks.sara_plots --out DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import matplotlib
import typer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from app.planning.decode import DecodeStage  # noqa: E402
from app.planning.distributions import LengthDist  # noqa: E402
from app.planning.kv import KvStage  # noqa: E402
from app.planning.params import DeviceParams, ModelParams, SloTargets  # noqa: E402
from app.planning.prefill import PrefillStage  # noqa: E402
from app.planning.queues import Method  # noqa: E402
from benchmarks.cli import run_command  # noqa: E402

GPT3 = ModelParams("gpt-3-175b", 96, 12288, 49152, 1.0, 16, 350e9, ffn_matrices=2)
TAILS = {"light (exp)": None, "heavy CV 1.5": 1.5, "heavy CV 2": 2.0}
SLO = SloTargets(ttft_s=1.5, kv_s=0.2, tpot_s=0.02, p_slo=0.9)
RATE_RPS = 20.0
MEAN_INPUT, MEAN_OUTPUT = 1024.0, 256.0


def _input(cv: float | None, mean: float = MEAN_INPUT) -> LengthDist:
    return LengthDist.exponential(mean) if cv is None else LengthDist.lognormal(mean, cv)


def feasible_region(out: Path) -> Path:
    """C1/C2 cap N_bat from above, C3/C4 from below, for each k_d."""
    cases = [
        ("LLaMA 3.1 8B, A800, l_i=4096", ModelParams.named("llama-3.1-8b"), 4096.0, 1, 9),
        ("GPT-3 175B, A100, l_i=1024", GPT3, 1024.0, 5, 66),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (title, model, mean_input, k_lo, k_hi) in zip(axes, cases, strict=True):
        gpu = "A800" if model is not GPT3 else "A100"
        stage = DecodeStage(model, DeviceParams.named(gpu), _input(2.0, mean_input), MEAN_OUTPUT)
        devices = np.arange(k_lo, k_hi, max(1, (k_hi - k_lo) // 12))
        bounds = [stage.batch_bounds(int(k), RATE_RPS, SLO, Method.REFINED) for k in devices]
        c2 = [stage.max_batch_memory(int(k), SLO.p_mem, Method.REFINED) for k in devices]
        c4 = [stage.min_batch_admission(int(k), RATE_RPS, SLO.p_join) for k in devices]
        upper = np.minimum([b.c1_max for b in bounds], c2)
        lower = np.array([max(b.c3_min, n) for b, n in zip(bounds, c4, strict=True)], float)
        lower[lower > 1e8] = np.nan
        ax.plot(devices, [b.c1_max for b in bounds], "o-", label="C1 TPOT SLO (max)")
        ax.plot(devices, c2, "s-", label="C2 HBM capacity (max)")
        ax.plot(
            devices,
            [b.c3_min if b.c3_min < 1e8 else np.nan for b in bounds],
            "^-",
            label="C3 stability (min)",
        )
        ax.plot(
            devices, [n if n < 1e8 else np.nan for n in c4], "v-", label="C4 direct admission (min)"
        )
        ax.fill_between(devices, lower, upper, where=upper >= lower, alpha=0.2, label="feasible")
        ax.set(title=title, xlabel="decode devices k_d", ylabel="batch size N_bat", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Feasible (k_d, N_bat), CV 2 inputs, lambda={RATE_RPS:g}/s, "
        f"tau_dec={SLO.tpot_s}s, p={SLO.p_slo}"
    )
    return _save(fig, out / "fig4_feasible_region.png")


def scaling(out: Path) -> Path:
    models = {
        "LLaMA 3.1 8B": ModelParams.named("llama-3.1-8b"),
        "Qwen2.5 14B": ModelParams.named("qwen2.5-14b"),
        "GPT-3 175B": GPT3,
    }
    device = DeviceParams.named("A100")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    lengths = np.logspace(1, 5.3, 80)
    for name, model in models.items():
        decode = DecodeStage(model, device, _input(None), MEAN_OUTPUT)
        k_d = max(1, int(np.ceil(model.weight_bytes / device.hbm_capacity_bytes * 1.5)))
        batches = np.arange(1, 1025)
        line = axes[0].plot(
            batches, [decode.token_throughput(k_d, n) for n in batches], label=f"{name} (k_d={k_d})"
        )
        axes[0].axhline(decode.saturation_throughput(k_d), ls=":", color=line[0].get_color())
        prefill = PrefillStage(model, DeviceParams.instance_for("A100", model), _input(None))
        axes[1].plot(lengths, prefill.service_time_s(lengths), label=name)
        contexts = 32 * (lengths + MEAN_OUTPUT)
        axes[2].plot(lengths, decode.iteration_s(k_d, 32, contexts), label=name)
        outputs = np.logspace(1, 4.5, 60)
        axes[3].plot(
            outputs,
            [o * decode.iteration_s(k_d, 32, 32 * (MEAN_INPUT + o / 2)) for o in outputs],
            label=name,
        )
    axes[0].set(
        title="token throughput Gamma(N_bat), A100", xlabel="N_bat", ylabel="tokens/s", xscale="log"
    )
    axes[1].set(
        title="unloaded TTFT vs L_i", xlabel="L_i (tokens)", ylabel="s", xscale="log", yscale="log"
    )
    axes[2].set(
        title="TPOT vs L_i (N_bat = 32)",
        xlabel="L_i (tokens)",
        ylabel="s",
        xscale="log",
        yscale="log",
    )
    axes[3].set(
        title="total decode time vs l_o (N_bat = 32)",
        xlabel="l_o (tokens)",
        ylabel="s",
        xscale="log",
        yscale="log",
    )
    for ax in axes:
        ax.legend(fontsize=7)
    return _save(fig, out / "fig6_scaling.png")


def slo_tax(out: Path) -> Path:
    """GPT-3 175B on A100, lambda = 20/s, (tau_pre, tau_KV, tau_dec) = (1.5, 0.2, 0.02)."""
    probs = np.array([0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999])
    prefill_device = DeviceParams.instance_for("A100", GPT3)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for label, cv in TAILS.items():
        input_len = _input(cv)
        prefill = PrefillStage(GPT3, prefill_device, input_len)
        kv = KvStage(GPT3, input_len)
        decode = DecodeStage(GPT3, DeviceParams.named("A100"), input_len, MEAN_OUTPUT)
        for method, style in ((Method.REFINED, "-"), (Method.PAPER, "--")):
            k_p = [_or_nan(prefill.min_instances(RATE_RPS, SLO.ttft_s, p, method)) for p in probs]
            band = [kv.min_bandwidth(RATE_RPS, SLO.kv_s, p, method).bandwidth_gbps for p in probs]
            k_d = [decode.min_devices(RATE_RPS, _slo(p), method).num_devices for p in probs]
            tag = f"{label}, {method.value}"
            line = axes[0].plot(probs, k_p, style, marker="o", ms=3, label=tag)
            color = line[0].get_color()
            axes[1].plot(1 - probs, band, style, marker="o", ms=3, color=color, label=tag)
            axes[2].plot(probs, k_d, style, marker="o", ms=3, color=color, label=tag)
        axes[1].axhline(kv.stability_floor(RATE_RPS) / 1e9, ls=":", color=color)
    axes[0].axhline(prefill.stability_floor(RATE_RPS), ls=":", color="k", label="rho_p < 1")
    axes[2].axhline(decode.stability_floor(RATE_RPS), ls=":", color="k", label="C3 (Eq. 41)")
    axes[0].set(title="min prefill instances k_p (8xA100 each)", xlabel="p_SLO", ylabel="k_p")
    axes[1].set(
        title="min KV bandwidth B (dotted: stability floor)",
        xlabel="1 - p_SLO",
        ylabel="GB/s",
        xscale="log",
    )
    axes[1].invert_xaxis()
    axes[2].set(title="min decode devices k_d (A100)", xlabel="p_SLO", ylabel="k_d")
    for ax in axes:
        ax.legend(fontsize=6)
    fig.suptitle("SLO tax: GPT-3 175B, lambda = 20/s, tau = (1.5, 0.2, 0.02) s")
    return _save(fig, out / "fig7_slo_tax.png")


def _slo(p_slo: float) -> SloTargets:
    return SloTargets(SLO.ttft_s, SLO.kv_s, SLO.tpot_s, p_slo, SLO.p_mem, SLO.p_join)


def _or_nan(sizing) -> float:
    return float("nan") if sizing is None else sizing.num_instances


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(out: Annotated[Path, typer.Option(help="output directory")]) -> None:
    """Write the three figures under --out and print their paths."""
    out.mkdir(parents=True, exist_ok=True)
    for path in (feasible_region(out), scaling(out), slo_tax(out)):
        print(path)


def main(argv: list[str] | None = None) -> int:
    return run_command(plots, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
