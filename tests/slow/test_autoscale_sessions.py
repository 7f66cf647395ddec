"""`goodserve autoscale --content coding-agent`: agent sessions on elastic pools, SARA
against static pools sized for the peak, on a short window with fast decisions."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from typer.testing import CliRunner

from app.cli import cli
from app.experiments.autoscale import DEFAULT_CONFIG

pytestmark = pytest.mark.slow

AGENTS_CONFIG = DEFAULT_CONFIG.parent / "autoscale-agents-sim.yaml"


def small_config(tmp_path):
    """The agents config with coding sessions at 0.05 -> 0.4 -> 0.05 sessions/s over
    90 s, decisions every 10 s and engines that start in 10 s."""
    config = yaml.safe_load(AGENTS_CONFIG.read_text())
    config["content_load"]["coding-agent"] = {"low_rps": 0.05, "peak_rps": 0.4,
                                              "duration_s": 90.0}
    config["controller"].update(interval_s=10, startup_s=10, cooldown_s=20,
                                scale_down_after_s=10, drain_deadline_s=10)
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def held_over_time(path, strategy: str) -> list[tuple[float, int]]:
    """(time, engines serving or starting) per control step, from timeline.csv."""
    held: dict[float, int] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["strategy"] == strategy:
                t = float(row["time_s"])
                held[t] = held.get(t, 0) + int(row["serving"]) + int(row["starting"])
    return sorted(held.items())


@pytest.mark.parametrize("seed", [0, 1])
def test_coding_sessions_are_served_whole_and_sara_grows_and_shrinks_the_pools(tmp_path, seed):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, [
        "autoscale", "--content", "coding-agent", "--config", str(small_config(tmp_path)),
        "--strategies", "static-peak,sara", "--seed", str(seed), "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    setup = json.loads((out / "summary.json").read_text())["setup"]
    assert setup["content"] == "coding-agent" and setup["rate_unit"] == "sessions/s"
    for figures in summary.values():  # every step of every session served: none lost
        assert figures["lost"] == 0 and figures["rejected"] == 0
        assert figures["steps_served"] == setup["requests"] > figures["sessions"]
        assert figures["sessions"] == setup["sessions"] and figures["sessions_broken"] == 0
    sara = summary["sara"]
    assert sara["engines_started"] > 0 == summary["static-peak"]["engines_started"]
    held = held_over_time(out / "timeline.csv", "sara")
    start = held[0][0] - 10.0  # the first decision comes one interval after the start
    before_peak = min(n for t, n in held if t < start + 50.0)
    peak = max(n for t, n in held if start + 30.0 <= t < start + 90.0)
    assert peak > before_peak  # grew for the peak (its engines start 10 s after)
    assert held[-1][1] < peak  # and shrank once the sessions ended
