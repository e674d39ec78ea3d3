"""`moekit select METHOD TRACE --target LANG --budget K --out selection.json`: choose experts from a
routing trace (RISE, ESFT, random, top-K) and write them as a Selection JSON file."""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from moekit.cli.common import out_console
from moekit.errors import ConfigError

SETTINGS = ("alpha", "ratios", "regions", "top_p", "score", "seed")  # flags that set a method's settings


def triple(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated numbers s,m,d, got {text!r}")
    return values


def add_parser(sub) -> None:
    from moekit.select import SELECTORS

    p = sub.add_parser("select", help="select experts from a routing trace (RISE, ESFT, random, top-K)",
                       description="Choose an expert subnetwork for a target language from a routing trace "
                                   "(`moekit routes collect`) and write it as JSON {layer: [expert ids]} "
                                   "with the scores that produced it.")
    p.add_argument("method", choices=SELECTORS.names())
    p.add_argument("trace", help="routing trace (.npz)")
    p.add_argument("--target", required=True, help="target language, as labelled in the trace")
    p.add_argument("--budget", type=int, help="number of experts K (optional for esft: default is its top_p)")
    p.add_argument("--out", required=True, help="output JSON file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--alpha", type=float, help="rise: activation-magnitude weight α of eq. 8 (default 10)")
    p.add_argument("--ratios", type=triple, help="rise: budget shares shallow,middle,deep (default 0.35,0.25,0.4)")
    p.add_argument("--regions", type=triple,
                   help="rise: layer shares shallow,middle,deep (default 0.375,0.25,0.375)")
    p.add_argument("--top-p", type=float, help="esft: cumulative relevance threshold (default 0.1 gate, 0.2 token)")
    p.add_argument("--score", choices=["gate", "token"], help="esft: relevance score (default token)")
    p.add_argument("--seed", type=int, help="random: seed (default 0)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit._fs import reserve
    from moekit.routing.trace import RoutingTrace
    from moekit.select import select

    out = Path(args.out)
    params = settings(args)
    with reserve(out, [args.trace], args.overwrite, what="selection"):
        trace = RoutingTrace.load(args.trace)
        selection = select(trace, args.method, args.target, args.budget, **params)
        selection.save(out, overwrite=args.overwrite)
    print_selection(selection, trace.num_experts, out)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def settings(args: argparse.Namespace) -> dict:
    """The method settings given on the command line; ConfigError for one the method does not take."""
    from moekit.select import SELECTORS

    given = {key: getattr(args, key) for key in SETTINGS if getattr(args, key) is not None}
    takes = set(SELECTORS.get(args.method).model_fields) - {"method"}
    wrong = sorted(given.keys() - takes)
    if wrong:
        raise ConfigError(f"{', '.join(map(flag, wrong))} does not apply to {args.method} "
                          f"(its settings: {', '.join(map(flag, sorted(takes))) or 'none'})")
    return given


def print_selection(selection, num_experts, out: Path) -> None:
    regions = selection.params.get("layer_regions")
    table = Table("layer", *(["region"] if regions else []), "n", "experts", box=None, pad_edge=False)
    for li, (layer, ids) in enumerate(selection.experts.items()):
        region = [regions[li]] if regions else []
        table.add_row(layer, *region, f"{len(ids)}/{int(num_experts[li])}", " ".join(map(str, ids)))
    console = out_console()
    console.print(table)
    extra = f" (top_p {selection.params['top_p']})" if selection.params.get("top_p") is not None else ""
    console.print(f"{selection.method}: {selection.count} experts for {selection.target}{extra} -> {out}")
