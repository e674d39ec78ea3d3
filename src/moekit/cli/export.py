"""`moekit export DIR --format NAME --out DIR2`: moekit checkpoint -> native HF MoE checkpoint."""
from __future__ import annotations

import argparse

from moekit.cli.common import out_console
from moekit.cli.progress import progress
from moekit.cli.upcycle import DTYPES, FORMATS, LAYOUT_HELP, LAYOUTS, size_arg


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a moekit checkpoint in a native HF MoE format",
                       description="Export a moekit checkpoint as a native transformers MoE model "
                                   "(see `moekit list formats`).")
    p.add_argument("dir", help="moekit checkpoint directory")
    p.add_argument("--format", required=True, choices=[f for f in FORMATS if f not in ("auto", "moekit")],
                   help="native transformers format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layout", default="classic", choices=LAYOUTS, help=LAYOUT_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="output dtype (auto: the checkpoint's own)")
    p.add_argument("--max-shard-size", default="5GB", type=size_arg, help="largest output shard")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit.checkpoint.convert import export

    with progress():
        w = export(args.dir, args.out, args.format, layout=args.layout, dtype=args.dtype,
                   max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    out_console().print(f"exported {args.dir} as {w.format} ({args.layout} layout) to {args.out}: {w.dtype}, "
                        f"{w.bytes / 1e9:.2f} GB in {w.seconds:.1f} s, peak RSS {w.peak_rss / 2**30:.2f} GiB{w.note}")
