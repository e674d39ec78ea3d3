"""`moekit train RECIPE [key=value ...]` and `moekit validate RECIPE [key=value ...]`.

Multi-process: `accelerate launch -m moekit train RECIPE` or `torchrun --nproc-per-node N -m moekit
train RECIPE`; transformers' Trainer picks the distributed setup up from the environment.
"""
from __future__ import annotations

import argparse

from moekit.cli.common import err_console, out_console
from moekit.cli.plan import add_plan_args
from moekit.cli.progress import progress


def add_parser(sub) -> None:
    for name, helptext in (("train", "train a recipe (upcycle + fine-tune, or a dense/LoRA baseline)"),
                           ("validate", "check a recipe file without running it")):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("recipe", help="YAML recipe file")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")
        if name == "train":
            p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
            p.add_argument("--resume", action="store_true",
                           help="continue from the last checkpoint in `out` (with --overwrite: start over if there is none)")
            add_plan_args(p)
        p.set_defaults(run=run_train if name == "train" else run_validate)


def run_validate(args: argparse.Namespace) -> None:
    from moekit.training.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    out_console().print(f"{args.recipe}: valid ({recipe.task}, {recipe.method}, {recipe.train.steps} steps, "
                        f"out={recipe.out})")


def run_train(args: argparse.Namespace) -> None:
    from moekit.cli.tables import run_table
    from moekit.training.api import plan, recipe_of, train

    if args.dry_run:
        from moekit.cli.plan import print_plan

        print_plan(plan(args.recipe, args.overrides, devices=args.devices, expert_parallel=args.expert_parallel,
                        log=err_console().print), args.device_memory)
        return
    overrides = list(args.overrides)
    if args.expert_parallel:  # --expert-parallel N runs as train.expert_parallel=N
        overrides.append(f"train.expert_parallel={args.expert_parallel}")
    recipe = recipe_of(args.recipe, overrides)
    from moekit.training.parallel import leave_launch

    with progress():
        trainer = train(args.recipe, overrides, overwrite=args.overwrite, resume=args.resume)
    leave_launch()
    if trainer.is_world_process_zero():
        out_console().print(run_table(recipe, trainer.results))
        out_console().print(f"trained {recipe.name}: {trainer.state.global_step} steps, output in {recipe.out}")
