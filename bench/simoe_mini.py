"""SIMoE Table 1 in miniature: SmolLM2-135M instruction-tuned on the Bible instruction mix
(moekit.data.instruct: 5 trained tasks, 4 unseen ones from categories never trained on) by full
fine-tuning, sparse upcycling (every FFN → 8 dense-copied experts, top-2) and SIMoE (M = 8, τ = 0.75),
equal steps, data and optimizer (the recipes in recipes/ with the overrides below). Reported: ROUGE-L
and chrF on held-out verses of the trained tasks ("seen") and on the unseen tasks, final expected
sparsity vs τ, total/active parameters, peak RSS of the training process (each system runs in its own
process), wall time, and where SIMoE upcycled (non-zero expert parameters per layer type).
Finished systems are cached (summary.json), so an interrupted run resumes.

    .venv/bin/python bench/simoe_mini.py --out runs/simoe_mini --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from report import write_section  # bench/report.py

SYSTEMS = {"full FT": "instruct_ft", "sparse upcycling": "instruct_upcycle", "SIMoE": "simoe_instruct"}
OVERRIDES = ["train.steps=125", "train.batch_size=8", "data.train_per_task=200", "data.test_per_task=32",
             "eval.max_new_tokens=48", "train.save_every=25", "train.logging_steps=5"]
MARK = ("<!-- simoe_mini -->", "<!-- /simoe_mini -->")


def child(recipe_name: str, folder: Path) -> None:
    """Train one system (resuming from its last checkpoint) and write its summary.json."""
    from moekit.train.recipe import load_recipe
    from moekit.train.run import train

    recipe = load_recipe(Path("recipes") / f"{recipe_name}.yaml", [*OVERRIDES, f"out={folder}"])
    t0 = time.perf_counter()
    trainer = train(recipe, overwrite=True, resume=True)
    last = [h for h in trainer.state.log_history if "simoe/sparsity" in h]
    summary = {"seconds": time.perf_counter() - t0,
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "sparsity": last[-1]["simoe/sparsity"] if last else None}
    if recipe.method == "simoe":
        from moekit.simoe.analysis import nonzero_fractions
        from moekit.simoe.export import load

        summary["nonzero"] = nonzero_fractions(load(folder / "model"))
    (folder / "summary.json").write_text(json.dumps(summary))


def run_system(recipe_name: str, out: Path) -> dict:
    folder = out / recipe_name
    if not (folder / "summary.json").is_file():
        subprocess.run([sys.executable, __file__, "--child", recipe_name, "--out", str(out)], check=True)
    return json.loads((folder / "summary.json").read_text())


def row(label: str, folder: Path, s: dict) -> str:
    r = json.loads((folder / "results.json").read_text())
    g, p = r["groups"], r["params"]
    sparsity = "–" if s["sparsity"] is None else f"{s['sparsity']:.3f}"
    return (f"| {label} | {g['seen']['rougeL']:.1f} | {g['seen']['chrf']:.1f} | {g['unseen']['rougeL']:.1f} | "
            f"{g['unseen']['chrf']:.1f} | {sparsity} | {p['total']:,} | {p['active']:,} | "
            f"{s['peak_rss'] / 2**30:.2f} | {s['seconds'] / 60:.1f} |")


def per_task(out: Path) -> list[str]:
    results = {label: json.loads((out / name / "results.json").read_text()) for label, name in SYSTEMS.items()}
    tasks = list(next(iter(results.values()))["directions"])
    return ["| task | " + " | ".join(results) + " |", "|---|" + "---|" * len(results),
            *[f"| {t} | " + " | ".join(f"{r['directions'][t]['rougeL']:.1f}" for r in results.values()) + " |"
              for t in tasks]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/simoe_mini"))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.out / args.child)
    summaries = {label: run_system(name, args.out) for label, name in SYSTEMS.items()}
    simoe = summaries["SIMoE"]
    pattern = " · ".join(f"{k} {v:.2f}" for k, v in simoe["nonzero"]["by_type"].items())
    cmd = f".venv/bin/python bench/simoe_mini.py --out {args.out}" + (f" --write {args.write}" if args.write else "")
    section = "\n".join([
        MARK[0], "## SIMoE in miniature (bench/simoe_mini.py)", "",
        f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores, fp32. Overrides on every recipe: "
        f"`{' '.join(OVERRIDES)}`. Seen = held-out verses of the 5 trained tasks, unseen = 4 tasks of untrained "
        "categories (reverse translation, book name, paraphrase); unweighted means over tasks.", "",
        "| system | seen ROUGE-L | seen chrF | unseen ROUGE-L | unseen chrF | final sparsity (τ = 0.75) | total params "
        "| active params | peak RSS (GiB) | wall (min) |", "|---|---|---|---|---|---|---|---|---|---|",
        *[row(label, args.out / SYSTEMS[label], s) for label, s in summaries.items()], "",
        "ROUGE-L per task:", "", *per_task(args.out), "",
        f"Where SIMoE upcycled (non-zero expert parameters, median gates): {pattern}; overall "
        f"{simoe['nonzero']['overall']:.3f}.", "", MARK[1]])
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
