"""Output-length predictor accuracy and latency on a held-out fifth of the prompts.

    python -m benchmarks.predictor_accuracy [--data PATH] [--seed N] [--experts 4,9,16]

Trains every predictor on 4/5 of the prompt ids, scores the other 1/5: MAE, MAE/mean,
MAE of the re-predictions made every 50 generated tokens, batch-64 latency per
request and training time; then the MoE for each K in --experts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from predictor.data import LengthRecord, load_records, split_by_prompt_id
from predictor.pipeline import (
    evaluate_predictor,
    predictor_kinds,
    predictor_params,
    reprediction_mae,
    shuffled_training_data,
)
from predictor.registry import PredictorKind, make_predictor

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/prompts/prompt_lengths.jsonl"


@dataclass(frozen=True)
class BenchRow:
    name: str
    mae: float
    nmae: float
    mae_reprediction: float  # re-predicted every 50 generated tokens (watchdog checks)
    latency_ms_per_request: float
    fit_s: float


def bench_one(
    name: str,
    kind: PredictorKind,
    params: dict,
    train: list[LengthRecord],
    test: list[LengthRecord],
    seed: int,
) -> BenchRow:
    inputs, lengths = shuffled_training_data(train, seed)
    start = time.perf_counter()
    predictor = make_predictor(kind, **params).fit(inputs, lengths)
    fit_s = time.perf_counter() - start
    result = evaluate_predictor(predictor, test)
    return BenchRow(
        name,
        result.mae,
        result.nmae,
        reprediction_mae(predictor, test),
        result.latency_ms_per_request,
        fit_s,
    )


def main(
    data: Annotated[Path, typer.Option(help="prompt/output-length JSONL")] = DEFAULT_DATA,
    seed: Annotated[int, typer.Option(help="split and training seed")] = 0,
    experts: Annotated[str, typer.Option(help="comma-separated K values for the MoE")] = "4,9,16",
    encoder: Annotated[
        Path | None, typer.Option(help="local encoder dir for llm_embedding")
    ] = None,
    threads: Annotated[
        int, typer.Option(help="torch CPU threads (1 is safest on a shared box)")
    ] = 1,
    json_out: Annotated[Path | None, typer.Option(help="also write the rows as JSON")] = None,
) -> None:
    """Train on 4/5 of the prompt ids, report accuracy and latency on the rest."""
    import torch

    torch.set_num_threads(threads)
    records = load_records(data)
    train, test = split_by_prompt_id(records, test_fraction=0.2, seed=seed)
    typer.echo(
        f"{len(train)} train / {len(test)} test rows, mean length "
        f"{np.mean([r.output_tokens for r in test]):.1f} tokens"
    )
    encoder_path = str(encoder) if encoder is not None else None
    rows = []
    for kind in predictor_kinds(train, with_encoder=encoder_path is not None):
        params = predictor_params(kind, seed=seed, encoder_path=encoder_path)
        rows.append(bench_one(kind.value, kind, params, train, test, seed))
        typer.echo(format_row(rows[-1]))
    for k in (int(v) for v in experts.split(",") if v.strip()):
        params = predictor_params(PredictorKind.MOE, num_experts=k, seed=seed)
        rows.append(bench_one(f"moe_k{k}", PredictorKind.MOE, params, train, test, seed))
        typer.echo(format_row(rows[-1]))
    if json_out is not None:
        json_out.write_text(json.dumps([asdict(r) for r in rows], indent=2))


def format_row(row: BenchRow) -> str:
    return (
        f"{row.name:<14} mae {row.mae:7.1f}  nmae {row.nmae:.3f}"
        f"  mae@recheck {row.mae_reprediction:7.1f}"
        f"  {row.latency_ms_per_request:.4f} ms/req  fit {row.fit_s:6.1f} s"
    )


if __name__ == "__main__":
    typer.run(main)
