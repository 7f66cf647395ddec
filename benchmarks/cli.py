"""Running a benchmark script's typer command from `main(argv)`.

The scripts are run as `python -m benchmarks.NAME [flags]` and their tests call
`main([...])`, comparing the return code: the command's return value is the code, and a
bad argument is one `error: ...` line on stderr and 2, like the scripts' own checks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Sequence

import typer


def run_command(
    command: Callable[..., int | None], argv: Sequence[str] | None, description: str
) -> int:
    """Parse `argv` (default: the process's arguments) into `command` and run it."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help=description)(command)
    click_command = typer.main.get_command(app)
    lists = {opt for p in click_command.params if p.multiple for opt in p.opts}
    args = sys.argv[1:] if argv is None else argv
    try:
        code = click_command.main(args=spread(args, lists), standalone_mode=False)
    except typer.TyperException as error:  # typer's click errors; a bad argument: 2
        print(f"error: {error.format_message()}", file=sys.stderr)
        return error.exit_code
    return code or 0


def spread(args: Sequence[str], flags: Collection[str]) -> list[str]:
    """`--pool A B` as `--pool A --pool B`: the scripts' list options have always taken
    every value up to the next option, where click wants the flag before each value."""
    spread_args: list[str] = []
    flag = None
    for arg in args:
        if arg.startswith("-"):
            flag = arg if arg in flags else None
        elif flag is not None and spread_args[-1] != flag:
            spread_args.append(flag)
        spread_args.append(arg)
    return spread_args
