"""`goodserve autoscale`: the autoscaling experiment's command. Apart from the
experiment itself, since it reaches the calibration and the live run, which both
build on `app.experiments.autoscale`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from app.control.controller import CapacityModel
from app.experiments.autoscale import (
    CALIBRATION_SEED_OFFSET,
    DEFAULT_CONFIG,
    STRATEGIES,
    AutoscaleConfig,
    build_workload,
    contents_of,
    load_autoscale_config,
    load_profile,
    num_sessions,
    run_experiment,
    write_outputs,
)
from app.experiments.autoscale_live import run_both, write_live_outputs
from app.experiments.calibrate import Calibrator, Traffic, factors, sara_factors
from app.experiments.replay import Backend, cli_error
from app.routing.registry import RoutingOptions
from app.workloads.sessions import SessionPreset
from app.workloads.workload import ContentMode, LoadShape, Workload, load_prompts
from predictor.progress import Progress


def autoscale(
    trace: Path | None = typer.Option(None, help="Mooncake .jsonl or Azure .csv whose "
                                      "arrivals to shape (trace and prompts content)"),
    prompts: Path | None = typer.Option(None, help="prompt_lengths.jsonl content (else the "
                                        "trace's own lengths)"),
    content: ContentMode | None = typer.Option(
        None, help="trace | prompts (on the trace's arrivals) | coding-agent | chat-agent "
        "| research-agent (agent session presets) | sessions (a JSONL session log, "
        "--sessions): sessions start at the shaped arrivals, rates in sessions/s, steps "
        "closed-loop; default: prompts with --prompts, else trace"),
    sessions: Path | None = typer.Option(None, help="JSONL agent session log "
                                         "(--content sessions)"),
    config: Path = typer.Option(DEFAULT_CONFIG, help="autoscaling experiment YAML"),
    shape: LoadShape = typer.Option(LoadShape.PHASES, help="phases | ramp | diurnal | bursty"),
    duration: float | None = typer.Option(None, min=1.0, help="arrival window, s (default: "
                                          "the config's duration_s)"),
    backend: Backend = typer.Option(Backend.SIM, help="sim: every strategy in the simulator; "
                                    "live: the SARA controller actor on local Ray with "
                                    "simulated engines, and the same in the simulator"),
    strategies: str = typer.Option(",".join(STRATEGIES), help="comma-separated"),
    seed: int = typer.Option(0, help="content sampling and routing seed"),
    calibrate: bool = typer.Option(False, help="first measure the sizing model's capacity "
                                   "factors per pool and kind in the simulator (content drawn "
                                   "with another seed) and size with them"),
    capacity_model: CapacityModel | None = typer.Option(
        None, help="sara | served: what sizes the model-based strategies' pools (default: "
        "the config's); served drops the config's capacity factors, measured for sara"),
    out: Path | None = typer.Option(None, help="write summary.json, CSVs and the PNG here"),
    as_json: bool = typer.Option(False, "--json", help="print only the JSON object"),
) -> None:
    """Compare the SARA controller with static pools and today's autoscalers on a
    time-varying load (simulator); one JSON object keyed by strategy. The load's rates
    count requests, or session starts for agent session content."""
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    kind = content or (ContentMode.PROMPTS if prompts is not None else ContentMode.TRACE)
    _check_inputs(names, strategies, backend, kind, calibrate,
                  (trace, config, prompts, sessions), trace)
    is_session = kind.is_preset or kind is ContentMode.SESSIONS
    try:
        experiment = load_autoscale_config(config)
        profile = load_profile(experiment, shape, kind, duration)
        workload = build_workload(experiment, profile, trace, prompts, seed, kind, sessions)
    except ValueError as error:
        raise cli_error(str(error)) from None
    if capacity_model is not None:
        update = {"capacity_model": capacity_model}
        if capacity_model is CapacityModel.SERVED:
            update["capacity_factors"] = {}
        experiment = experiment.model_copy(update={
            "controller": experiment.controller.model_copy(update=update)})
    measured: dict[str, float] = {}
    if calibrate:
        measured = _measured_factors(experiment, kind, prompts, workload, seed)
        experiment = experiment.model_copy(update={"controller": experiment.controller.model_copy(
            update={"capacity_factors": measured})})
    setup = {"trace": trace.name if trace else None,
             "prompts": prompts.name if prompts else None, "content": kind.value,
             "sessions": num_sessions(workload) if workload.graph else None,
             "config": config.name, "shape": shape.value, "requests": len(workload),
             "duration_s": workload.duration_s, "mean_rps": round(profile.mean_rps, 2),
             "rate_unit": "sessions/s" if is_session else "requests/s",
             "seed": seed, "routing": "goodserve (running-history lengths)",
             "backend": backend.value,
             "capacity_model": experiment.controller.capacity_model.value,
             "capacity_factors": measured or dict(experiment.controller.capacity_factors)}
    if backend is Backend.LIVE:
        live, sim = run_both(experiment, profile, workload, seed)
        summary = (write_live_outputs(out, live, sim, setup) if out is not None
                   else {"sara": live.summary(), "sara-sim": sim.summary()})
        typer.echo(json.dumps(summary, indent=None if as_json else 2))
        return
    routing = RoutingOptions(seed=seed)
    with Progress(total=len(names), desc="strategies", enabled=not as_json) as bar:
        runs = run_experiment(experiment, profile, workload, names, routing,
                              progress=lambda _: bar.update())
    summary = (write_outputs(out, runs, setup) if out is not None
               else {run.name: run.summary() for run in runs})
    typer.echo(json.dumps(summary, indent=None if as_json else 2))



def _check_inputs(names: list[str], strategies: str, backend: Backend, kind: ContentMode,
                  calibrate: bool, paths: tuple[Path | None, ...], trace: Path | None) -> None:
    """One-line errors (exit 2) for option combinations the experiment does not run."""
    if bad := [n for n in names if n not in STRATEGIES]:
        raise cli_error(f"unknown strategy {bad[0]!r}; known: {', '.join(STRATEGIES)}")
    if backend is Backend.LIVE and strategies != ",".join(STRATEGIES) and names != ["sara"]:
        raise cli_error("--backend live runs the sara strategy only")
    is_session = kind.is_preset or kind is ContentMode.SESSIONS
    if kind is ContentMode.SESSIONS and calibrate:
        raise cli_error("--calibrate measures prompts or a session preset, not a session log")
    if not is_session and trace is None:
        raise cli_error(f"--content {kind.value} needs --trace")
    for path in paths:
        if path is not None and not path.exists():
            raise cli_error(f"{path} does not exist")


def _measured_factors(experiment: AutoscaleConfig, kind: ContentMode, prompts: Path | None,
                      workload: Workload, seed: int) -> dict[str, float]:
    """Capacity factors measured on the experiment's content, drawn with another seed,
    for the model the experiment sizes with."""
    if kind.is_preset:
        traffic = Traffic.sessions(SessionPreset(kind.value), experiment.model)
    else:
        traffic = Traffic(pool=[row.content() for row in load_prompts(prompts)] if prompts
                          else contents_of(workload))
    rows = Calibrator(experiment, traffic, seed + CALIBRATION_SEED_OFFSET).run()
    served = experiment.controller.capacity_model is CapacityModel.SERVED
    return factors(rows) if served else sara_factors(rows)
