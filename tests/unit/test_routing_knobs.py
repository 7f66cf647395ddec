"""GoodServe's knobs are defined once (`GoodServeConfig`): every knob set in a serve
YAML reaches the live router's policy and watchdog, and every knob given on the
replay and experiment command lines reaches the simulator's."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

import app.experiments.replay
from app.cli import cli
from app.experiments.knob_cli import flag, is_flag, knob_options
from app.routing.goodserve import GoodServeConfig, SloWatchdog
from app.routing.registry import RoutingStack
from app.serving.config import load_serve_config
from app.serving.service import CompletionService
from tests.unit.test_live_router import ScriptedEngine

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def other_value(name: str, info: FieldInfo) -> Any:
    """A valid value of the knob other than its default."""
    default = info.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, Enum):
        return next(m for m in type(default) if m != default)
    if default is None:  # the choice left to GoodServe: force one
        return True if is_flag(info.annotation) else 0.7
    upper = next((m.le for m in info.metadata if getattr(m, "le", None) is not None), None)
    step = 3 if isinstance(default, int) else 0.05
    if upper is not None and default + step > upper:
        return default - step
    return default + step


def non_default_knobs() -> dict[str, Any]:
    values = {n: other_value(n, i) for n, i in GoodServeConfig.model_fields.items()}
    GoodServeConfig(**values)  # every value is valid
    return values


def assert_stack_has(stack: RoutingStack, values: dict[str, Any]) -> None:
    """The policy and the watchdog run with exactly these knobs, down to the objects
    built from them."""
    expected = GoodServeConfig(**values)
    policy, watchdog = stack.policy, stack.watchdog
    assert isinstance(watchdog, SloWatchdog)
    assert policy.config == expected and watchdog.config == expected
    assert policy.placer.config == expected and watchdog.placer.config == expected
    assert policy.status.alpha == values["alpha"]
    assert policy.admissions.window == values["admissions_window"]
    assert policy.admissions.min_slo_samples == values["min_slo_samples"]
    assert policy.admissions._slo_spans.size == values["slo_window"]
    assert watchdog.tau_iterations == values["tau_iterations"]


def test_every_knob_has_a_meaning_and_a_non_default_test_value():
    for name, info in GoodServeConfig.model_fields.items():
        assert info.description, name
        assert other_value(name, info) != info.default, name


def test_every_knob_in_a_serve_yaml_reaches_the_live_router(tmp_path):
    values = non_default_knobs()
    config = yaml.safe_load((REPO / "configs" / "paper-4gpu.yaml").read_text())
    config["routing"] = {"policy": "goodserve",
                         **{k: v.value if isinstance(v, Enum) else v for k, v in values.items()}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    service = CompletionService(load_serve_config(path), [ScriptedEngine("e0", "H800")])
    assert_stack_has(RoutingStack(service.router.policy, service.router.watchdog), values)


def cli_args(values: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            args.append(flag(name) if value else f"--no-{name.replace('_', '-')}")
        else:
            args += [flag(name), str(value.value if isinstance(value, Enum) else value)]
    return args


def test_every_knob_on_the_replay_command_line_reaches_the_simulator(tmp_path, monkeypatch):
    built: list[RoutingStack] = []
    build = app.experiments.replay.build_routing
    monkeypatch.setattr(app.experiments.replay, "build_routing",
                        lambda kind, options, fleet=None: built.append(
                            build(kind, options, fleet)) or built[-1])
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({
        "timestamp": 400 * i, "input_length": 300, "output_length": 20, "hash_ids": [i]})
        for i in range(5)))
    values = non_default_knobs()
    result = CliRunner().invoke(cli, [
        "replay", "--trace", str(trace), "--cluster", str(REPO / "configs" / "paper-4gpu.yaml"),
        "--policies", "goodserve", "--slo-scales", "2", "--out", str(tmp_path / "out"),
        "--no-progress", *cli_args(values)])
    assert result.exit_code == 0, result.output
    assert len(built) == 1
    assert_stack_has(built[0], values)
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"- headroom: {values['headroom']}" in report


def test_every_knob_on_a_script_command_line_is_parsed():
    """What a benchmark script's command (e.g. goodput_experiments) receives."""
    parsed: list[GoodServeConfig] = []

    @knob_options
    def command(goodserve: GoodServeConfig = GoodServeConfig()) -> None:
        parsed.append(goodserve)

    app = typer.Typer()
    app.command()(command)
    values = non_default_knobs()
    for args in (cli_args(values), []):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    assert parsed == [GoodServeConfig(**values), GoodServeConfig()]


def test_a_bad_knob_value_is_one_line_naming_the_option(tmp_path):
    result = CliRunner().invoke(cli, [
        "replay", "--cluster", str(REPO / "configs" / "paper-4gpu.yaml"),
        "--out", str(tmp_path / "out"), "--headroom", "-1"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --headroom: Input should be greater than or equal to 0"]
