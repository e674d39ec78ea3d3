"""`moekit list methods|formats`: what the registries hold."""
from __future__ import annotations

import argparse

from moekit.cli.common import out_console, summary


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list expert-init methods (with their parameters) or export formats",
                       description="List the registered expert-initialization methods, each with its parameters "
                                   "(defaults; set them with `moekit upcycle --set init.NAME=VALUE`) and its "
                                   "paper, or the native export formats.")
    p.add_argument("what", choices=["methods", "formats"])
    p.set_defaults(run=run)


def parameter(name: str, default: str | None, choices: list[str] | None) -> str:
    """`name=default`, `name (required)`, with a Literal's choices: `placement=down (down|gate|up)`."""
    text = f"{name} (required)" if default is None else f"{name}={default}"
    return text + (f" ({'|'.join(choices)})" if choices else "")


def rows(what: str) -> list[tuple[str, ...]]:
    """The table's rows, read from the registries' source (moekit.registry.declared*), without importing torch:
    (method, parameters, summary) or (format, summary)."""
    from moekit.registry import declared, declared_fields

    if what == "methods":
        fields = declared_fields("moekit.init", "EXPERT_INITS")
        return [(name, "\n".join(parameter(*f) for f in fields[name]) or "-", summary(doc))
                for name, doc in declared("moekit.init", "EXPERT_INITS").items()]
    return [(name, summary(doc)) for name, doc in declared("moekit.checkpoint.export", "EXPORTERS").items()]


def run(args: argparse.Namespace) -> None:
    from rich.table import Table

    head = ("method", "parameters (default)", "paper and summary") if args.what == "methods" else \
        ("format", "description")
    table = Table(*head, box=None, pad_edge=False)
    for row in rows(args.what):
        table.add_row(*row)
    out_console().print(table)
