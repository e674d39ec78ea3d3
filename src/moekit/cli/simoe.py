"""`moekit simoe report|export RUN_DIR`: where a SIMoE model upcycled, and compact or merged exports."""
from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import out_console
from moekit.errors import CheckpointError, ConfigError


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


def _open(run_dir: str):
    """(model, tokenizer, recipe or None) of a run directory or a bare SIMoE checkpoint."""
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.simoe.export import load
    from moekit.training.recipe import load_recipe

    run = Path(run_dir)
    folder = run / "model" if (run / "model").is_dir() else run
    model = load(folder)
    recipe = load_recipe(run / "recipe.yaml", [f"out={run}"]) if (run / "recipe.yaml").is_file() else None
    return model, load_tokenizer(folder), recipe


def _routing(model, tok, recipe) -> dict[str, list[float]] | None:
    """Mean routing per test task (or direction) of the run's recipe."""
    from moekit.data.parallel import prompt_of
    from moekit.simoe.analysis import task_routing
    from moekit.training.run import load_data

    if recipe is None or tok is None:
        return None
    _, test = load_data(recipe)
    return task_routing(model, tok, {t: [prompt_of(p, recipe.data.template) for p in ps] for t, ps in test.items()},
                        recipe.eval.batch_size)


def run_report(args: argparse.Namespace) -> None:
    from moekit._fs import reserve
    from moekit.simoe.analysis import write_report

    with reserve(args.out, [args.run_dir], args.overwrite):
        model, tok, recipe = _open(args.run_dir)
        out = write_report(model, args.out, _routing(model, tok, recipe), overwrite=args.overwrite)
    out_console().print(f"SIMoE report written to {out}")


def run_export(args: argparse.Namespace) -> None:
    from moekit._fs import reserve

    with reserve(args.out, [args.run_dir], args.overwrite):
        message = _export(args)
    out_console().print(message)


def _export(args: argparse.Namespace) -> str:
    from moekit._fs import output
    from moekit.checkpoint.card import write_model_card
    from moekit.simoe.export import merge, prune, save
    from moekit.simoe.model import param_counts

    model, tok, recipe = _open(args.run_dir)
    before = param_counts(model)
    if args.merge:
        routing = _routing(model, tok, recipe)
        if routing is None:
            raise CheckpointError(f"--merge needs a run directory (recipe.yaml and tokenizer): {args.run_dir}")
        if args.merge not in routing:
            raise ConfigError(f"unknown task {args.merge!r}; the run's test tasks: {', '.join(routing)}")
        import torch

        dense = merge(model, torch.tensor(routing[args.merge]))
        with output(args.out, overwrite=args.overwrite) as tmp:
            dense.save_pretrained(tmp)
            write_model_card(dense, tmp, title=f"SIMoE model merged for task {args.merge!r}")
            if tok is not None:
                tok.save_pretrained(tmp)
        total = sum(p.numel() for p in dense.parameters())
        return (f"dense model for {args.merge!r} written to {args.out}: {total:,} parameters "
                f"(SIMoE form: {before['total']:,} total, {before['active']:,} active)")
    if args.prune:
        prune(model)
    save(model, args.out, args.overwrite, tokenizer=tok)
    after = param_counts(model)
    return (f"SIMoE model written to {args.out}: {after['total']:,} total / {after['active']:,} active "
            f"parameters (before: {before['total']:,} / {before['active']:,})")
