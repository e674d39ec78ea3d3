"""`moekit export DIR --format NAME --out DIR2`: moekit checkpoint -> native HF MoE checkpoint."""
from __future__ import annotations

import argparse

from moekit.cli.common import err_console, out_console


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a moekit checkpoint in a native HF MoE format",
                       description="Export a moekit checkpoint as a native transformers MoE model "
                                   "(see `moekit list formats`).")
    p.add_argument("dir", help="moekit checkpoint directory")
    p.add_argument("--format", required=True, help="mixtral, qwen3_moe, qwen2_moe, ...")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from moekit._fs import reserve
    from moekit.export import EXPORTERS, export_model
    from moekit.io import load, load_tokenizer, read_meta

    EXPORTERS.get(args.format)  # unknown format: ConfigError before any loading
    with reserve(args.out, [args.dir], args.overwrite):
        read_meta(args.dir)
        tokenizer = load_tokenizer(args.dir)
        with err_console().status(f"loading {args.dir}"):
            model = load(args.dir)
        with err_console().status(f"exporting to {args.out}"):
            export_model(model, args.format, args.out, overwrite=args.overwrite, tokenizer=tokenizer)
    out_console().print(f"exported {args.dir} as {args.format} to {args.out}"
                        f"{' with tokenizer' if tokenizer is not None else ''}")
