"""`moekit demo`: the main job on the built-in default (SmolLM2-135M, verse-aligned Bible).

Upcycles SmolLM2-135M with naive upcycling and with SPRI (two-stage; E=8, top-2, every 4th
block, dense-copied shared expert as SPRI §3.2), fine-tunes each on the same small En→French and
En→Swahili subset for the same number of steps, evaluates both on held-out verses, and prints the
comparison (BLEU/chrF, target loss, KL to the dense model, diversity, parameters). Budget on 2 CPU
cores: 2 × 24 optimizer steps of 8 examples ≤ 96 tokens, 8 test verses per direction, greedy
decoding of at most 48 tokens. Measured here with the assets cached: 10.8 minutes in all while other
jobs shared the cores (one system alone on an idle machine: 142 s). Far too little training for good
translations: it shows the pipeline, not the paper's result.
"""
from __future__ import annotations

import time
from pathlib import Path

from typing import TYPE_CHECKING

from moekit.cli.common import human, out_console
from moekit.cli.progress import progress

if TYPE_CHECKING:
    from rich.table import Table

    from moekit.training.recipe import TranslationRecipe

SYSTEMS = {
    "naive": {"moe": {"init": "naive"}, "freeze": {"schedule": "none"}},
    "spri_two_stage": {"moe": {"init": "spri"}, "freeze": {"schedule": "spri_two_stage", "tau": 0.1}},
}
BASE = {
    "model": {"path": "smollm2-135m"}, "method": "moe",
    "moe": {"num_experts": 8, "top_k": 2, "every": 4, "shared_expert": True},
    "data": {"source": "bible", "directions": ["fr", "sw"], "train_per_direction": 96, "test_per_direction": 8,
             "max_length": 96, "max_src_chars": 160},
    "optim": {"lr": 2e-4, "warmup_ratio": 0.1},
    "train": {"steps": 24, "batch_size": 8, "logging_steps": 4, "eval_every": 8},
    "eval": {"kl_examples": 8, "max_new_tokens": 48, "batch_size": 8},
}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the built-in demo (SmolLM2-135M: naive vs SPRI, fine-tuned and compared)",
                       description=__doc__)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides applied to both systems")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(run=run)


def recipes(out: Path, overrides: list[str]) -> dict[str, TranslationRecipe]:
    from moekit.config import apply_overrides, validate
    from moekit.training.recipe import TranslationRecipe

    built = {}
    for name, system in SYSTEMS.items():
        data = {**BASE, "name": name, "out": str(out / name), "freeze": system["freeze"],
                "moe": {**BASE["moe"], **system["moe"]}}
        built[name] = validate(TranslationRecipe, apply_overrides(data, overrides), source=f"demo recipe {name}")
    return built


def run(args) -> None:
    from moekit._fs import output

    systems = recipes(Path(args.out), args.overrides)  # validated before any work
    with output(args.out, overwrite=args.overwrite) as tmp, progress():  # the old output stays until this one is done
        table = run_systems(systems, tmp, Path(args.out))
    out_console().print(table)
    out_console().print(f"runs, results.json/csv and plots (loss.png, kl.png, usage.png): "
                        f"{args.out}/{{{','.join(SYSTEMS)}}}")


def four(x: float | None) -> str:
    return "-" if x is None else f"{round(x, 4) + 0.0:.4f}"  # + 0.0: no "-0.0000"


def run_systems(systems: dict[str, TranslationRecipe], folder: Path, final: Path) -> Table:
    """Train and evaluate each system into `folder`/<system> (to be renamed `final`); the comparison table."""
    from rich.table import Table

    from moekit.training.run import train

    table = Table(title="moekit demo: SmolLM2-135M upcycled (E=8, top-2, every 4th block), equal fine-tuning budget")
    for col in ("system", "BLEU", "chrF", "target loss", "KL(dense‖model)", "diversity init → trained", "total params",
                "active params", "train+eval (s)"):
        table.add_column(col)
    for name, recipe in systems.items():
        t0 = time.perf_counter()
        r = train(recipe.model_copy(update={"out": str(folder / name)}), final_out=str(final / name)).results
        avg = r["avg"]
        table.add_row(name, f"{avg.get('bleu', float('nan')):.2f}", f"{avg.get('chrf', float('nan')):.2f}",
                      f"{avg['loss']:.3f}", "-" if r["kl"] is None else f"{r['kl']:.4f}",
                      f"{four(r['diversity_init'])} → {four(r['diversity'])}", human(r["params"]["total"]),
                      human(r["params"]["active"]), f"{time.perf_counter() - t0:.0f}")
    return table
