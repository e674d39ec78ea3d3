"""SIMoE Table 1 in miniature: SmolLM2-135M instruction-tuned on the Bible instruction mix
(moekit.data.instruct: 5 trained tasks, 4 unseen ones from categories never trained on) by full
fine-tuning, sparse upcycling (every FFN → 4 dense-copied experts, top-2; SIMoE §4) and SIMoE (M = 8,
τ = 0.75, the paper's defaults: median gates, Table 6's Adam 2e-5 constant) with and without the
orthogonality penalty (ablation (b)), equal steps and data (the recipes in recipes/ with the overrides
below). Reported: ROUGE-L and chrF on held-out verses of the trained tasks ("seen") and on the unseen
tasks, final mask sparsity 1 − L0(Z) vs τ and λ, total/active parameters and the pruned export's size,
peak RSS of the training process (each system runs in its own process), wall time, where SIMoE upcycled
(Fig. 4: non-zero expert parameters per layer type and depth) and the experts' mask overlaps (Fig. 5).
Finished systems are cached (summary.json), so an interrupted run resumes.

    .venv/bin/python bench/simoe_mini.py --out runs/simoe_mini --write BENCHMARKS.md [--systems ...]
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

SYSTEMS = {"full FT": ("instruct_ft", []), "sparse upcycling": ("instruct_upcycle", []),  # label: (recipe, overrides)
           "SIMoE": ("simoe_instruct", []), "SIMoE w/o ortho": ("simoe_instruct", ["simoe.mask_lr=0.1", "simoe.ortho=0"]),  # ablation (b) of "SIMoE mask lr 0.1"
           "SIMoE mask lr 0.05": ("simoe_instruct", ["simoe.mask_lr=0.05"]),  # masks that move within 125 steps
           "SIMoE mask lr 0.1": ("simoe_instruct", ["simoe.mask_lr=0.1"]),  # faster; 0.585 of τ = 0.75 in 125 steps
           "SIMoE mask lr 0.1 250 steps": ("simoe_instruct", ["simoe.mask_lr=0.1", "train.steps=250"])}  # τ binds?
OVERRIDES = ["train.steps=125", "train.batch_size=8", "data.train_per_task=200", "data.test_per_task=32",
             "eval.max_new_tokens=48", "train.save_every=25", "train.logging_steps=5"]
MARK = ("<!-- simoe_mini -->", "<!-- /simoe_mini -->")


def folder_of(out: Path, label: str) -> Path:
    return out / label.replace(" ", "_").replace("/", "")


def child(label: str, out: Path) -> None:
    """Train one system (resuming from its last checkpoint) and write its summary.json."""
    from moekit.train.recipe import load_recipe
    from moekit.train.run import train

    recipe_name, extra = SYSTEMS[label]
    folder = folder_of(out, label)
    recipe = load_recipe(Path("recipes") / f"{recipe_name}.yaml", [*OVERRIDES, *extra, f"out={folder}"])
    t0 = time.perf_counter()
    trainer = train(recipe, overwrite=True, resume=True)
    last = [h for h in trainer.state.log_history if "simoe/sparsity" in h]
    summary = {"seconds": time.perf_counter() - t0,
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "sparsity": last[-1]["simoe/sparsity"] if last else None,
               "lambda": [h["simoe/lambda"] for h in last]}
    if recipe.method == "simoe":
        import numpy as np

        from moekit.simoe.analysis import nonzero_fractions, overlaps
        from moekit.simoe.export import load, prune
        from moekit.simoe.model import param_counts

        model = load(folder / "model").eval()
        ov = overlaps(model)
        summary["nonzero"] = nonzero_fractions(model)
        summary["overlap"] = float(ov[~np.eye(len(ov), dtype=bool)].mean())  # mean off-diagonal (Fig. 5)
        summary["pruned_params"] = sum(p.numel() for p in prune(model).parameters())
        summary["unpruned_params"] = param_counts(load(folder / "model"))["total"]
    (folder / "summary.json").write_text(json.dumps(summary))


def run_system(label: str, out: Path) -> dict:
    folder = folder_of(out, label)
    if not (folder / "summary.json").is_file():
        subprocess.run([sys.executable, __file__, "--child", label, "--out", str(out)], check=True)
    return json.loads((folder / "summary.json").read_text())


def row(label: str, folder: Path, s: dict) -> str:
    r = json.loads((folder / "results.json").read_text())
    g, p = r["groups"], r["params"]
    sparsity = "–" if s["sparsity"] is None else f"{s['sparsity']:.3f}"
    lam = "–" if not s.get("lambda") else f"{max(s['lambda']):.3g} / {s['lambda'][-1]:.3g}"
    pruned = f"{s['pruned_params']:,} ({s['pruned_params'] / s['unpruned_params']:.3f}×)" if "pruned_params" in s else "–"
    return (f"| {label} | {g['seen']['rougeL']:.1f} | {g['seen']['chrf']:.1f} | {g['unseen']['rougeL']:.1f} | "
            f"{g['unseen']['chrf']:.1f} | {sparsity} | {lam} | {p['total']:,} | {p['active']:,} | {pruned} | "
            f"{s['peak_rss'] / 2**30:.2f} | {s['seconds'] / 60:.1f} |")


def per_task(out: Path, labels: list[str]) -> list[str]:
    results = {label: json.loads((folder_of(out, label) / "results.json").read_text()) for label in labels}
    tasks = list(next(iter(results.values()))["directions"])
    return ["| task | " + " | ".join(results) + " |", "|---|" + "---|" * len(results),
            *[f"| {t} | " + " | ".join(f"{r['directions'][t]['rougeL']:.1f}" for r in results.values()) + " |"
              for t in tasks]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/simoe_mini"))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.out)
    summaries = {label: run_system(label, args.out) for label in args.systems}
    simoe = {label: s for label, s in summaries.items() if "nonzero" in s}
    cmd = (f".venv/bin/python bench/simoe_mini.py --out {args.out} --systems "
           + " ".join(f"'{s}'" for s in args.systems) + (f" --write {args.write}" if args.write else ""))
    section = "\n".join([
        MARK[0], "## SIMoE in miniature (bench/simoe_mini.py)", "",
        f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores, fp32. Overrides on every recipe: "
        f"`{' '.join(OVERRIDES)}`. Seen = held-out verses of the 5 trained tasks, unseen = 4 tasks of untrained "
        "categories (reverse translation, book name, paraphrase); unweighted means over tasks.", "",
        "| system | seen ROUGE-L | seen chrF | unseen ROUGE-L | unseen chrF | final mask sparsity (τ = 0.75) | λ max / "
        "final | total params | active params | pruned export | peak RSS (GiB) | wall (min) |", "|---" * 12 + "|",
        *[row(label, folder_of(args.out, label), s) for label, s in summaries.items()], "",
        "ROUGE-L per task:", "", *per_task(args.out, args.systems), "",
        *[f"{label}: non-zero expert parameters (Fig. 4, median gates) "
          + " · ".join(f"{k} {v:.2f}" for k, v in s["nonzero"]["by_type"].items())
          + f"; overall {s['nonzero']['overall']:.3f}; by depth "
          + " ".join(f"{v:.2f}" for _, v in sorted(s["nonzero"]["by_depth"].items(), key=lambda kv: int(kv[0])))
          + f"; mean mask overlap between experts (Fig. 5) {s['overlap']:.3f}.\n" for label, s in simoe.items()],
        MARK[1]])
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
