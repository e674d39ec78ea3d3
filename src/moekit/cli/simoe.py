"""`moekit simoe report|export RUN_DIR`: where a SIMoE model upcycled, and compact or merged exports."""
from __future__ import annotations

import argparse

from moekit.cli.common import out_console


def add_parser(sub) -> None:
    p = sub.add_parser("simoe", help="SIMoE models: analysis report, compact or merged export",
                       description="Sparse interpolated MoE (SIMoE) models trained with `method: simoe`.")
    ssub = p.add_subparsers(dest="simoe_command", required=True, metavar="SUBCOMMAND")
    r = ssub.add_parser("report", help="non-zero expert parameters per layer type and depth, expert overlaps, "
                                       "task dendrogram (PNG + report.json)")
    r.add_argument("run_dir", help="a SIMoE run directory (or a SIMoE checkpoint: no task routing then)")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    r.set_defaults(run=run_report)
    e = ssub.add_parser("export", help="save the SIMoE form (--prune: drop unused δ columns) or, with --merge "
                                       "TASK, a plain dense model for that task's mean routing")
    e.add_argument("run_dir", help="a SIMoE run directory or checkpoint")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--prune", action="store_true", help="remove δ columns whose gates are 0 for every expert")
    e.add_argument("--merge", metavar="TASK", help="fold the experts for TASK's mean routing into dense weights")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    e.set_defaults(run=run_export)


def run_report(args: argparse.Namespace) -> None:
    from moekit.training.simoe_run import simoe_report

    out = simoe_report(args.run_dir, args.out, overwrite=args.overwrite)
    out_console().print(f"SIMoE report written to {out}")


def run_export(args: argparse.Namespace) -> None:
    from moekit.training.simoe_run import simoe_export

    w = simoe_export(args.run_dir, args.out, prune=args.prune, merge=args.merge, overwrite=args.overwrite)
    if w.merged_task is None:
        out_console().print(f"SIMoE model written to {args.out}: {w.total:,} total / {w.active:,} active "
                            f"parameters (before: {w.before_total:,} / {w.before_active:,})")
    else:
        out_console().print(f"dense model for {w.merged_task!r} written to {args.out}: {w.total:,} parameters "
                            f"(SIMoE form: {w.before_total:,} total, {w.before_active:,} active)")
