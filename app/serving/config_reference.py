"""`goodserve config reference`: the serve config's Markdown reference, generated.

Read from the pydantic models themselves (`model_fields`, Field descriptions and
ge/gt/le/lt constraints), so the reference cannot drift from the code: a knob added
to any section appears here without editing this module. `docs/configuration.md` is
this command's output; a unit test fails when the two differ.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

REGENERATE = "goodserve config reference > docs/configuration.md"

app = typer.Typer(help="The serve configuration's schema.", no_args_is_help=True)


@dataclass(frozen=True)
class FieldDoc:
    """One documented field: its YAML path and what the model says about it."""

    path: str  # YAML path, e.g. cluster.groups[].engine.tp
    type_name: str
    default: str
    bounds: str
    description: str


@dataclass(frozen=True)
class SectionDoc:
    """One pydantic model reached from the root: its YAML path, docstring and fields."""

    path: str  # "" for the root
    title: str
    doc: str
    fields: list[FieldDoc]


def _non_none(annotation: Any) -> list[Any]:
    """The members of an Optional/Union annotation other than None."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field opens as a YAML section, and the path suffix (`[]` for lists)."""
    members = _non_none(annotation)
    if len(members) != 1:
        return None
    inner = members[0]
    suffix = ""
    if get_origin(inner) is list and get_args(inner):
        inner, suffix = get_args(inner)[0], "[]"
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner, suffix
    return None


def type_name(annotation: Any) -> str:
    """A YAML-minded name of a field's type (enums and literals list their values)."""
    members = _non_none(annotation)
    name = " or ".join(_one_type_name(a) for a in members)
    optional = get_origin(annotation) in (Union, types.UnionType) and (
        type(None) in get_args(annotation))
    return f"{name} or null" if optional else name


def _one_type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in get_args(annotation))
    if origin is list:
        args = get_args(annotation)
        return f"list of {_one_type_name(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type):
        if issubclass(annotation, Enum):
            return " \\| ".join(f"`{m.value}`" for m in annotation)
        if issubclass(annotation, BaseModel):
            return "section"
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    return str(value)


def default_text(info: FieldInfo) -> str:
    """The default as YAML would spell it; `required` when there is none."""
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return _yaml_value(info.default_factory())  # type: ignore[call-arg]
    return _yaml_value(info.default)


_BOUND_SYMBOLS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def bounds_text(info: FieldInfo) -> str:
    """The Field's numeric constraints, e.g. `> 0, <= 1`."""
    parts = []
    for item in info.metadata:
        for kind, attr, symbol in _BOUND_SYMBOLS:
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attr)}")
        if isinstance(item, annotated_types.Interval):
            for _kind, attr, symbol in _BOUND_SYMBOLS:
                if getattr(item, attr) is not None:
                    parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def collect_sections(model: type[BaseModel], path: str = "") -> list[SectionDoc]:
    """The model and every model nested under it, depth first, in field order."""
    fields: list[FieldDoc] = []
    nested: list[SectionDoc] = []
    for name, info in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        sub = _nested_model(info.annotation)
        fields.append(FieldDoc(
            path=key + (sub[1] if sub else ""),
            type_name=type_name(info.annotation),
            default=default_text(info),
            bounds=bounds_text(info),
            description=_one_line(info.description),
        ))
        if sub is not None:
            nested.extend(collect_sections(sub[0], key + sub[1]))
    doc = _one_line(model.__dict__.get("__doc__"))
    title = f"`{path}`" if path else "Top level"
    return [SectionDoc(path, title, doc, fields), *nested]


def fields_without_description(model: type[BaseModel]) -> list[str]:
    """YAML paths of the fields whose Field carries no description."""
    return [f.path for s in collect_sections(model) for f in s.fields if not f.description]


_PLAIN_DEFAULTS = ("required", "its defaults")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(model: type[BaseModel], title: str, intro: str) -> str:
    """The whole reference: one table per section, rows in declaration order."""
    lines = [f"# {title}", "", intro, ""]
    for section in collect_sections(model):
        lines += [f"## {section.title}", ""]
        if section.doc:
            lines += [section.doc, ""]
        lines += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
        for f in section.fields:
            default = f.default if f.default in _PLAIN_DEFAULTS else f"`{f.default}`"
            cells = (f"`{f.path}`", f.type_name, default, f.bounds, _cell(f.description))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def serve_config_reference() -> str:
    """The serve config's reference, exactly as `docs/configuration.md` holds it."""
    from app.serving.config import ServeConfig

    intro = (
        "The YAML file `goodserve serve --config FILE` and `serve run app.main:build "
        "config=FILE` read (examples in `configs/`). Generated from the config models by "
        f"`{REGENERATE}`; do not edit by hand. A path such as `cluster.groups[].engine.tp` "
        "means the key `tp` under `engine` in each item of the `groups` list. Bounds are "
        "checked when the file is loaded; an error names the file and the field."
    )
    return render_markdown(ServeConfig, "Serve configuration reference", intro)


@app.callback()
def _group() -> None:
    """The serve configuration's schema."""


@app.command()
def reference() -> None:
    """Print the serve config's reference (Markdown) generated from the config models."""
    typer.echo(serve_config_reference(), nl=False)
