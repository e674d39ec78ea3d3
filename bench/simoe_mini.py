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

Seeds (`--seeds 0 1 2 3 4`): seed n > 0 adds `train.seed=n` (the Trainer's seed, data order) and the recipe's
`simoe.seed=n` (mask initialization) or `moe.seed=n` (upcycling); the data split stays fixed, so every seed is scored
on the same test items. With --common the report gives each claim of claim_specs.SPECS["simoe_mini"] an interval over
seeds × test items and a verdict (report.VERDICT_RULE).

Each finished (system, seed)'s per-item ROUGE-L ("seen", "unseen") and the numbers of its rows are committed under
bench/results/simoe_mini/seed{n}/ (evidence.save_scores; one folder for both sections: full FT and sparse upcycling
are the same runs in each; no weights, no outputs), and the report is made from those files alone: `--report-only`
rebuilds the section from a clone, and bench/claims.py its claims table.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

from claims import committed_claims  # bench/claims.py
from evidence import RESULTS, claim_interval, load_runs, load_scores, paired_items, save_scores  # bench/evidence.py
from report import (device_name, finish, measured_on, seed_folder, seed_overrides, stopwatch, wall,  # bench/report.py
                    write_section)

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
BENCH = "simoe_mini"  # bench/results/<…>
CLAIMS_INTRO = ("Headline claims over seeds (SIMoE Table 1: ahead of full fine-tuning and sparse upcycling on unseen "
                "tasks; Table 4: full SIMoE ahead of ablations (b) and (c) on unseen tasks). Metric: ROUGE-L per test "
                "item of the unseen tasks; Δ = A − B in points.")


def folder_of(out: Path, label: str, seed: int = 0) -> Path:
    return seed_folder(out, label.replace(" ", "_").replace("/", "").replace("(", "").replace(")", ""), seed)


def label_of(label: str, seed: int) -> str:
    return label if seed == 0 else f"{label} (seed {seed})"


def child(label: str, out: Path, seed: int) -> None:
    """Train one system at one seed (resuming from its last checkpoint) and write its summary.json."""
    from moekit.training.recipe import load_recipe
    from moekit.training.run import train

    recipe_name, extra = SYSTEMS[label]
    folder = folder_of(out, label, seed)
    path = Path("recipes") / f"{recipe_name}.yaml"
    recipe = load_recipe(path, [*OVERRIDES, *extra, *seed_overrides(path, seed), f"out={folder}"])
    clock = stopwatch(folder)
    trainer = train(recipe, overwrite=True, resume=True)
    last = [h for h in trainer.state.log_history if "simoe/sparsity" in h]
    summary = {**clock(), "device": device_name(),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "sparsity": last[-1]["simoe/sparsity"] if last else None,
               "lambda": [h["simoe/lambda"] for h in last]}
    if recipe.method == "simoe":
        from moekit.simoe.analysis import nonzero_fractions, overlaps
        from moekit.simoe.export import load, prune
        from moekit.simoe.model import param_counts

        model = load(folder / "model").eval()
        ov = overlaps(model)
        summary["nonzero"] = nonzero_fractions(model)
        summary["overlap"] = float(ov[~np.eye(len(ov), dtype=bool)].mean())  # mean off-diagonal (Fig. 5)
        summary["pruned_params"] = sum(p.numel() for p in prune(model).parameters())
        summary["unpruned_params"] = param_counts(load(folder / "model"))["total"]
    finish(folder, summary)


def run_system(label: str, out: Path, seed: int = 0) -> dict:
    folder = folder_of(out, label, seed)
    if not (folder / "summary.json").is_file():
        subprocess.run([sys.executable, __file__, "--child", label, "--out", str(out), "--seeds", str(seed)], check=True)
    return json.loads((folder / "summary.json").read_text())


def keep(label: str, seed: int, out: Path, summary: dict, root: Path = RESULTS) -> None:
    """Commit a finished (system, seed) under root/simoe_mini/seed{n}/: its per-item ROUGE-L and its rows' numbers."""
    from moekit.training.recipe import load_recipe

    folder = folder_of(out, label, seed)
    r = json.loads((folder / "results.json").read_text())
    recipe = load_recipe(folder / "recipe.yaml")
    run = {"groups": {g: {k: v[k] for k in ("rougeL", "chrf")} for g, v in r["groups"].items()},
           "directions": {t: {"rougeL": v["rougeL"]} for t, v in r["directions"].items()},
           "params": {k: r["params"][k] for k in ("total", "active")},
           "tau": recipe.simoe.tau if recipe.simoe is not None else None, **summary}
    save_scores(BENCH, label, seed, item_rouge(folder, label, *held_out(folder)), root, run)


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
            f"{s['peak_rss'] / 2**30:.2f} | {wall(s)} |")


def per_task(runs: dict[str, list[dict]]) -> list[str]:
    """ROUGE-L per task of each system, the mean over its committed runs (system -> its runs)."""
    tasks = list(next(iter(runs.values()))[0]["directions"])
    return ["| task | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs),
            *[f"| {t} | " + " | ".join(f"{np.mean([r['directions'][t]['rougeL'] for r in rs]):.1f}"
                                       for rs in runs.values()) + " |" for t in tasks]]


def masks(label: str, runs: list[dict]) -> str:
    """Fig. 4 (non-zero expert parameters by layer type and depth) and Fig. 5 (mask overlap) of a SIMoE system,
    each the mean over its committed runs."""
    nz = [r["nonzero"] for r in runs]

    def mean(key: str, k: str) -> float:
        return float(np.mean([n[key][k] for n in nz]))

    depths = sorted(nz[0]["by_depth"], key=int)
    return (f"{label}: non-zero expert parameters (Fig. 4, median gates) "
            + " · ".join(f"{k} {mean('by_type', k):.2f}" for k in nz[0]["by_type"])
            + f"; overall {np.mean([n['overall'] for n in nz]):.3f}; by depth "
            + " ".join(f"{mean('by_depth', d):.2f}" for d in depths)
            + f"; mean mask overlap between experts (Fig. 5) {np.mean([r['overlap'] for r in runs]):.3f}.\n")


def held_out(folder: Path) -> tuple[dict, list[str]]:
    """({task: test pairs}, unseen task names) of a system's run; every system shares them (same data overrides)."""
    from moekit.data.instruct import load_instruct_pairs
    from moekit.training.recipe import load_recipe

    data = load_recipe(folder / "recipe.yaml").data
    return load_instruct_pairs(data)[1], data.task_names()[1]


def item_rouge(folder: Path, label: str, test: dict, unseen: list[str]) -> dict[str, list[float]]:
    """{"seen"/"unseen": per-item ROUGE-L of one run's test outputs, tasks in order}; checked against the run's
    own task means (equal items per task, so the item mean is the unweighted task mean the table reports)."""
    from moekit.eval.instruct import rouge_l

    results = json.loads((folder / "results.json").read_text())
    scores = {"seen": [], "unseen": []}
    for task, pairs in test.items():
        hyps = results["translations"][task]
        scores["unseen" if task in unseen else "seen"] += [rouge_l([h], [p.tgt]) for h, p in zip(hyps, pairs)]
    for group, items in scores.items():
        if abs(sum(items) / len(items) - results["groups"][group]["rougeL"]) > 1e-6:
            raise ValueError(f"{label}: per-item ROUGE-L does not average to the run's {group} mean")
    return scores


def paired(scores: dict, labels: list[str], seeds: list[int], base: str = "full FT") -> list[str]:
    """Each system − `base` in ROUGE-L over the seeds both have committed: the mean over seeds × test items and its
    95 % t-interval (evidence.claim_interval, the claims tables' interval); `scores`: load_scores."""
    lines = [f"ROUGE-L difference to {base}, mean over seeds × test items and its 95 % t-interval (bench/evidence.py "
             "claim_interval, as in the claims table below):", "", "| system | seeds | seen | unseen |", "|---|---|---|---|"]
    for label in labels:
        both = [paired_items(scores, label, base, g, only=seeds) for g in ("seen", "unseen")]
        cells = [claim_interval(A, B) for _, A, B, _ in both]
        lines.append(f"| {label} | {len(both[0][0])} | "
                     + " | ".join(f"{c['mean']:+.1f} [{c['lo']:+.1f}, {c['hi']:+.1f}]" for c in cells) + " |")
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
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each one cached run per system (0: the recipes as they are); default 0")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.out, args.seeds[0])
    systems = args.systems or (COMMON_SYSTEMS if args.common else [s for s in SYSTEMS if s not in COMMON_SYSTEMS[:3]])
    mark = COMMON_MARK if args.common else MARK
    if not args.report_only:  # every system of one seed before the next seed
        for seed in args.seeds:
            for label in systems:
                keep(label, seed, args.out, run_system(label, args.out, seed), args.results)
    committed = load_runs(BENCH, args.results)
    summaries = {(n, s): committed[(n, s)] for s in args.seeds for n in systems if (n, s) in committed}
    runs: dict[str, list[dict]] = {}  # system -> its committed runs, in seed order
    for (n, _), r in summaries.items():
        runs.setdefault(n, []).append(r)
    seeds = sorted({s for _, s in summaries})
    over = f"mean over seeds {', '.join(map(str, seeds))}"
    cmd = (f".venv/bin/python bench/simoe_mini.py --out {args.out}" + (" --common" if args.common else "")
           + ("" if args.systems is None else " --systems " + " ".join(f"'{s}'" for s in args.systems))
           + ("" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}")
           + (f" --write {args.write}" if args.write else ""))
    missing = [label_of(n, s) for s in args.seeds for n in systems if (n, s) not in summaries]
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
        f"`{cmd}` — {measured_on(summaries.values())}, fp32. Overrides on every recipe: "
        f"`{' '.join(OVERRIDES)}`. Seen = held-out verses of the 5 trained tasks, unseen = 4 tasks of untrained "
        "categories (reverse translation, book name, paraphrase); unweighted means over tasks." + common + status, "",
        "| system | seen ROUGE-L | seen chrF | unseen ROUGE-L | unseen chrF | final mask sparsity (τ = 0.75) | λ max / "
        "final | total params | active params | pruned export | peak RSS (GiB) | wall (min) |", "|---" * 12 + "|",
        *[row(label_of(n, s), r) for (n, s), r in summaries.items()], "",
        *([f"ROUGE-L per task ({over}):", "", *per_task(runs), ""] if runs else []),
        *(paired(load_scores(BENCH, args.results), [n for n in runs if n != "full FT"], seeds)
          if args.common and "full FT" in runs else []),
        *[masks(f"{label} ({over})", rs) for label, rs in runs.items() if "nonzero" in rs[0]],
        *(committed_claims(BENCH, CLAIMS_INTRO, args.results) if args.common else []), "",
        mark[1]])
    print(section)
    if args.write:
        write_section(args.write, section, mark)


if __name__ == "__main__":
    main()
