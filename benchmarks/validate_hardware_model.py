"""Validate the roofline iteration model against measured GPU profiles.

Two independent sets:
- Vidur (microsoft/vidur): per-layer non-attention operator times vs num_tokens and
  TP degree, Llama-2-7B on A100/A40/H100 and Llama-3-8B on A100.
- Splitwise (Mutinifni/splitwise-sim): whole-model prompt_time and token_time of
  Llama-2-70B on A100/H100 at TP 2-8.

Prints per-GPU median absolute relative error and the overall median per set.
Usage: python -m benchmarks.validate_hardware_model [--data ../shared/data/profiling]
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from app.hardware.specs import BatchShape, InstanceSpec, PrefillChunk, make_instance
from benchmarks.cli import run_command

DEFAULT_PROFILING_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "profiling"
VIDUR_LAYER_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
VIDUR_MODELS = {"Llama-2-7b-hf": "llama-2-7b", "Meta-Llama-3-8B": "llama-3-8b"}
SPLITWISE_MODELS = {"llama2-70b": "llama-2-70b"}
SPLITWISE_GPUS = {"a100-80gb": "A100", "h100-80gb": "H100"}


@dataclass(frozen=True)
class Comparison:
    """One measured point against the model's prediction."""

    dataset: str
    group: str  # e.g. "A100 llama-2-7b" or "H100 prompt_time"
    measured_ms: float
    predicted_ms: float

    @property
    def rel_err(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def vidur_comparisons(profiling_dir: Path) -> list[Comparison]:
    out = []
    for path in sorted((profiling_dir / "vidur").glob("*__mlp.csv")):
        gpu_key, _org, model_key, _ = path.name.split("__")
        model = VIDUR_MODELS[model_key]
        gpu = gpu_key.upper()
        for row in csv.DictReader(path.open()):
            tp = int(row["num_tensor_parallel_workers"])
            measured = sum(float(row[f"time_stats.{op}.median"]) for op in VIDUR_LAYER_OPS)
            instance = make_instance(gpu, model, tp)
            predicted = instance.layer_compute_s(int(row["num_tokens"])) * 1e3
            out.append(Comparison("vidur", f"{gpu} {model}", measured, predicted))
    return out


def _splitwise_prediction(instance: InstanceSpec, metric: str, key: tuple) -> float:
    prompt_size, batch_size, token_size = key
    if metric == "prompt_time":
        batch = BatchShape.build([PrefillChunk(prompt_size)] * batch_size)
    else:
        context = prompt_size + token_size // 2
        batch = BatchShape(num_decode_seqs=batch_size, decode_context_tokens=context * batch_size)
    return instance.iteration_time_s(batch) * 1e3


def splitwise_comparisons(profiling_dir: Path) -> list[Comparison]:
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for row in csv.DictReader((profiling_dir / "splitwise" / "perf_model.csv").open()):
        # power-capped H100 rows ("-pcap") are not a catalog GPU: skipped
        if row["model"] not in SPLITWISE_MODELS or row["hardware"] not in SPLITWISE_GPUS:
            continue
        key = (
            row["model"], row["hardware"], int(row["tensor_parallel"]),
            int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"]),
        )
        groups[key].append((float(row["prompt_time"]), float(row["token_time"])))
    out = []
    for (model, hardware, tp, *shape), samples in sorted(groups.items()):
        gpu = SPLITWISE_GPUS[hardware]
        instance = make_instance(gpu, SPLITWISE_MODELS[model], tp)
        for i, metric in enumerate(("prompt_time", "token_time")):
            measured = statistics.median(s[i] for s in samples)
            predicted = _splitwise_prediction(instance, metric, tuple(shape))
            out.append(Comparison("splitwise", f"{gpu} TP{tp} {metric}", measured, predicted))
    return out


def median_abs_rel_err(comparisons: list[Comparison]) -> float:
    return statistics.median(abs(c.rel_err) for c in comparisons)


def summarize(comparisons: list[Comparison]) -> dict[str, float]:
    """group -> median |relative error|, plus 'ALL' for the whole set."""
    by_group: dict[str, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        by_group[c.group].append(c)
    summary = {g: median_abs_rel_err(cs) for g, cs in sorted(by_group.items())}
    summary["ALL"] = median_abs_rel_err(comparisons)
    return summary


def validate(data: Annotated[Path, typer.Option()] = DEFAULT_PROFILING_DIR) -> int:
    """Print the model's error against each profile set under --data."""
    if not (data / "vidur").is_dir():
        print(f"error: no profiling data at {data}", file=sys.stderr)
        return 2
    for name, comps in (
        ("Vidur non-attention per-layer time", vidur_comparisons(data)),
        ("Splitwise llama2-70b medians", splitwise_comparisons(data)),
    ):
        print(f"\n{name}: {len(comps)} points")
        print(f"{'group':32s} {'median |rel err|':>18s}")
        for group, err in summarize(comps).items():
            print(f"{group:32s} {err * 100:17.1f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(validate, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
