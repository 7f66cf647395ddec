"""`goodserve` command line: one subcommand per job.

Subcommand groups live next to their code (predictor/cli.py, app/planning/cli.py,
benchmarks/...) and are mounted here.
"""

from __future__ import annotations

import typer

from app.planning.cli import app as plan_app
from benchmarks.replay import replay
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
cli.add_typer(plan_app, name="plan")
cli.add_typer(predictor_app, name="predictor")


@cli.command()
def demo(
    requests_per_engine: int = typer.Option(4, min=1, help="requests sent to each engine"),
    prompt_len: int = typer.Option(512, min=1, help="prompt tokens per request"),
    max_tokens: int = typer.Option(32, min=1, help="tokens generated per request"),
    vllm: bool = typer.Option(True, help="also start a real vLLM CPU engine (tiny model)"),
) -> None:
    """Local Ray cluster of sim engines on 4 GPU kinds (+ vLLM CPU); print timings."""
    import asyncio

    import ray

    from app.demo import DEFAULT_TINY_MODEL_DIR, default_demo_cluster, format_report, run_on_engines
    from deployments.cluster import init_local_ray, launch_cluster, shutdown_engines

    model_dir = None
    if vllm:
        from app.tiny_model import build_tiny_llama

        typer.echo(f"building tiny model in {DEFAULT_TINY_MODEL_DIR} ...")
        model_dir = build_tiny_llama(DEFAULT_TINY_MODEL_DIR)
    cluster = default_demo_cluster(model_dir)
    init_local_ray(cluster)
    try:
        typer.echo(f"starting {len(cluster.engines())} engines ...")
        handles = launch_cluster(cluster)
        try:
            timings = asyncio.run(run_on_engines(handles, requests_per_engine, prompt_len,
                                                 max_tokens))
            typer.echo(format_report(handles, timings, prompt_len, max_tokens))
        finally:
            shutdown_engines(handles)
    finally:
        ray.shutdown()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
