"""`goodserve predictor train|eval`: fit the predictor set, then score it as JSON.

Bad input (missing file, malformed row, unknown option value) prints one line
`error: ...` and exits with code 2; heavy imports happen inside the commands.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

if TYPE_CHECKING:
    from predictor.base import Predictor

app = typer.Typer(
    help="Output-length predictor: train and evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

T = TypeVar("T")
USAGE_ERROR = 2

DataOption = Annotated[
    Path, typer.Option("--data", help="JSONL with 'prompt' and 'output_tokens' per line")
]
EncoderOption = Annotated[
    Path | None,
    typer.Option("--encoder", help="local encoder directory (transformers) for llm_embedding"),
]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", help="torch CPU threads (default: torch's choice)")
]


def _run_or_exit(action: Callable[[], T]) -> T:
    """Run `action`; turn input errors into one stderr line and exit code 2."""
    from predictor.data import DataError

    try:
        return action()
    except (DataError, FileNotFoundError, KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(USAGE_ERROR) from None


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


@app.command()
def train(
    data: DataOption,
    out: Annotated[Path, typer.Option("--out", help="directory to write the models to")],
    experts: Annotated[int, typer.Option("--experts", help="MoE experts K (a square)")] = 9,
    seed: Annotated[int, typer.Option("--seed", help="random seed")] = 0,
    encoder: EncoderOption = None,
    threads: ThreadsOption = None,
    progress: Annotated[bool, typer.Option(help="show training progress bars")] = True,
) -> None:
    """Train the MoE and the baselines on DATA and save them all to OUT."""
    from predictor.data import load_records
    from predictor.pipeline import train_predictors
    from predictor.registry import save_predictors

    _set_threads(threads)
    records = _run_or_exit(lambda: load_records(data))
    encoder_path = str(encoder) if encoder is not None else None
    predictors = _run_or_exit(
        lambda: train_predictors(records, experts, seed, encoder_path, show_progress=progress)
    )
    save_predictors(predictors, out)
    typer.echo(f"saved {', '.join(predictors)} to {out}", err=True)


@app.command("eval")
def evaluate(
    data: DataOption,
    model: Annotated[Path, typer.Option("--model", help="directory written by `train`")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    encoder: EncoderOption = None,
    threads: ThreadsOption = None,
) -> None:
    """MAE, MAE/mean and batch-64 latency per request of every saved predictor on DATA."""
    from predictor.data import load_records
    from predictor.pipeline import evaluate_predictors

    _set_threads(threads)
    records = _run_or_exit(lambda: load_records(data))
    has_tasks = any(r.task is not None for r in records)
    predictors = _run_or_exit(lambda: _load_for_eval(model, encoder, has_tasks))
    results = evaluate_predictors(predictors, records)
    if as_json:
        typer.echo(json.dumps({name: r.to_dict() for name, r in results.items()}, indent=2))
        return
    typer.echo(f"{'predictor':<14} {'mae':>9} {'nmae':>7} {'ms/request':>11}")
    for name, r in results.items():
        typer.echo(f"{name:<14} {r.mae:9.1f} {r.nmae:7.3f} {r.latency_ms_per_request:11.4f}")


def _load_for_eval(model: Path, encoder: Path | None, has_tasks: bool) -> dict[str, Predictor]:
    """Saved predictors to score: llm_embedding needs --encoder, history_task needs tasks."""
    from predictor.registry import load_predictor, saved_predictor_names

    names = saved_predictor_names(model)
    if encoder is not None and "llm_embedding" not in names:
        raise ValueError(f"{model} has no llm_embedding predictor; train it with --encoder")
    predictors = {}
    for name in names:
        if name == "llm_embedding":
            if encoder is not None:
                predictors[name] = load_predictor(model, name, encoder_path=str(encoder))
        elif name != "history_task" or has_tasks:
            predictors[name] = load_predictor(model, name)
    return predictors


if __name__ == "__main__":
    app(prog_name="predictor")
