"""Command-line options for GoodServe's knobs, generated from `GoodServeConfig`.

Each field of the config becomes one option of a typer command (`knob_options`):
`--headroom`, `--fast-while-cold / --no-fast-while-cold`, ..., with the field's
description and bounds as its help; values are checked by the config itself, so a bad
one fails with the config's message.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, get_args

import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from app.routing.goodserve import GoodServeConfig

# shorter spellings kept for the knobs the commands had before they were generated
ALIASES = {"tau_iterations": "--tau", "budget_refresh_iterations": "--budget-refresh"}

F = TypeVar("F", bound=Callable[..., Any])


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def bounds_text(info: FieldInfo) -> str:
    """The field's bounds as help text, e.g. ">= 0, <= 1"."""
    parts = []
    for meta in info.metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value:g}")
    return ", ".join(parts)


def help_text(info: FieldInfo) -> str:
    bounds = bounds_text(info)
    return f"{info.description} ({bounds})" if bounds else str(info.description)


def knob_config(values: dict[str, Any]) -> GoodServeConfig:
    """A config from option values; ValueError with one line naming the bad knob."""
    try:
        return GoodServeConfig(**values)
    except ValidationError as error:
        first = error.errors()[0]
        name = flag(str(first["loc"][0])) if first["loc"] else "routing"
        raise ValueError(f"{name}: {first['msg']}") from None


def is_flag(annotation: Any) -> bool:
    """A yes/no knob (`bool`, or `bool | None` where None leaves the choice to GoodServe)."""
    return annotation is bool or set(get_args(annotation)) == {bool, type(None)}


def _typer_parameter(name: str, info: FieldInfo) -> inspect.Parameter:
    decls = [flag(name)]
    if is_flag(info.annotation):
        decls = [f"{flag(name)}/--no-{name.replace('_', '-')}"]
    if name in ALIASES:
        decls.append(ALIASES[name])
    option = typer.Option(*decls, help=help_text(info), rich_help_panel="GoodServe knobs")
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info.default,
                             annotation=Annotated[info.annotation, option])


def knob_options(func: F) -> F:
    """Give a typer command one option per knob; it receives them as `goodserve`, a
    `GoodServeConfig` (a bad value exits 2 with one line, like the command's own)."""
    own = inspect.signature(func, eval_str=True)
    knobs = [_typer_parameter(n, i) for n, i in GoodServeConfig.model_fields.items()]
    params = [p for p in own.parameters.values() if p.name != "goodserve"] + knobs

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in GoodServeConfig.model_fields}
        try:
            config = knob_config(values)
        except ValueError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(2) from None
        return func(**kwargs, goodserve=config)

    wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper  # type: ignore[return-value]
