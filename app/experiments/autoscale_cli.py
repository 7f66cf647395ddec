"""`goodserve autoscale`: the autoscaling experiment's command. Apart from the
experiment itself, since it reaches the calibration and the live run, which both
build on `app.experiments.autoscale`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from tqdm import tqdm

from app.experiments.autoscale import (
    CALIBRATION_SEED_OFFSET,
    DEFAULT_CONFIG,
    STRATEGIES,
    build_workload,
    contents_of,
    load_autoscale_config,
    load_profile,
    run_experiment,
    write_outputs,
)
from app.experiments.autoscale_live import run_both, write_live_outputs
from app.experiments.calibrate import Calibrator, factors
from app.experiments.replay import Backend, cli_error
from app.routing.registry import RoutingOptions
from app.workload import LoadShape, load_prompts


def autoscale(
    trace: Path = typer.Option(..., help="Mooncake .jsonl or Azure .csv whose arrivals to shape"),
    prompts: Path | None = typer.Option(None, help="prompt_lengths.jsonl content (else the "
                                        "trace's own lengths)"),
    config: Path = typer.Option(DEFAULT_CONFIG, help="autoscaling experiment YAML"),
    shape: LoadShape = typer.Option(LoadShape.PHASES, help="phases | ramp"),
    backend: Backend = typer.Option(Backend.SIM, help="sim: every strategy in the simulator; "
                                    "live: the SARA controller actor on local Ray with "
                                    "simulated engines, and the same in the simulator"),
    strategies: str = typer.Option(",".join(STRATEGIES), help="comma-separated"),
    seed: int = typer.Option(0, help="content sampling and routing seed"),
    calibrate: bool = typer.Option(False, help="first measure the sizing model's capacity "
                                   "factors per pool and kind in the simulator (content drawn "
                                   "with another seed) and size with them"),
    out: Path | None = typer.Option(None, help="write summary.json, CSVs and the PNG here"),
    as_json: bool = typer.Option(False, "--json", help="print only the JSON object"),
) -> None:
    """Compare the SARA controller with static pools and today's autoscalers on a
    time-varying load (simulator); one JSON object keyed by strategy."""
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    if bad := [n for n in names if n not in STRATEGIES]:
        raise cli_error(f"unknown strategy {bad[0]!r}; known: {', '.join(STRATEGIES)}")
    if backend is Backend.LIVE and strategies != ",".join(STRATEGIES) and names != ["sara"]:
        raise cli_error("--backend live runs the sara strategy only")
    for path in (trace, config, prompts):
        if path is not None and not path.exists():
            raise cli_error(f"{path} does not exist")
    try:
        experiment = load_autoscale_config(config)
        profile = load_profile(experiment, shape)
        workload = build_workload(experiment, profile, trace, prompts, seed)
    except ValueError as error:
        raise cli_error(str(error)) from None
    measured: dict[str, float] = {}
    if calibrate:
        pool = ([row.content() for row in load_prompts(prompts)] if prompts
                else contents_of(workload))
        measured = factors(Calibrator(experiment, pool, seed + CALIBRATION_SEED_OFFSET).run())
        experiment = experiment.model_copy(update={"controller": experiment.controller.model_copy(
            update={"capacity_factors": measured})})
    setup = {"trace": trace.name, "prompts": prompts.name if prompts else None,
             "config": config.name, "shape": shape.value, "requests": len(workload),
             "duration_s": workload.duration_s, "mean_rps": round(profile.mean_rps, 2),
             "seed": seed, "routing": "goodserve (running-history lengths)",
             "backend": backend.value,
             "capacity_factors": measured or dict(experiment.controller.capacity_factors)}
    if backend is Backend.LIVE:
        live, sim = run_both(experiment, profile, workload, seed)
        summary = (write_live_outputs(out, live, sim, setup) if out is not None
                   else {"sara": live.summary(), "sara-sim": sim.summary()})
        typer.echo(json.dumps(summary, indent=None if as_json else 2))
        return
    routing = RoutingOptions(seed=seed)
    with tqdm(total=len(names), desc="strategies", disable=as_json) as bar:
        runs = run_experiment(experiment, profile, workload, names, routing,
                              progress=lambda _: bar.update())
    summary = (write_outputs(out, runs, setup) if out is not None
               else {run.name: run.summary() for run in runs})
    typer.echo(json.dumps(summary, indent=None if as_json else 2))

