"""How much of SIMoE's evaluation depends on the deterministic gates: re-evaluates the SIMoE model that
bench/simoe_mini.py trained with every mask at its expected training gate E[z] (mean of 64 hard-concrete
draws, eqs. 4-5) instead of the median gate of eq. 7 (what the run itself reports), on the same test sets.

    .venv/bin/python bench/simoe_gates.py --run runs/simoe_mini/simoe_instruct --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest import mock

import torch

from moekit.checkpoint.format import load_model
from moekit.simoe import hard_concrete as hc
from moekit.simoe.model import si_modules
from moekit.training.recipe import load_recipe
from moekit.training.run import evaluate, load_data
from moekit.training.common import load_tokenizer
from report import write_section  # bench/report.py

MARK = ("<!-- simoe_gates -->", "<!-- /simoe_gates -->")
DRAWS = 64


def mean_gates(draws: int, seed: int = 0):
    """A stand-in for hc.median returning E[z] per gate, estimated once per mask tensor."""
    g, cache = torch.Generator().manual_seed(seed), {}

    def gate(log_alpha: torch.Tensor) -> torch.Tensor:
        if id(log_alpha) not in cache:
            cache[id(log_alpha)] = torch.stack([hc.sample(log_alpha.detach(), g) for _ in range(draws)]).mean(0)
        return cache[id(log_alpha)]
    return gate


def row(label: str, r: dict, gates: torch.Tensor) -> str:
    empty = sum(not h.strip() for hyps in r["translations"].values() for h in hyps)
    n = sum(len(h) for h in r["translations"].values())
    g = r["groups"]
    return (f"| {label} | {gates.mean():.3f} | {g['seen']['loss']:.2f} | {g['seen']['rougeL']:.1f} | "
            f"{g['unseen']['loss']:.2f} | {g['unseen']['rougeL']:.1f} | {empty} / {n} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/simoe_mini/simoe_instruct"))
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    recipe = load_recipe(args.run / "recipe.yaml", [])
    _, test = load_data(recipe)
    model = load_model(args.run / "model").eval()
    log_alpha = torch.cat([m.log_alpha.detach().flatten() for _, m in si_modules(model)])
    median = json.loads((args.run / "results.json").read_text())
    mean = mean_gates(DRAWS)
    with mock.patch.object(hc, "median", mean):  # every SI module's eval gates read E[z]
        expected = evaluate(recipe, model, load_tokenizer(args.run / "model"), test, None)
    cmd = f".venv/bin/python bench/simoe_gates.py --run {args.run}" + (f" --write {args.write}" if args.write else "")
    section = "\n".join([
        MARK[0], "## SIMoE evaluation gates (bench/simoe_gates.py)", "",
        f"`{cmd}` — the SIMoE model of the table above, evaluated with median gates (eq. 7, from its "
        f"results.json) and with each gate's mean over {DRAWS} training draws (eqs. 4-5). Loss in nats; "
        "empty = answers that end immediately.", "",
        "| eval gates | mean gate | seen loss | seen ROUGE-L | unseen loss | unseen ROUGE-L | empty answers |",
        "|---|---|---|---|---|---|---|",
        row("median (eq. 7)", median, hc.median(log_alpha)),
        row(f"E[z] ({DRAWS} draws)", expected, mean(log_alpha)), "", MARK[1]])
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
