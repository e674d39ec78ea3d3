"""`moekit train RECIPE [key=value ...]` and `moekit validate RECIPE [key=value ...]`.

Multi-process: `accelerate launch -m moekit train RECIPE` or `torchrun --nproc-per-node N -m moekit
train RECIPE`; transformers' Trainer picks the distributed setup up from the environment.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli.common import out_console
from moekit.cli.progress import progress


def add_parser(sub) -> None:
    for name, helptext in (("train", "train a recipe (upcycle + fine-tune, or a dense/LoRA baseline)"),
                           ("validate", "check a recipe file without running it")):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("recipe", help="YAML recipe file")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
        if name == "train":
            p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
            p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in `out`")
        p.set_defaults(run=run_train if name == "train" else run_validate)


def run_validate(args: argparse.Namespace) -> None:
    from moekit.train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    out_console().print(f"{args.recipe}: valid ({recipe.task}, {recipe.method}, {recipe.train.steps} steps, "
                        f"out={recipe.out})")


def run_train(args: argparse.Namespace) -> None:
    from moekit.train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.task == "asr":
        from moekit.train.asr import train_asr as train
    else:
        from moekit.train.run import train
    with progress():
        trainer = train(recipe, overwrite=args.overwrite, resume=args.resume, inputs=[Path(args.recipe)])
    if trainer.is_world_process_zero():
        out_console().print(results_table(recipe, trainer.results))
        out_console().print(f"trained {recipe.name}: {trainer.state.global_step} steps, output in {recipe.out}")


def results_table(recipe, results: dict):
    """The results table of a translation or an ASR run."""
    title = f"{recipe.name} ({recipe.out})"
    if recipe.task == "asr":
        from moekit.speech.evaluate import asr_table

        return asr_table(results, title=title)
    from moekit.evaluate import result_rows, results_table as table

    return table(result_rows(results), title=title)
