"""`goodserve` command line: one subcommand per job.

Subcommand groups live next to their code (predictor/cli.py, app/planning/cli.py,
app/experiments/) and are mounted here.
"""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from app.experiments.autoscale_cli import autoscale
from app.experiments.faults import faults
from app.experiments.overhead import overhead
from app.experiments.plan_check import plan_cluster_command
from app.experiments.replay import replay
from app.planning.cli import app as plan_app
from app.serving.config_reference import app as config_app
from predictor.cli import app as predictor_app

cli = typer.Typer(
    name="goodserve",
    help="SLO-aware LLM serving on heterogeneous GPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@cli.callback()
def _root() -> None:
    """SLO-aware LLM serving on heterogeneous GPUs."""


cli.command("replay")(replay)
cli.command("autoscale")(autoscale)
cli.command("overhead")(overhead)
cli.command("faults")(faults)
plan_app.command("cluster")(plan_cluster_command)
cli.add_typer(plan_app, name="plan")
cli.add_typer(predictor_app, name="predictor")
cli.add_typer(config_app, name="config")


@cli.command()
def demo(
    rate: float = typer.Option(3.0, min=0.1, help="arrivals per second"),
    duration: float = typer.Option(20.0, min=1.0, help="arrival window, seconds"),
    slo_scale: float = typer.Option(1.5, min=0.1, help="SLO = scale x solo time on an A800"),
    seed: int = typer.Option(0),
    metrics_export_port: int | None = typer.Option(
        None, help="serve Prometheus metrics on this port while the demo runs"),
) -> None:
    """Serve the default cluster live and replay a workload per policy; print the client's
    figures next to the simulator's for the same workload and policies."""
    import ray

    from app.experiments.demo import DEMO_POLICIES, demo_workload, format_comparison
    from app.experiments.replay import ReplaySpec, run_live_with_progress, run_replay
    from app.serving.config import default_serve_config
    from deployments.cluster import init_local_ray

    config = default_serve_config()
    if metrics_export_port is not None:  # the replay joins this Ray; stopped below
        init_local_ray(config.cluster, metrics_export_port=metrics_export_port,
                       metrics_report_interval_ms=1000)
    spec = ReplaySpec(config.cluster, DEMO_POLICIES, (slo_scale,), seed=seed)
    workload = demo_workload(rate, duration, seed)
    engines = ", ".join(e.instance.name for e in config.cluster.engines())
    typer.echo(f"{len(workload)} requests over {duration:g} s at {rate:g} req/s, SLO scale "
               f"{slo_scale:g}; engines: {engines} (simulated, real time); local Ray Serve")
    try:
        live = run_live_with_progress(spec, workload, show=True, predictor_dir=None)
    finally:
        ray.shutdown()
    sim = run_replay(spec, workload)
    typer.echo(format_comparison(live, sim))


class StopSignals:
    """SIGTERM (containers, process managers) and SIGINT as Ctrl-C, in place of the
    handler Ray installs (which exits at once); SIGINT too, which a shell starting us in
    the background leaves ignored. Until `release` (while Ray's processes start) a
    signal is held, so that they are stopped rather than orphaned; after, it raises
    KeyboardInterrupt."""

    def __init__(self) -> None:
        self.holding, self.pending = True, False
        self._install()

    def _install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.holding:
            self.pending = True
            return
        raise KeyboardInterrupt

    def release(self) -> None:
        """Signals stop the server from here on, one held meanwhile at once (the
        handlers again: starting Ray installs its own)."""
        self._install()
        self.holding = False
        if self.pending:
            raise KeyboardInterrupt

    @staticmethod
    def ignore() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


@cli.command()
def serve(
    config: str | None = typer.Option(None, help="serve config YAML (default: embedded)"),
    port: int | None = typer.Option(None, help="HTTP port (default: the config's)"),
    metrics_export_port: int | None = typer.Option(
        None, help="serve Prometheus metrics (Ray's and GoodServe's) on this port"),
    metrics_report_interval_ms: int | None = typer.Option(
        None, help="how often the metrics endpoint refreshes (Ray's default: 10000)"),
    tokenizer: Path | None = typer.Option(
        None, help="a local tokenizer directory: the router counts prompts with it and "
        "simulated engines generate its words (e.g. `goodserve tiny-model`'s)"),
) -> None:
    """Start a local Ray cluster and serve the OpenAI API until SIGINT or SIGTERM;
    requests in flight get the config's `shutdown_grace_s`, then the engines and the
    Ray instance are stopped."""
    import time

    signals = StopSignals()  # first: a signal during start-up must stop it too

    import ray
    from ray import serve as ray_serve

    from app.engines.config import EngineBackend
    from app.engines.sim import round_trip_vocabulary
    from app.serving.config import default_serve_config, load_serve_config, with_tokenizer
    from app.serving.service import api_keys, make_tokenizer, tool_parsing
    from deployments.cluster import init_local_ray
    from deployments.controller import drain_application, stop_controller
    from deployments.router import build_app

    try:
        serve_config = load_serve_config(config) if config else default_serve_config()
        if tokenizer is not None:
            if not tokenizer.is_dir():
                raise ValueError(f"tokenizer directory not found: {tokenizer}")
            serve_config = with_tokenizer(serve_config, str(tokenizer.resolve()))
        api_keys(serve_config)  # a keys file that cannot be read stops here, not in a replica
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    model_path = serve_config.engine_template.model_path
    if model_path is not None and not Path(model_path).is_dir():
        typer.echo(f"error: model directory not found: {model_path} (for the tiny test model "
                   "run `goodserve tiny-model`)", err=True)
        raise typer.Exit(code=2)
    try:  # a tokenizer or tool parser that cannot run stops here, not in a replica
        tool_parsing(serve_config, make_tokenizer(serve_config))
        for engine in serve_config.cluster.engines()[:1]:
            if engine.backend == EngineBackend.SIM and engine.tokenizer_path is not None:
                round_trip_vocabulary(engine.tokenizer_path)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    http_port = port or serve_config.http_port
    inventory = serve_config.controller.inventory if serve_config.controller else ()

    if signals.pending:
        typer.echo("stopped before start-up")
        return
    deploying = False
    try:
        init_local_ray(serve_config.cluster, inventory=inventory,
                       metrics_export_port=metrics_export_port,
                       metrics_report_interval_ms=metrics_report_interval_ms)
        signals.release()
        ray_serve.start(http_options={"host": "0.0.0.0", "port": http_port})
        deploying = True  # it may take requests before `run` returns
        ray_serve.run(build_app(serve_config), name="goodserve", route_prefix="/")
        typer.echo(f"serving {serve_config.served_model_names[0]!r} on "
                   f"http://127.0.0.1:{http_port}/v1 (Ctrl-C stops)")
        if metrics_export_port is not None:
            typer.echo(f"metrics on http://127.0.0.1:{metrics_export_port}/metrics")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signals.ignore()  # a second signal must not cut the stop short
        grace_s = serve_config.shutdown_grace_s
        typer.echo(f"stopping: new requests get a 503; those in flight get up to {grace_s:g} s"
                   if deploying else "stopping during start-up")
        if deploying:
            left = drain_application(serve_config.cluster.name, grace_s)
            if left:
                typer.echo(f"{left} requests still in flight after {grace_s:g} s are cut")
    finally:
        if ray.is_initialized():
            ray_serve.shutdown()
            stop_controller(serve_config.cluster.name)  # and every engine it started
        ray.shutdown()


dashboards_cli = typer.Typer(help="Grafana dashboards: generate, provision, render",
                             no_args_is_help=True)
cli.add_typer(dashboards_cli, name="dashboards")


@dashboards_cli.command("generate")
def dashboards_generate(
    out: Path | None = typer.Option(None, help="directory (default: deployments/grafana)"),
) -> None:
    """Write the dashboards' JSON (what Grafana imports)."""
    from deployments.dashboards import GRAFANA_DIR, write_dashboards

    for path in write_dashboards(out or GRAFANA_DIR):
        typer.echo(f"wrote {path}")


@dashboards_cli.command("push")
def dashboards_push(
    url: str = typer.Option(..., help="Grafana base URL, e.g. http://grafana:3000"),
    prometheus: str = typer.Option("http://127.0.0.1:9090",
                                   help="Prometheus URL the datasource points Grafana at"),
) -> None:
    """Provision folder, Prometheus datasource and dashboards (idempotent); the API
    token comes from GRAFANA_TOKEN."""
    import os

    from deployments.dashboards import push

    token = os.environ.get("GRAFANA_TOKEN")
    if not token:
        typer.echo("error: set GRAFANA_TOKEN to a Grafana service-account token", err=True)
        raise typer.Exit(code=2)
    try:
        done = push(url, token, prometheus)
    except Exception as exc:  # one line, never the token
        typer.echo(f"error: provisioning {url} failed: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(code=1) from None
    for name, what in done.items():
        typer.echo(f"{name}: {what}")


@dashboards_cli.command("render")
def dashboards_render(
    prometheus: str = typer.Option(..., help="Prometheus URL, e.g. http://127.0.0.1:9090"),
    out: Path = typer.Option(Path("dashboards"), help="directory for the PNGs"),
    minutes: float = typer.Option(15.0, help="how far back to draw"),
) -> None:
    """Draw every dashboard's panels from Prometheus to PNG (no Grafana needed)."""
    from deployments.dashboards import render

    try:
        paths = render(prometheus, out, minutes)
    except Exception as exc:
        typer.echo(f"error: rendering from {prometheus} failed: {type(exc).__name__}: {exc}",
                   err=True)
        raise typer.Exit(code=1) from None
    for path in paths:
        typer.echo(f"wrote {path}")


@cli.command("tiny-model")
def tiny_model(
    out: Path = typer.Option(Path.home() / ".cache" / "goodserve" / "tiny-llama",
                             help="directory to write the model and tokenizer to"),
) -> None:
    """Build the tiny random Llama + tokenizer locally (what the vLLM CPU configs serve)."""
    from app.engines.tiny_model import build_tiny_llama

    typer.echo(f"wrote {build_tiny_llama(out)}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
