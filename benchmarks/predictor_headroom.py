"""How far can a prompt-only length predictor go on the shared prompts?

    python -m benchmarks.predictor_headroom [--data PATH] [--seeds 0,1,2]

Reference points on the same held-out fifth (split by prompt id) as
`benchmarks/predictor_accuracy.py`, overall and per source:
- label statistics: global median, per-task median, per-(task, answering model)
  median (what knowing the served model would add), and the per-prompt median
  across the answering models (the floor for any predictor that sees only the
  prompt: it knows each test prompt's answers);
- two off-the-shelf learners on the MoE's own features: k nearest training prompts
  of the same task (median of their median lengths) and gradient-boosted trees on a
  128-d SVD of the TF-IDF plus the numeric and task columns (L1 on log length).
The MoE row trains `moe` with the project defaults. With `--encoder DIR` (a local
sentence encoder, e.g. all-MiniLM-L6-v2 installed from PyPI; nothing is fetched from
a hub) a last row fine-tunes it end to end with a small head (L1 on log length,
"[task] prompt" truncated to --encoder-max-tokens). The point is to show how much of
the gap between the per-task median and the floor text representations can close.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from benchmarks.predictor_accuracy import DEFAULT_DATA
from predictor.data import LengthRecord, load_records, split_by_prompt_id
from predictor.jsonl import iter_jsonl_objects
from predictor.pipeline import predictor_params, shuffled_training_data
from predictor.registry import PredictorKind, make_predictor

KNN_NEIGHBOURS = 20
SVD_DIM = 128
FINE_TUNE_BATCH = 16


@dataclass(frozen=True)
class Split:
    train: list[LengthRecord]
    test: list[LengthRecord]
    meta: dict[int, dict]  # line number -> raw row (source, model)

    def field(self, records: Sequence[LengthRecord], name: str) -> list[str]:
        return [str(self.meta[r.line_number].get(name)) for r in records]


def _medians_by(keys_train: Sequence, lengths: np.ndarray) -> dict:
    groups: dict = defaultdict(list)
    for key, length in zip(keys_train, lengths, strict=True):
        groups[key].append(length)
    return {key: float(np.median(values)) for key, values in groups.items()}


def label_references(split: Split) -> dict[str, np.ndarray]:
    """Predictions that are statistics of the labels."""
    y_train = np.array([r.output_tokens for r in split.train])
    overall = float(np.median(y_train))
    tasks_train, tasks_test = (
        [r.task for r in split.train], [r.task for r in split.test])
    models_train = split.field(split.train, "model")
    models_test = split.field(split.test, "model")
    by_task = _medians_by(tasks_train, y_train)
    by_task_model = _medians_by(list(zip(tasks_train, models_train, strict=True)), y_train)
    y_test = np.array([r.output_tokens for r in split.test])
    by_prompt = _medians_by([r.prompt_id for r in split.test], y_test)
    return {
        "global median": np.full(len(split.test), overall),
        "per-task median": np.array([by_task.get(t, overall) for t in tasks_test]),
        "per-(task, model) median": np.array([
            by_task_model.get((t, m), by_task.get(t, overall))
            for t, m in zip(tasks_test, models_test, strict=True)
        ]),
        "per-prompt median (floor)": np.array([by_prompt[r.prompt_id] for r in split.test]),
    }


def learner_references(split: Split, seed: int) -> dict[str, np.ndarray]:
    """kNN and gradient boosting on the MoE's TF-IDF features."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.ensemble import HistGradientBoostingRegressor
    from sklearn.preprocessing import normalize

    from predictor.features import TextFeaturizer

    train_inputs = [r.to_input() for r in split.train]
    test_inputs = [r.to_input() for r in split.test]
    y_train = np.array([r.output_tokens for r in split.train])
    featurizer = TextFeaturizer().fit(train_inputs)
    x_train, x_test = featurizer.transform(train_inputs), featurizer.transform(test_inputs)

    vocab = len(featurizer.vectorizer_.vocabulary_)
    first_row: dict[str, int] = {}
    for i, r in enumerate(split.train):
        first_row.setdefault(r.prompt_id, i)
    prompt_median = _medians_by([r.prompt_id for r in split.train], y_train)
    rows = list(first_row.values())
    neighbour_lengths = np.array([prompt_median[split.train[i].prompt_id] for i in rows])
    neighbour_tasks = np.array([str(split.train[i].task) for i in rows])
    similarity = (normalize(x_test[:, :vocab]) @ normalize(x_train[rows, :vocab]).T).toarray()
    test_tasks = np.array([str(r.task) for r in split.test])
    similarity[test_tasks[:, None] != neighbour_tasks[None, :]] = -np.inf
    nearest = np.argsort(-similarity, axis=1)[:, :KNN_NEIGHBOURS]
    knn = np.median(neighbour_lengths[nearest], axis=1)

    svd = TruncatedSVD(min(SVD_DIM, x_train.shape[1] - 1), random_state=seed).fit(x_train)

    def dense(x) -> np.ndarray:
        """SVD of all columns, plus the numeric counts and task one-hot as they are."""
        return np.hstack([svd.transform(x), x[:, vocab:].toarray()])

    trees = HistGradientBoostingRegressor(
        loss="absolute_error", max_iter=300, learning_rate=0.05, random_state=seed
    ).fit(dense(x_train), np.log(y_train))
    return {
        f"kNN (k={KNN_NEIGHBOURS}, same task)": knn,
        "gradient boosting": np.exp(trees.predict(dense(x_test))),
    }


def moe_reference(split: Split, seed: int) -> dict[str, np.ndarray]:
    inputs, lengths = shuffled_training_data(split.train, seed)
    moe = make_predictor(PredictorKind.MOE, **predictor_params(PredictorKind.MOE, seed=seed))
    moe.fit(inputs, lengths)
    return {"moe (project default)": moe.predict([r.to_input() for r in split.test])}


def finetuned_encoder_reference(
    split: Split, seed: int, encoder_path: Path, max_tokens: int, epochs: float
) -> dict[str, np.ndarray]:
    """Fine-tune a local encoder + MLP head on log length (L1: the median), end to end."""
    import torch

    from predictor.llm_embedding import load_local_encoder, mean_pooled

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    device = torch.device("cpu")
    encoder, tokenizer = load_local_encoder(str(encoder_path), device)
    width = encoder.config.hidden_size
    head = torch.nn.Sequential(torch.nn.Linear(width, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW([{"params": encoder.parameters(), "lr": 3e-5},
                                   {"params": head.parameters(), "lr": 1e-3}],
                                  weight_decay=0.01)

    def predict_log(records: Sequence[LengthRecord]) -> torch.Tensor:
        texts = [f"[{r.task}] {r.prompt}" for r in records]
        return head(mean_pooled(encoder, tokenizer, texts, max_tokens, device)).squeeze(-1)

    y_log = np.log([r.output_tokens for r in split.train])
    offset = float(y_log.mean())
    encoder.train()
    for _ in range(max(int(epochs * len(split.train) / FINE_TUNE_BATCH), 1)):
        rows = rng.choice(len(split.train), FINE_TUNE_BATCH)
        target = torch.tensor(y_log[rows] - offset, dtype=torch.float32)
        loss = torch.nn.functional.l1_loss(predict_log([split.train[i] for i in rows]), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    encoder.eval()
    with torch.no_grad():
        predicted = torch.cat([predict_log(split.test[i:i + 64])
                               for i in range(0, len(split.test), 64)])
    return {f"fine-tuned {encoder_path.name}": np.exp(predicted.numpy() + offset)}


def main(
    data: Annotated[Path, typer.Option(help="prompt/output-length JSONL")] = DEFAULT_DATA,
    seeds: Annotated[str, typer.Option(help="comma-separated split seeds")] = "0,1,2",
    encoder: Annotated[
        Path | None, typer.Option(help="local encoder directory to fine-tune (optional)")
    ] = None,
    encoder_max_tokens: Annotated[int, typer.Option(min=8)] = 128,
    encoder_epochs: Annotated[float, typer.Option(min=0.0)] = 2.0,
) -> None:
    """Print MAE per reference point, overall and per source, averaged over the seeds."""
    if not data.is_file():
        typer.echo(f"error: {data}: no such file (the shared prompts are needed)", err=True)
        raise typer.Exit(2)
    if encoder is not None and not encoder.is_dir():
        typer.echo(f"error: {encoder}: no such encoder directory", err=True)
        raise typer.Exit(2)
    import torch

    torch.set_num_threads(1)
    records = load_records(data)
    meta = {line_number: row for _, line_number, row in iter_jsonl_objects(data)}
    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    sources: list[str] = []
    for seed in (int(s) for s in seeds.split(",")):
        split = Split(*split_by_prompt_id(records, test_fraction=0.2, seed=seed), meta)
        y = np.array([r.output_tokens for r in split.test])
        source = np.array(split.field(split.test, "source"))
        sources = sorted(set(source))
        predictions = {
            **label_references(split), **learner_references(split, seed),
            **moe_reference(split, seed),
        }
        if encoder is not None:
            predictions |= finetuned_encoder_reference(
                split, seed, encoder, encoder_max_tokens, encoder_epochs)
        for name, predicted in predictions.items():
            error = np.abs(predicted - y)
            errors[name]["all"].append(float(error.mean()))
            for s in sources:
                errors[name][s].append(float(error[source == s].mean()))
    columns = ["all", *sources]
    typer.echo(f"MAE (tokens), mean over split seeds {seeds}")
    typer.echo("| reference | " + " | ".join(columns) + " |")
    typer.echo("|---" * (len(columns) + 1) + "|")
    for name, by_column in errors.items():
        cells = " | ".join(f"{np.mean(by_column[c]):.1f}" for c in columns)
        typer.echo(f"| {name} | {cells} |")


if __name__ == "__main__":
    typer.run(main)
