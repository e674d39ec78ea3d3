"""`moekit train RECIPE [key=value ...]` and `moekit validate RECIPE [key=value ...]`.

Multi-process: `accelerate launch -m moekit train RECIPE` or `torchrun --nproc-per-node N -m moekit
train RECIPE`; transformers' Trainer picks the distributed setup up from the environment.
"""
from __future__ import annotations

import argparse

from moekit.cli.common import out_console
from moekit.config import load_yaml
from moekit.train.recipe import Recipe


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
    recipe = load_yaml(args.recipe, Recipe, args.overrides)
    out_console().print(f"{args.recipe}: valid ({recipe.method}, {recipe.train.steps} steps, out={recipe.out})")


def run_train(args: argparse.Namespace) -> None:
    from moekit.train.run import train

    recipe = load_yaml(args.recipe, Recipe, args.overrides)
    trainer = train(recipe, overwrite=args.overwrite, resume=args.resume)
    if trainer.is_world_process_zero():
        from moekit.evaluate import result_rows, results_table

        out_console().print(results_table(result_rows(trainer.results), title=f"{recipe.name} ({recipe.out})"))
        out_console().print(f"trained {recipe.name}: {trainer.state.global_step} steps, output in {recipe.out}")
