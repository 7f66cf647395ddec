"""Progress output: a bar on a terminal, a few complete lines in a log file."""

from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import predictor.progress as progress_module
from predictor.cli import app
from predictor.moe import MoEPredictor
from predictor.neural import MLPPredictor
from predictor.progress import Progress
from predictor.synthetic import make_synthetic_records
from predictor.training import TrainConfig, train_loop
from tests.unit.torch_utils import one_torch_thread  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.unit

EPOCH_LINE = re.compile(r"^(?P<desc>.+): (?P<n>\d+)/(?P<total>\d+) epochs \(\d+%\)")


class TerminalStream(io.StringIO):
    """What tqdm sees as a terminal."""

    def isatty(self) -> bool:
        return True


def log_lines(text: str) -> list[str]:
    """The lines of `text`, which must be complete lines without carriage returns."""
    assert "\r" not in text
    assert text.endswith("\n")
    return text.splitlines()


def test_long_loop_logs_a_few_complete_lines():
    out = io.StringIO()
    items = list(Progress(range(10_000), desc="replay", unit="req", file=out))
    assert items == list(range(10_000))
    lines = log_lines(out.getvalue())
    assert 2 <= len(lines) <= 11
    counts = []
    for line in lines:
        match = re.match(r"replay: (\d+)/10000 req \(\d+%\)", line)
        assert match, line
        counts.append(int(match.group(1)))
    assert counts == sorted(set(counts)) and counts[-1] == 10_000
    assert lines[-1].startswith("replay: 10000/10000 req (100%)")


def test_manual_updates_log_each_step_of_the_total_once():
    out = io.StringIO()
    with Progress(total=1_000, desc="simulations", unit="req", file=out) as bar:
        for _ in range(100):
            bar.update(10)
    lines = log_lines(out.getvalue())
    expected = [f"simulations: {n}/1000 req ({n // 10}%)" for n in range(100, 1_001, 100)]
    assert [line.split(",")[0] for line in lines] == expected


def test_unknown_total_logs_by_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    out = io.StringIO()
    with Progress(desc="workloads", unit="workload", file=out) as bar:
        for _ in range(100):
            now[0] += 1.0
            bar.update()
    counts = [line.split(",")[0] for line in log_lines(out.getvalue())]
    assert counts == [f"workloads: {n} workload" for n in (30, 60, 90, 100)]


def test_postfix_is_in_the_line():
    out = io.StringIO()
    bar = Progress(range(2), desc="fit", unit="epochs", lines=2, file=out)
    for epoch in bar:
        bar.set_postfix(loss=f"{epoch / 2:.2f}")
    lines = log_lines(out.getvalue())
    assert [line.endswith(f"loss={e / 2:.2f}") for e, line in enumerate(lines)] == [True, True]


def test_terminal_gets_a_bar_updating_in_place():
    out = TerminalStream()
    assert sum(Progress(range(50), desc="layouts", file=out)) == sum(range(50))
    text = out.getvalue()
    assert "\r" in text and "layouts" in text
    assert re.search(r"100%\|[^|\r]+\| 50/50", text), text


def test_disabled_writes_nothing():
    out, tty = io.StringIO(), TerminalStream()
    assert list(Progress(range(5), desc="x", enabled=False, file=out)) == list(range(5))
    with Progress(total=5, desc="y", enabled=False, file=tty) as bar:
        bar.update(5)
    assert out.getvalue() == "" and tty.getvalue() == ""


def test_training_logs_one_line_per_epoch(capsys):
    weight = torch.nn.Parameter(torch.zeros(1))
    config = TrainConfig(epochs=4, batch_size=8, learning_rate=0.1, weight_decay=0.0,
                         loss="l1", show_progress=True)
    losses = train_loop([weight], 16, lambda rows: (weight - 1.0).abs().sum(), config,
                        torch.Generator().manual_seed(0), "toy")
    lines = log_lines(capsys.readouterr().err)
    assert [line.split(",")[0] for line in lines] == [
        f"toy: {n}/4 epochs ({25 * n}%)" for n in range(1, 5)]
    assert [line.rsplit("loss=", 1)[1] for line in lines] == [f"{x:.4f}" for x in losses]


def test_cli_train_logs_one_line_per_epoch_of_every_model(tmp_path):
    rows = [{"prompt_id": r.prompt_id, "task": r.task, "prompt": r.prompt,
             "output_tokens": r.output_tokens} for r in make_synthetic_records(40, seed=1)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(
        app, ["train", "--data", str(data), "--out", str(tmp_path / "m"), "--experts", "4"])
    assert result.exit_code == 0, result.output
    epochs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for line in log_lines(result.stderr):
        if match := EPOCH_LINE.match(line):
            epochs[match["desc"]].append((int(match["n"]), int(match["total"])))
    expected = {"moe gate": MoEPredictor().gate_epochs, "mlp": MLPPredictor().epochs}
    expected |= {d: MoEPredictor().expert_epochs for d in epochs if d.startswith("moe expert")}
    assert len(expected) > 2  # some expert trained
    assert {d: len(seen) for d, seen in epochs.items()} == expected
    for desc, seen in epochs.items():
        assert seen == [(n, expected[desc]) for n in range(1, expected[desc] + 1)]
