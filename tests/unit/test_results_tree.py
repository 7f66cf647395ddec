"""results/ holds only what the docs cite, within a size budget: every link and path
mention into it from README.md and docs/*.md resolves, and its files total at most 2 MiB.

A folder keeps the summaries the pages quote and the plots they show; the command that
made it writes the rest again (other plots, per-instance placement counts, records)."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MAX_RESULTS_BYTES = 2 * 1024 * 1024
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path named in prose or code: results/..., not part of a longer path such as ../results/
MENTION = re.compile(r"(?<![\w./-])results/[\w.*/-]*")
# an upper-case run stands for a value the reader fills in (rate-R, SHAPE-sara, fcfs-sS)
PLACEHOLDER = re.compile(r"[A-Z]+")


def doc_pages(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def results_files(repo: Path) -> list[str]:
    """Paths (relative to `repo`) of the files under results/ that git tracks or would
    add (ignored run outputs left out); every file there where `repo` is no checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
             "results"],
            cwd=repo, capture_output=True, check=True).stdout.decode()
        paths = [p for p in listed.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [str(p.relative_to(repo)) for p in (repo / "results").rglob("*")]
    return sorted(p for p in paths if (repo / p).is_file())


def tree_bytes(repo: Path, paths: list[str]) -> int:
    return sum((repo / p).stat().st_size for p in paths)


def broken_links(repo: Path, page: Path) -> list[str]:
    """Links from `page` into results/ whose target does not exist."""
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if "://" in path or not path:
            continue
        resolved = Path(os.path.normpath(page.parent / path))
        inside = resolved.is_relative_to(repo / "results")
        if inside and not resolved.exists():
            broken.append(f"{page.relative_to(repo)}: {target}")
    return broken


def unmatched_mentions(repo: Path, page: Path, paths: list[str]) -> list[str]:
    """results/ paths named on `page` that no file under results/ starts with (a
    placeholder such as R, SEED or SHAPE and a * match any text)."""
    unmatched = []
    for mention in MENTION.findall(page.read_text()):
        mention = mention.rstrip(".")
        pattern = PLACEHOLDER.sub("*", mention) + "*"
        if not any(fnmatch.fnmatchcase(p, pattern) for p in paths):
            unmatched.append(f"{page.relative_to(repo)}: {mention}")
    return unmatched


def test_results_stay_within_two_mib():
    paths = results_files(REPO)
    assert paths, "no files found under results/"
    size = tree_bytes(REPO, paths)
    biggest = sorted(paths, key=lambda p: (REPO / p).stat().st_size, reverse=True)[:5]
    assert size <= MAX_RESULTS_BYTES, (
        f"results/ holds {size:,} bytes, over {MAX_RESULTS_BYTES:,}; keep what the docs "
        f"quote and let the command that made a folder write the rest; biggest: {biggest}")


def test_every_link_into_results_exists():
    broken = [b for page in doc_pages(REPO) for b in broken_links(REPO, page)]
    assert not broken, f"links to missing results files: {broken}"


def test_every_results_path_the_docs_name_exists():
    paths = results_files(REPO)
    unmatched = [m for page in doc_pages(REPO) for m in unmatched_mentions(REPO, page, paths)]
    assert not unmatched, f"docs name results paths that hold nothing: {unmatched}"


def test_the_checks_catch_an_oversized_tree_and_a_dangling_link(tmp_path: Path):
    (tmp_path / "results" / "rate-100").mkdir(parents=True)
    table = tmp_path / "results" / "rate-100" / "summary.csv"
    table.write_bytes(b"x" * (MAX_RESULTS_BYTES + 1))
    page = tmp_path / "README.md"
    page.write_text("[table](results/rate-100/summary.csv), [plot](results/rate-100/plot.png)\n"
                    "`results/rate-R/`, `results/gone/`.\n")
    paths = results_files(tmp_path)  # not a checkout: every file under results/
    assert paths == ["results/rate-100/summary.csv"]
    assert tree_bytes(tmp_path, paths) > MAX_RESULTS_BYTES
    assert broken_links(tmp_path, page) == ["README.md: results/rate-100/plot.png"]
    assert unmatched_mentions(tmp_path, page, paths) == [
        "README.md: results/rate-100/plot.png", "README.md: results/gone/"]
