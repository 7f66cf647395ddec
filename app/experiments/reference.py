"""Speed beside a reference: the same measurement in two checkouts, in one run.

A speed figure on a shared machine only means something as a ratio against a reference
measured on the same machine at the same time. `--reference REF` (of `goodserve overhead`
and `benchmarks/sim_speed.py`) names the reference: a directory holding another checkout,
used as it is, or a git ref of this repository, checked out in a temporary worktree that
is removed afterwards. Each measurement runs as its own process in each checkout (its
working directory and PYTHONPATH the checkout's root, so the checkout's own packages are
imported), the sides taking turns at going first so drift over the run falls on both
alike; the report gives each figure per run and side, current / reference, and per figure
the min / median / max over the runs of each side and of the ratio.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import typer

REPO = Path(__file__).resolve().parents[2]
SIDES = ("reference", "current")
Figures = Mapping[str, float]


@dataclass(frozen=True)
class Checkout:
    """A tree of the project that a measurement process imports its code from."""

    side: str  # "reference" or "current"
    root: Path
    version: str  # the ref as given and its commit, or `git describe` of a directory

    def as_dict(self) -> dict[str, str]:
        return {"root": str(self.root), "version": self.version}


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def describe(root: Path) -> str:
    """The commit a directory holds, marked -dirty when its files differ from it."""
    done = _git(root, "describe", "--always", "--dirty")
    return done.stdout.strip() if done.returncode == 0 else "not a git checkout"


def resolve_reference(ref: str, repo: Path = REPO) -> Path | str:
    """A directory (a checkout, used as is) or the commit a git ref of `repo` names."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "app" / "__init__.py").is_file():
            raise ValueError(f"--reference {ref}: no app package there, so not a checkout "
                             "of this project")
        return path.resolve()
    done = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if done.returncode != 0:
        raise ValueError(f"--reference {ref!r} is neither a directory nor a commit of {repo}")
    return done.stdout.strip()


@contextmanager
def reference_checkout(ref: str, repo: Path = REPO,
                       log: Callable[[str], None] | None = None) -> Iterator[Checkout]:
    """The reference `ref` names; a git ref is checked out, detached, in a temporary
    worktree of `repo` for the duration (the worktree's registration goes with it)."""
    found = resolve_reference(ref, repo)
    if isinstance(found, Path):
        yield Checkout("reference", found, f"{ref} ({describe(found)})")
        return
    parent = Path(tempfile.mkdtemp(prefix="goodserve-reference-"))
    root = parent / "checkout"
    added = _git(repo, "worktree", "add", "--detach", str(root), found)
    try:
        if added.returncode != 0:
            raise ValueError(f"cannot check out {ref!r}: {last_line(added.stderr)}")
        if log is not None:
            log(f"reference {ref} ({found[:12]}) checked out in {root}")
        yield Checkout("reference", root, f"{ref} ({found[:12]})")
    finally:
        if added.returncode == 0:
            _git(repo, "worktree", "remove", "--force", str(root))
        shutil.rmtree(parent, ignore_errors=True)


def current_checkout(root: Path = REPO) -> Checkout:
    return Checkout("current", root, describe(root))


def forwarded_options(ctx: typer.Context, skip: Collection[str] = (),
                      values: Mapping[str, Any] | None = None) -> list[str]:
    """The command line giving the running command every option value it has (`ctx`'s,
    updated by `values`) explicitly, but those named in `skip` and None: both checkouts
    then measure the same thing whatever their defaults. Paths are made absolute, since
    the processes run in another directory."""
    given = {**ctx.params, **(values or {})}
    argv: list[str] = []
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name in skip:
            continue
        value = given.get(param.name)
        if value is None:
            continue
        if param.is_flag:
            if value:
                argv.append(param.opts[0])
            elif param.secondary_opts:
                argv.append(param.secondary_opts[0])
            continue
        for one in value if param.multiple else (value,):
            argv += [param.opts[0], _text(one)]
    return argv


def _text(value: Any) -> str:
    if isinstance(value, Path):
        return str(value.resolve())
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def order(index: int) -> tuple[str, str]:
    """The sides in the order they run on the `index`-th run: the reference first on
    even runs, the current on odd ones."""
    return SIDES if index % 2 == 0 else SIDES[::-1]


def last_line(text: str) -> str:
    """The last line of a process's error output with text in it, less a box's frame."""
    lines = [line.strip(" │╭╮╰╯─") for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "(no error output)"


def failure(checkout: Checkout, stderr: str, code: int) -> str:
    """One line on a measurement process that failed: the option the checkout lacks, or
    its last line of error output."""
    if missing := re.search(r"No such option:\s*(-[-\w]+)", stderr):
        return f"the {checkout.side} checkout {checkout.version} has no option {missing.group(1)}"
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"the {checkout.side} run failed ({how}): {last_line(stderr)}"


def run_json(checkout: Checkout, command: Sequence[str]) -> Any:
    """Run `command` in `checkout`, its own packages first on the path, and parse the JSON
    of its last line of output."""
    env = {**os.environ, "PYTHONPATH": str(checkout.root)}
    done = subprocess.run(list(command), cwd=checkout.root, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ValueError(failure(checkout, done.stderr, done.returncode))
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ValueError(f"the {checkout.side} run printed no JSON line: "
                         f"{last_line(done.stdout + done.stderr)}") from None


@dataclass(frozen=True)
class PairedRun:
    """One measurement in both checkouts, one after the other."""

    key: Any  # what was measured: a seed, a part
    order: tuple[str, str]
    reference: Any  # each side's JSON
    current: Any


def run_pairs(reference: Checkout, current: Checkout, keys: Sequence[Any],
              command: Callable[[Any], Sequence[str]], name: Callable[[Any], str] = str,
              log: Callable[[str], None] | None = None,
              prime: Sequence[str] | None = None) -> list[PairedRun]:
    """`command(key)` in both checkouts per key, the sides taking turns at going first;
    `name(key)` labels the progress lines. `prime`, a small run of the same code, goes
    first in each checkout, unreported: it fills the compile caches (numba's, beside the
    sources, cold in a fresh worktree) so that no measured run pays for compiling, and
    an option a checkout lacks fails before the long runs."""
    checkouts = {"reference": reference, "current": current}
    if prime is not None:
        for side in SIDES:
            started = time.perf_counter()
            run_json(checkouts[side], prime)
            if log is not None:
                log(f"primed {side} (not reported): {time.perf_counter() - started:.1f} s")
    runs = []
    total = 2 * len(keys)
    for index, key in enumerate(keys):
        results: dict[str, Any] = {}
        for side in order(index):
            started = time.perf_counter()
            results[side] = run_json(checkouts[side], command(key))
            if log is not None:
                log(f"[{2 * index + len(results)}/{total}] {name(key)} {side}: "
                    f"{time.perf_counter() - started:.1f} s")
        runs.append(PairedRun(key, order(index), results["reference"], results["current"]))
    return runs


def ratios(reference: Figures, current: Figures) -> dict[str, float | None]:
    """current / reference per figure both have (None where the reference is 0)."""
    return {name: (current[name] / reference[name] if reference[name] else None)
            for name in current if name in reference}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(pairs: Sequence[tuple[Figures, Figures]]) -> dict[str, dict[str, dict]]:
    """Per figure that every run has on both sides: min / median / max over the runs of
    the reference, of the current, and of the ratio (each run's current / reference, so a
    seed's own workload divides out)."""
    names = [n for n in pairs[0][1] if all(n in ref and n in cur for ref, cur in pairs)]
    summary = {}
    for name in names:
        runs = {"reference": [ref[name] for ref, _ in pairs],
                "current": [cur[name] for _, cur in pairs]}
        ratio = [r for ref, cur in pairs if (r := ratios(ref, cur)[name]) is not None]
        summary[name] = {side: spread(values) for side, values in runs.items()}
        if ratio:
            summary[name]["ratio"] = spread(ratio)
    return summary


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
            for row in rows]


def run_table(reference: Figures, current: Figures) -> list[str]:
    """One run's figures on both sides and their ratio, a line per figure."""
    return aligned([("figure", "reference", "current", "cur/ref"),
                    *((name, _number(reference[name]), _number(current[name]), _ratio(ratio))
                      for name, ratio in ratios(reference, current).items())])


def summary_table(summary: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[str]:
    """Per figure, min / median / max of each side and of the ratio."""

    def cells(stats: Mapping[str, float] | None, text: Callable[[float], str]) -> str:
        if stats is None:
            return "-"
        return " / ".join(text(stats[k]) for k in ("min", "median", "max"))

    return aligned([("figure: min / median / max", "reference", "current", "cur/ref"),
                    *((name, cells(stats["reference"], _number),
                       cells(stats["current"], _number), cells(stats.get("ratio"), _ratio))
                      for name, stats in summary.items())])


def write_runs(out: Path, runs: Sequence[PairedRun], name: Callable[[Any], str],
               report: Mapping[str, Any]) -> list[Path]:
    """Each side's JSON of each run (reference-NAME.json, current-NAME.json) and the whole
    report (summary.json) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        for side in SIDES:
            path = out / f"{side}-{name(run.key)}.json"
            path.write_text(json.dumps(getattr(run, side), indent=2) + "\n")
            written.append(path)
    path = out / "summary.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return [*written, path]


def to_stderr(line: str) -> None:
    """A progress line for the log, apart from the report on stdout."""
    print(line, file=sys.stderr, flush=True)
