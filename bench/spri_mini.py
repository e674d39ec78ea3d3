"""SPRI Table 2 in miniature: every system fine-tuned on the same data-constrained En->XX subset for
the same number of steps, then evaluated (BLEU/chrF per direction, KL to the dense model, diversity,
parameters, wall time; each run's summary records the device it computed on, and the table's header names
them). Each system is one recipe from recipes/ with the shared overrides below;
finished systems are cached (their summary.json), so an interrupted run resumes where it stopped.

    .venv/bin/python bench/spri_mini.py --out runs/spri_mini --write BENCHMARKS.md

Seeds (`--seeds 0 1 2`): seed n sets `train.seed=n` (the Trainer's seed and data order) and, for MoE recipes,
`moe.seed=n` (expert noise and router initialization); seed 0 adds no override (today's configuration).
The data split (`data.seed`) stays fixed, so every seed is scored on the same test verses. Each (system,
seed) is its own cached, resumable run (report.seed_folder), and the report gives each headline claim of
claim_specs.SPECS an interval over seeds × test verses and a verdict (report.VERDICT_RULE):

    .venv/bin/python bench/spri_mini.py --out runs/spri_mini --seeds 0 1 2 --only dense_ft naive spri spri_two_stage

Each finished run's per-verse sentence chrF and the numbers of its table row (no weights, no translations) are
committed under bench/results/<section>/seed{n}/<system>.json (evidence.save_scores; <section>: spri_mini,
spri_mini_ablations or spri_mini_issue30), and the report is made from those files alone: `--report-only`
rebuilds the section from a clone, and bench/claims.py rebuilds its claims table from the same files.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from claims import committed_claims  # bench/claims.py
from evidence import RESULTS, load_runs, load_scores, save_scores  # bench/evidence.py
from report import (cached, device_name, log_progress, measured_on, seed_folder, seed_overrides,  # bench/report.py
                    wall, write_section)

SYSTEMS = {name: (name, []) for name in
           ["dense_ft", "lora", "naive", "noise", "drop", "ume", "spri", "spri_two_stage"]}  # name: (recipe, overrides)
# SPRI Table 1's diversity magnitudes (bench/spri_calibration.py) as Table 2-style rows, and Table 3: the
# down-only noise / drop (gate/up copied) and "w/o shared expert" inside the SPRI framework (shared expert
# where it has one, two-stage training, A.3), paired against spri_two_stage. Balance loss averaged over layers
# as in the main table's run (aux.layer_reduction was "mean" then), so the rows compare with it.
TWO_STAGE = ["freeze.schedule=spri_two_stage", "freeze.tau=0.1"]
ABLATIONS = {name: (recipe, ["aux.layer_reduction=mean", *extra]) for name, recipe, extra in [
    ("spri_two_stage", "spri_two_stage", []), ("noise_down", "noise", ["moe.init.placement=down", *TWO_STAGE]),
    ("drop_down", "drop", ["moe.init.placement=down", *TWO_STAGE]), ("spri_no_shared", "spri_no_shared", []),
    ("noise_table1", "noise_table1", []), ("drop_table1", "drop_table1", [])]}
# Issue 30, on the current code (balance loss summed over layers, as the recipes have it): SPRI Table 2's BTX
# row, Table 3's "Copy" row (routed down projections copied: naive copies with the shared expert and two-stage
# training, A.3), "w/o shared expert" at equal active parameters (9 routed, top-3, spri_no_shared_top3.yaml),
# SPRI with Table 1's diversity (ε ≈ 0.44 × the residual's rms, spri_table1.yaml), and the main table's noise,
# drop and UME rows rerun (they ran when the balance loss was α/L per layer). Paired against dense_ft and
# spri_two_stage of the same code (--reference-from copies the seeds run's seed-0 ones, else they run here).
EXTRA = {name: (recipe, extra) for name, recipe, extra in [
    ("spri_no_shared_top3", "spri_no_shared_top3", []), ("copy_down", "naive", TWO_STAGE), ("btx", "btx", []),
    ("spri_table1", "spri_table1", []), ("noise", "noise", []), ("drop", "drop", []), ("ume", "ume", [])]}
REFERENCES = ("dense_ft", "spri_two_stage")  # the rows --extra is paired against
BRANCH_STEPS = 30  # a BTX branch: one epoch over its direction's 240 pairs, batch 8
# sized for about 2 hours on 2 cores (8 systems): 4 directions, 2 low-resource (sw, tl); 120 steps of 8 = one
# epoch over 4 x 240 pairs; 32 test verses per direction
OVERRIDES = [
    "data.directions=[fr, de, sw, tl]", "data.train_per_direction=240", "data.test_per_direction=32",
    "data.max_length=96", "data.max_src_chars=160", "train.steps=120", "train.batch_size=8",
    "train.logging_steps=5", "train.eval_every=40", "train.save_every=40", "eval.kl_examples=32",
    "eval.max_new_tokens=48", "eval.batch_size=8",
]
# SPRI's headline claims (§4, Table 2), each a paired comparison of sentence chrF (higher is better):
# (A, B, claim); the paper reports A > B for each
MARK = ("<!-- spri_mini -->", "<!-- /spri_mini -->")
ABLATION_MARK = ("<!-- spri_mini_ablations -->", "<!-- /spri_mini_ablations -->")
EXTRA_MARK = ("<!-- spri_mini_issue30 -->", "<!-- /spri_mini_issue30 -->")
BENCHES = {MARK: "spri_mini", ABLATION_MARK: "spri_mini_ablations", EXTRA_MARK: "spri_mini_issue30"}  # bench/results/<…>


def directions() -> list[str]:
    return next(o for o in OVERRIDES if o.startswith("data.directions=")).split("=", 1)[1].strip("[]").split(", ")


def btx_branches(out: Path) -> tuple[list[str], float]:
    """BTX step 1: one dense branch per direction (dense_ft.yaml on that direction only, BRANCH_STEPS steps,
    no generation), each cached; returns the branches' model folders, one per direction, and the seconds
    spent on branches not cached before."""
    from moekit.config import load_yaml
    from moekit.training.recipe import TranslationRecipe
    from moekit.training.run import train

    paths, seconds = [], 0.0
    for d in directions():
        folder = out / "btx_branches" / d
        if not ((folder / "done").is_file() and (folder / "model").is_dir()):  # a branch whose model went is retrained
            t0 = time.perf_counter()
            recipe = load_yaml(Path("recipes/dense_ft.yaml"), TranslationRecipe,
                               [*OVERRIDES, f"data.directions=[{d}]", f"train.steps={BRANCH_STEPS}", "train.eval_every=0",
                                f"train.save_every={BRANCH_STEPS // 2}", "eval.generate=false", "eval.kl_examples=0",
                                f"name=btx_branch_{d}", f"out={folder}"])
            train(recipe, overwrite=True, resume=True)
            (folder / "done").write_text("")
            seconds += time.perf_counter() - t0
        paths.append(str(folder / "model"))
    return paths, seconds


def adopt_references(out: Path, source: Path) -> None:
    """Copy REFERENCES' seed-0 runs (their small result files) from another output folder of this benchmark
    (e.g. the seeds run), so --extra pairs against them without training them again."""
    import shutil

    for name in REFERENCES:
        src, dst = source / name, out / name
        if (src / "summary.json").is_file() and not (dst / "summary.json").is_file():
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("recipe.yaml", "results.json", "log_history.json", "summary.json"):  # summary last
                if (src / f).is_file():
                    shutil.copy2(src / f, dst / f)


def run_system(name: str, recipe_name: str, extra: list[str], out: Path, seed: int = 0) -> dict:
    from moekit.config import load_yaml
    from moekit.training.recipe import TranslationRecipe
    from moekit.training.run import train

    folder = seed_folder(out, name, seed)
    branch_seconds = 0.0
    if recipe_name == "btx" and not (folder / "summary.json").is_file():
        branches, branch_seconds = btx_branches(out)
        E = 8  # recipes/btx.yaml: branch d of D directions gives experts d·E/D .. (d+1)·E/D − 1 (pairs for D = 4)
        extra = [*extra, f"moe.init.branches={json.dumps([branches[i * len(branches) // E] for i in range(E)])}"]

    def go() -> dict:
        recipe = load_yaml(Path("recipes") / f"{recipe_name}.yaml", TranslationRecipe,
                           [*OVERRIDES, *extra, *seed_overrides(Path("recipes") / f"{recipe_name}.yaml", seed),
                            f"out={folder}"])
        trainer = train(recipe, overwrite=True, resume=True)  # resume from the last checkpoint if any, else start over
        kls = [h["eval_kl"] for h in trainer.state.log_history if "eval_kl" in h]
        return {"mean_kl": statistics.mean(kls) if kls else None, "device": device_name(),
                **({"branch_seconds": branch_seconds} if recipe_name == "btx" else {})}

    return cached(folder, go)


def fmt(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def label(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name} (seed {seed})"


def table(runs: dict) -> list[str]:
    """One row per committed (system, seed); `runs` maps (name, seed) to its committed values (keep)."""
    rows = []
    for (name, seed), r in runs.items():
        per_dir = {key: " / ".join(f"{lang} {fmt(v[key], 1)}" for lang, v in r["directions"].items())
                   for key in ("bleu", "chrf")}
        p = r["params"]
        rows.append(f"| {label(name, seed)} | {fmt(r['avg']['bleu'])} | {fmt(r['avg']['chrf'])} | {per_dir['bleu']} | "
                    f"{per_dir['chrf']} | {fmt(r['avg']['loss'], 3)} | {fmt(r['kl'], 4)} | "
                    f"{fmt(r['mean_kl'], 4)} | {fmt(r.get('diversity_init'), 3)} → {fmt(r['diversity'], 3)} | {p['total']:,} | "
                    f"{p['active']:,} | {wall(r)} |")
    return ["| system | BLEU avg | chrF avg | BLEU per direction | chrF per direction | target loss avg | final KL "
            "| mean KL | diversity init → trained | total params | active params | wall (min) |", "|---" * 12 + "|", *rows]


def references(name: str, out: Path, seed: int = 0) -> dict[str, list[str]]:
    """The test references of a system's run (same verses for every system and seed)."""
    from moekit.data.parallel import load_pairs
    from moekit.training.recipe import load_recipe

    recipe = load_recipe(seed_folder(out, name, seed) / "recipe.yaml")
    return {lang: [p.tgt for p in pairs] for lang, pairs in load_pairs(recipe.data)[1].items()}


def sentence_chrf(out: Path, name: str, seed: int, refs: dict[str, list[str]]):
    """(verses, directions) sentence chrF of one run's test translations."""
    import numpy as np
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    hyps = json.loads((seed_folder(out, name, seed) / "results.json").read_text())["translations"]
    return np.array([[chrf.sentence_score(h, [r]).score for h, r in zip(hyps[lang], refs[lang])]
                     for lang in refs]).T


def keep(out: Path, name: str, seed: int, summary: dict, bench: str, root: Path = RESULTS) -> None:
    """Commit a finished run under root/<bench>/: its per-verse sentence chrF (mean over the directions, "chrf", and
    per direction, "chrf <lang>") and its table row's numbers."""
    r = json.loads((seed_folder(out, name, seed) / "results.json").read_text())
    chrf = sentence_chrf(out, name, seed, references(name, out, seed))  # (verses, directions)
    run = {"avg": r["avg"],
           "directions": {lang: {k: v[k] for k in ("bleu", "chrf")} for lang, v in r["directions"].items()},
           "kl": r["kl"], "diversity_init": r.get("diversity_init"), "diversity": r["diversity"],
           "params": {k: r["params"][k] for k in ("total", "active")}, **summary}
    save_scores(bench, name, seed, {"chrf": chrf.mean(1), **{f"chrf {lang}": chrf[:, j] for j, lang in
                                                             enumerate(r["directions"])}}, root, run)


def paired(scores: dict, names: list[str], base: str = "dense_ft", resamples: int = 2000) -> list[str]:
    """Mean sentence chrF (seed 0) and its difference to `base`, with 95 % paired-bootstrap intervals over test
    verses (one resample of verse indices shared by all directions and systems)."""
    import numpy as np

    langs = [k.split(" ", 1)[1] for k in scores[(base, 0)] if k.startswith("chrf ")]
    per = lambda name: np.stack([scores[(name, 0)][f"chrf {lang}"] for lang in langs], 1)  # noqa: E731 (verses, directions)
    rng = np.random.default_rng(0)
    base_s = per(base)
    idx = rng.integers(0, len(base_s), (resamples, len(base_s)))
    rows = []
    for name in names:
        d = per(name) - base_s  # (verses, directions)
        boot = d.mean(1)[idx].mean(1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        row = " / ".join(f"{lang} {v:+.1f}" for lang, v in zip(langs, d.mean(0)))
        rows.append(f"| {name} | {per(name).mean():.2f} | {d.mean():+.2f} [{lo:+.2f}, {hi:+.2f}] | {row} |")
    return [f"Mean sentence chrF and its paired difference to {base} (95 % bootstrap interval over the test verses, "
            f"{resamples} resamples):", "", f"| system | sentence chrF | Δ vs {base} [95 % CI] | Δ per direction |",
            "|---|---|---|---|", *rows]


CLAIMS_INTRO = ("Headline claims over seeds (SPRI §4 / Table 2: the paper reports A > B in each). Metric: sentence chrF "
                "per test verse, averaged over the directions; Δ = A − B.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/spri_mini"))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--report-only", action="store_true",
                    help="report the runs committed under --results (with --only: of those systems), run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished run's per-verse scores and row are committed, and reported from")
    ap.add_argument("--ablations", action="store_true",
                    help=f"run {', '.join(ABLATIONS)} instead, into their own BENCHMARKS section "
                         "(paired against spri_two_stage)")
    ap.add_argument("--extra", action="store_true",
                    help=f"run the issue-30 rows {', '.join(EXTRA)} instead, into their own BENCHMARKS section "
                         f"(paired against {' and '.join(REFERENCES)}, which run too unless --reference-from has them)")
    ap.add_argument("--reference-from", type=Path, metavar="OUT",
                    help=f"with --extra: copy {' and '.join(REFERENCES)} (seed 0) from this benchmark's output folder OUT")
    ap.add_argument("--only", nargs="+", metavar="SYSTEM",
                    help="train only these systems (e.g. in a second process beside a running one); report all "
                         "(with --report-only: report only these, train nothing)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each one cached run per system (0: the recipes as they are); default 0")
    args = ap.parse_args(argv)
    log_progress()
    if args.ablations and args.extra:
        ap.error("--ablations and --extra are two sections: run them one at a time")
    systems, mark, base = ((ABLATIONS, ABLATION_MARK, "spri_two_stage") if args.ablations
                           else ({**{n: SYSTEMS[n] for n in REFERENCES}, **EXTRA}, EXTRA_MARK, "dense_ft") if args.extra
                           else (SYSTEMS, MARK, "dense_ft"))
    unknown = set(args.only or []) - set(systems)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(systems)}")
    bench = BENCHES[mark]
    if not args.report_only:  # every system of one seed before the next seed
        if args.extra and args.reference_from:
            adopt_references(args.out, args.reference_from)
        for seed in args.seeds:
            for name in args.only or systems:
                keep(args.out, name, seed, run_system(name, *systems[name], args.out, seed), bench, args.results)
    names = args.only if args.only and args.report_only else list(systems)  # --only trains these, reports all
    committed, scores = load_runs(bench, args.results), load_scores(bench, args.results)
    runs = {(n, s): committed[(n, s)] for s in args.seeds for n in names if (n, s) in committed}
    wanted = [(n, s) for s in args.seeds for n in (args.only or systems)]
    missing = [label(n, s) for n, s in wanted if (n, s) not in runs]
    seeds = "" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}"
    only = f" --only {' '.join(args.only)}" if args.only else ""
    cmd = (f".venv/bin/python bench/spri_mini.py --out {args.out}" + (" --ablations" if args.ablations else "")
           + (" --extra" + (f" --reference-from {args.reference_from}" if args.reference_from else "") if args.extra else "")
           + seeds + only + (f" --write {args.write}" if args.write else ""))
    status = f" **Incomplete run: {', '.join(missing)} not finished yet.**" if missing else ""
    title = ("SPRI Tables 1 and 3 rows in miniature" if args.ablations else
             "SPRI Tables 2 and 3: BTX, Copy, w/o shared expert at equal active parameters, Table 1's ε, reruns "
             "(issue 30)" if args.extra else "SPRI Table 2 in miniature")
    if args.extra:
        btx = runs.get(("btx", 0), {})
        status += (f" btx's wall time excludes its {len(directions())} branches ({BRANCH_STEPS} steps of dense_ft.yaml "
                   "on one direction each, no generation"
                   + (f"; {btx['branch_seconds'] / 60:.1f} min)." if btx.get("branch_seconds") else ").")
                   + (f" {' and '.join(REFERENCES)}: copied from {args.reference_from} (seed 0)." if args.reference_from
                      else ""))
    lines = [mark[0], f"## {title} (bench/spri_mini.py)", "",
             f"`{cmd}` — {measured_on(runs.values())}. Overrides on every recipe: "
             f"`{' '.join(OVERRIDES)}`" + (" and `aux.layer_reduction=mean`" if args.ablations else "")
             + f"; per-row overrides in the script; seed n > 0 adds `train.seed=n` and `moe.seed=n` (test "
             f"verses fixed).{status}", "", *table(runs), ""]
    seed0 = [n for n, s in runs if s == 0]
    blocks = [paired(scores, seed0, base) if (base, 0) in runs else [],
              paired(scores, seed0, "spri_two_stage") if args.extra and ("spri_two_stage", 0) in runs else [],
              [] if args.ablations or args.extra else committed_claims(bench, CLAIMS_INTRO, args.results)]
    lines += [line for block in blocks if block for line in [*block, ""]] + [mark[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, mark)


if __name__ == "__main__":
    main()
