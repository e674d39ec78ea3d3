"""`moekit select METHOD TRACE --target LANG --budget K --out selection.json`: choose experts from a
routing trace (RISE, ESFT, random, top-K) and write them as a Selection JSON file."""
from __future__ import annotations

import argparse
import types
import typing
from functools import partial
from pathlib import Path

from moekit.cli.common import LazyParser, out_console, summary
from moekit.registry import declared


def triple(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated numbers s,m,d, got {text!r}")
    return values


def add_parser(sub) -> None:
    p = sub.add_parser("select", help="select experts from a routing trace (RISE, ESFT, random, top-K; usage, REAP "
                                      "and EAN keep N per layer for pruning)",
                       description="Choose an expert subnetwork for a target language from a routing trace "
                                   "(`moekit routes collect`) and write it as JSON {layer: [expert ids]} "
                                   "with the scores that produced it. `moekit select METHOD --help` shows a "
                                   "method's settings.")
    methods = p.add_subparsers(dest="method", required=True, metavar="METHOD", parser_class=LazyParser)
    for name, doc in declared("moekit.selection", "SELECTORS").items():
        methods.add_parser(name, help=summary(doc), description=" ".join(doc.split()),
                           build=partial(add_method_arguments, method=name))


def add_method_arguments(p: argparse.ArgumentParser, method: str) -> None:
    """The arguments every method takes, then one flag per setting of the method's config class."""
    from moekit.selection import SELECTORS

    selector = SELECTORS.get(method)
    p.add_argument("trace", help="routing trace (.npz)")
    if selector.per_layer:
        p.add_argument("--target", help="count only this language's tokens (default: every token of the trace)")
        p.set_defaults(budget=None)
    else:
        p.add_argument("--target", required=True, help="target language, as labelled in the trace")
        p.add_argument("--budget", type=int, required=selector.needs_budget,
                       help="number of experts K" + ("" if selector.needs_budget else " instead of top_p"))
    p.add_argument("--out", required=True, help="output JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    for name, field in settings_of(method).items():
        shown = ",".join(map(str, field.default)) if isinstance(field.default, tuple) else field.default
        text = field.description or ""
        if "(default" not in text and not field.is_required():
            text += f" (default: {shown})"
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=text, required=field.is_required(),
                       **value_of(field.annotation))
    p.set_defaults(run=run)


def value_of(annotation) -> dict:
    """argparse keywords for a setting's type: a Literal's choices, three numbers for a triple, else the type."""
    if isinstance(annotation, types.UnionType):  # X | None: the setting's default is None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if typing.get_origin(annotation) is tuple:
        return {"type": triple, "metavar": "S,M,D"}
    return {"type": annotation}


def settings_of(method: str) -> dict:
    """{name: pydantic field} of a selection method's settings."""
    from moekit.selection import SELECTORS

    return {k: f for k, f in SELECTORS.get(method).model_fields.items() if k != "method"}


def run(args: argparse.Namespace) -> None:
    from moekit.selection.api import select

    given = {k: getattr(args, k) for k in settings_of(args.method) if getattr(args, k) is not None}
    selection = select(args.trace, args.method, args.target, args.budget, out=args.out, overwrite=args.overwrite,
                       **given)
    print_selection(selection, Path(args.out))


def print_selection(selection, out: Path) -> None:
    from rich.table import Table

    regions = selection.params.get("layer_regions")
    table = Table("layer", *(["region"] if regions else []), "n", "experts", box=None, pad_edge=False)
    for li, (layer, ids) in enumerate(selection.experts.items()):
        region = [regions[li]] if regions else []
        table.add_row(layer, *region, f"{len(ids)}/{selection.source.experts[layer]}", " ".join(map(str, ids)))
    console = out_console()
    console.print(table)
    extra = f" (top_p {selection.params['top_p']})" if selection.params.get("top_p") is not None else ""
    whom = f"for {selection.target}" if selection.target else "kept over every token"
    console.print(f"{selection.method}: {selection.count} experts {whom}{extra} -> {out}")
