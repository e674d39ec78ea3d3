"""`moekit list methods|formats`: what the registries hold."""
from __future__ import annotations

import argparse
import re

from rich.table import Table

from moekit.cli.common import out_console


def summary(obj) -> str:
    """The first sentence of the docstring's first paragraph (docstrings wrap mid-sentence)."""
    para = " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())
    return re.split(r"(?<=[\w)\]])\.\s+(?=[A-Z])", para, maxsplit=1)[0].removesuffix(".") + "."


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list expert-init methods or export formats",
                       description="List the registered expert-initialization methods or export formats.")
    p.add_argument("what", choices=["methods", "formats"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    if args.what == "methods":
        from moekit.init import EXPERT_INITS as registry
    else:
        from moekit.export import EXPORTERS as registry
    table = Table("name", "description", box=None, show_header=False, pad_edge=False)
    for name in registry.names():
        table.add_row(name, summary(registry.get(name)))
    out_console().print(table)
