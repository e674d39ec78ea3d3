"""`moekit list methods|formats`: what the registries hold."""
from __future__ import annotations

import argparse
import typing

from moekit.cli.common import out_console, summary


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list expert-init methods (with their parameters) or export formats",
                       description="List the registered expert-initialization methods, each with its parameters "
                                   "(defaults; set them with `moekit upcycle --set init.NAME=VALUE`) and its "
                                   "paper, or the native export formats.")
    p.add_argument("what", choices=["methods", "formats"])
    p.set_defaults(run=run)


def parameter(name: str, field) -> str:
    """`name=default`, `name (required)`, with a Literal's choices: `placement=down (down|gate|up)`."""
    text = f"{name} (required)" if field.is_required() else f"{name}={field.get_default(call_default_factory=True)}"
    if typing.get_origin(field.annotation) is typing.Literal:
        text += f" ({'|'.join(map(str, typing.get_args(field.annotation)))})"
    return text


def parameters(config_class) -> str:
    """One line per parameter of an init method's config class (its fields but `method`)."""
    fields = {k: f for k, f in config_class.model_fields.items() if k != "method"}
    return "\n".join(parameter(k, f) for k, f in fields.items()) or "-"


def run(args: argparse.Namespace) -> None:
    from rich.table import Table

    if args.what == "methods":
        from moekit.init import EXPERT_INITS

        table = Table("method", "parameters (default)", "paper and summary", box=None, pad_edge=False)
        for name in EXPERT_INITS.names():
            cls = EXPERT_INITS.get(name)
            table.add_row(name, parameters(cls), summary(cls.__doc__))
    else:
        from moekit.export import EXPORTERS

        table = Table("format", "description", box=None, pad_edge=False)
        for name in EXPORTERS.names():
            table.add_row(name, summary(EXPORTERS.get(name).__doc__))
    out_console().print(table)
