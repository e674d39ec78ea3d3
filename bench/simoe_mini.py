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

Each finished system's per-item ROUGE-L ("seen", "unseen") and the numbers of its rows are committed under
bench/results/<section>/seed0/ (evidence.save_scores; <section>: simoe_mini or simoe_mini_common; no weights, no
outputs), and the report is made from those files alone: `--report-only` rebuilds the section from a clone.
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

from evidence import RESULTS, load_runs, load_scores, save_scores  # bench/evidence.py
from report import paired_bootstrap, write_section  # bench/report.py

SYSTEMS = {"full FT": ("instruct_ft", []), "sparse upcycling": ("instruct_upcycle", []),  # label: (recipe, overrides)
           "SIMoE": ("simoe_instruct", []), "SIMoE w/o ortho": ("simoe_instruct", ["simoe.mask_lr=0.1", "simoe.ortho=0"]),  # ablation (b) of "SIMoE mask lr 0.1"
           "SIMoE mask lr 0.05": ("simoe_instruct", ["simoe.mask_lr=0.05"]),  # masks that move within 125 steps
           "SIMoE mask lr 0.1": ("simoe_instruct", ["simoe.mask_lr=0.1"]),  # faster; 0.585 of τ = 0.75 in 125 steps
           "SIMoE mask lr 0.1 250 steps": ("simoe_instruct", ["simoe.mask_lr=0.1", "train.steps=250"])}  # τ binds?
# Issue 30: SIMoE and its ablations at the baselines' optimizer and budget (AdamW 1e-4, linear, 10 % warm-up, no
# weight decay, 125 steps of 8), so that no row differs from full FT / sparse upcycling in the optimizer of the
# weights they share. The masks' log α are parameters the baselines do not have: they get their own lr 0.5, enough
# to reach τ = 0.75 in 125 steps under the linear decay (at 1e-4 the constraint could not bind: reaching τ takes a
# move of 4.0 in log α). (c)'s real-valued masks are ordinary parameters at 1e-4 (Table 4: "freely optimized as
# standard trainable parameters"), with no constraint.
COMMON = ["optim.lr=1e-4", "optim.schedule=linear", "optim.warmup_ratio=0.1", "optim.weight_decay=0"]
SYSTEMS.update({
    "SIMoE (common optimizer)": ("simoe_instruct", [*COMMON, "simoe.mask_lr=0.5"]),
    "SIMoE w/o ortho (b) (common optimizer)": ("simoe_instruct", [*COMMON, "simoe.mask_lr=0.5", "simoe.ortho=0"]),
    "SIMoE real masks (c) (common optimizer)": ("simoe_instruct", [*COMMON, "simoe.masks=real"]),
})
COMMON_SYSTEMS = ["SIMoE (common optimizer)", "SIMoE w/o ortho (b) (common optimizer)",
                  "SIMoE real masks (c) (common optimizer)", "full FT", "sparse upcycling"]
OVERRIDES = ["train.steps=125", "train.batch_size=8", "data.train_per_task=200", "data.test_per_task=32",
             "eval.max_new_tokens=48", "train.save_every=25", "train.logging_steps=5"]
MARK = ("<!-- simoe_mini -->", "<!-- /simoe_mini -->")
COMMON_MARK = ("<!-- simoe_mini_common -->", "<!-- /simoe_mini_common -->")
BENCHES = {MARK: "simoe_mini", COMMON_MARK: "simoe_mini_common"}  # bench/results/<…>


def folder_of(out: Path, label: str) -> Path:
    return out / label.replace(" ", "_").replace("/", "").replace("(", "").replace(")", "")


def child(label: str, out: Path) -> None:
    """Train one system (resuming from its last checkpoint) and write its summary.json."""
    from moekit.training.recipe import load_recipe
    from moekit.training.run import train

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


def keep(label: str, out: Path, summary: dict, bench: str, root: Path = RESULTS) -> None:
    """Commit a finished system under root/<bench>/seed0/: its per-item ROUGE-L and its rows' numbers."""
    from moekit.training.recipe import load_recipe

    folder = folder_of(out, label)
    r = json.loads((folder / "results.json").read_text())
    recipe = load_recipe(folder / "recipe.yaml")
    run = {"groups": {g: {k: v[k] for k in ("rougeL", "chrf")} for g, v in r["groups"].items()},
           "directions": {t: {"rougeL": v["rougeL"]} for t, v in r["directions"].items()},
           "params": {k: r["params"][k] for k in ("total", "active")},
           "tau": recipe.simoe.tau if recipe.simoe is not None else None, **summary}
    save_scores(bench, label, 0, item_rouge(out, label, *held_out(out, label)), root, run)


def row(label: str, s: dict) -> str:
    """The table's row of one committed system (keep)."""
    g, p = s["groups"], s["params"]
    sparsity = "–" if s["sparsity"] is None else f"{s['sparsity']:.3f}"
    if s["sparsity"] is not None and s["sparsity"] < s["tau"]:
        sparsity += " (below τ)"
    lam = "–" if not s.get("lambda") else f"{max(s['lambda']):.3g} / {s['lambda'][-1]:.3g}"
    pruned = f"{s['pruned_params']:,} ({s['pruned_params'] / s['unpruned_params']:.3f}×)" if "pruned_params" in s else "–"
    return (f"| {label} | {g['seen']['rougeL']:.1f} | {g['seen']['chrf']:.1f} | {g['unseen']['rougeL']:.1f} | "
            f"{g['unseen']['chrf']:.1f} | {sparsity} | {lam} | {p['total']:,} | {p['active']:,} | {pruned} | "
            f"{s['peak_rss'] / 2**30:.2f} | {s['seconds'] / 60:.1f} |")


def per_task(results: dict) -> list[str]:
    """ROUGE-L per task of each committed system (label -> its values)."""
    tasks = list(next(iter(results.values()))["directions"])
    return ["| task | " + " | ".join(results) + " |", "|---|" + "---|" * len(results),
            *[f"| {t} | " + " | ".join(f"{r['directions'][t]['rougeL']:.1f}" for r in results.values()) + " |"
              for t in tasks]]


def held_out(out: Path, label: str) -> tuple[dict, list[str]]:
    """({task: test pairs}, unseen task names) of a system's run; every system shares them (same data overrides)."""
    from moekit.data.instruct import load_instruct_pairs
    from moekit.training.recipe import load_recipe

    data = load_recipe(folder_of(out, label) / "recipe.yaml").data
    return load_instruct_pairs(data)[1], data.task_names()[1]


def item_rouge(out: Path, label: str, test: dict, unseen: list[str]) -> dict[str, list[float]]:
    """{"seen"/"unseen": per-item ROUGE-L of one run's test outputs, tasks in order}; checked against the run's
    own task means (equal items per task, so the item mean is the unweighted task mean the table reports)."""
    from moekit.eval.instruct import rouge_l

    results = json.loads((folder_of(out, label) / "results.json").read_text())
    scores = {"seen": [], "unseen": []}
    for task, pairs in test.items():
        hyps = results["translations"][task]
        scores["unseen" if task in unseen else "seen"] += [rouge_l([h], [p.tgt]) for h, p in zip(hyps, pairs)]
    for group, items in scores.items():
        if abs(sum(items) / len(items) - results["groups"][group]["rougeL"]) > 1e-6:
            raise ValueError(f"{label}: per-item ROUGE-L does not average to the run's {group} mean")
    return scores


def paired(scores: dict, labels: list[str], base: str = "full FT") -> list[str]:
    """Each system − `base` in ROUGE-L, mean and 95 % paired bootstrap interval over test items (one seed); `scores`:
    the committed per-item scores (load_scores)."""
    ref = scores[(base, 0)]
    lines = [f"ROUGE-L difference to {base}, 95 % paired bootstrap interval over test items (one seed, 2000 "
             "resamples):", "", "| system | seen | unseen |", "|---|---|---|"]
    for label in labels:
        cells = [paired_bootstrap([scores[(label, 0)][g]], [ref[g]]) for g in ("seen", "unseen")]
        lines.append(f"| {label} | " + " | ".join(f"{c['mean']:+.1f} [{c['lo']:+.1f}, {c['hi']:+.1f}]" for c in cells)
                     + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/simoe_mini"))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS))
    ap.add_argument("--common", action="store_true",
                    help="issue 30: SIMoE, ablations (b) and (c) at the baselines' optimizer and budget, then the "
                         "baselines, into their own section (default systems: " + ", ".join(COMMON_SYSTEMS) + ")")
    ap.add_argument("--report-only", action="store_true",
                    help="report the systems committed under --results, train nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished system's per-item scores and rows are committed, and reported from")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.out)
    systems = args.systems or (COMMON_SYSTEMS if args.common else [s for s in SYSTEMS if s not in COMMON_SYSTEMS[:3]])
    mark = COMMON_MARK if args.common else MARK
    bench = BENCHES[mark]
    if not args.report_only:
        for label in systems:
            keep(label, args.out, run_system(label, args.out), bench, args.results)
    committed = {n: r for (n, _), r in load_runs(bench, args.results).items()}
    summaries = {label: committed[label] for label in systems if label in committed}
    simoe = {label: s for label, s in summaries.items() if "nonzero" in s}
    cmd = (f".venv/bin/python bench/simoe_mini.py --out {args.out}" + (" --common" if args.common else "")
           + ("" if args.systems is None else " --systems " + " ".join(f"'{s}'" for s in args.systems))
           + (f" --write {args.write}" if args.write else ""))
    missing = [s for s in systems if s not in summaries]
    status = f" **Incomplete run: {', '.join(missing)} not finished yet.**" if missing else ""
    title = ("SIMoE at one optimizer and budget: SIMoE, ablations (b) and (c), baselines (issue 30)" if args.common
             else "SIMoE in miniature")
    common = (" Every row: AdamW 1e-4, linear schedule, 10 % warm-up, no weight decay, 125 steps of 8 (the baselines' "
              "optimizer; the SIMoE rows override simoe_instruct.yaml's Adam 2e-5 constant with `" + " ".join(COMMON)
              + "`). What still differs, plainly: the hard-concrete masks' log α (parameters only SIMoE has) train at "
              "their own lr 0.5 (`simoe.mask_lr=0.5`); (c)'s real-valued masks are ordinary parameters at 1e-4 with no "
              "sparsity constraint (`simoe.masks=real`).") if args.common else ""
    section = "\n".join([
        mark[0], f"## {title} (bench/simoe_mini.py)", "",
        f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores, fp32. Overrides on every recipe: "
        f"`{' '.join(OVERRIDES)}`. Seen = held-out verses of the 5 trained tasks, unseen = 4 tasks of untrained "
        "categories (reverse translation, book name, paraphrase); unweighted means over tasks." + common + status, "",
        "| system | seen ROUGE-L | seen chrF | unseen ROUGE-L | unseen chrF | final mask sparsity (τ = 0.75) | λ max / "
        "final | total params | active params | pruned export | peak RSS (GiB) | wall (min) |", "|---" * 12 + "|",
        *[row(label, s) for label, s in summaries.items()], "",
        *(["ROUGE-L per task:", "", *per_task(summaries), ""] if summaries else []),
        *(paired(load_scores(bench, args.results), [s for s in summaries if s != "full FT"])
          if args.common and "full FT" in summaries else []),
        *[f"{label}: non-zero expert parameters (Fig. 4, median gates) "
          + " · ".join(f"{k} {v:.2f}" for k, v in s["nonzero"]["by_type"].items())
          + f"; overall {s['nonzero']['overall']:.3f}; by depth "
          + " ".join(f"{v:.2f}" for _, v in sorted(s["nonzero"]["by_depth"].items(), key=lambda kv: int(kv[0])))
          + f"; mean mask overlap between experts (Fig. 5) {s['overlap']:.3f}.\n" for label, s in simoe.items()],
        mark[1]])
    print(section)
    if args.write:
        write_section(args.write, section, mark)


if __name__ == "__main__":
    main()
