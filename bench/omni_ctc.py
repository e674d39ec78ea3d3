"""Omni-router Tables 1-2 in miniature: dense vs Switch vs Omni-router CTC encoders with 2, 4 and 8 experts,
trained from scratch on synthesized multilingual speech (espeak-ng; en, fr, de, sw) for the same number of
steps; WER/CER per language on held-out voices and texts, training-loss curves, adjacent-layer Cramér's V,
per-token routing entropy (Fig. 5) and the expert-permutation test (Fig. 6: relative WER change). Each system is recipes/asr/{dense,switch,omni}_ctc.yaml
with the overrides below; finished systems are cached (summary.json), so an interrupted run resumes.

    .venv/bin/python bench/omni_ctc.py --out runs/omni_ctc --write BENCHMARKS.md [--systems dense switch-4 omni-4]

Seeds (`--seeds 0 1 2`): seed n sets `train.seed=n` (the CTC model's initialization and the Trainer's seed),
`data.seed=n` (training order and SpecAugment draws) and, for MoE systems, `moe.seed=n` (expert and router
initialization); seed 0 adds no override (today's configuration). The corpus and its test utterances are
the same for every seed. Each (system, seed) is its own cached, resumable run (report.seed_folder); the
report gives each claim of claim_specs.SPECS an interval (evidence.claim_interval) over seeds × test utterances and a verdict.

Each finished run's per-utterance CER and WER (in %, with the weights that make their weighted mean the table's
average) and the numbers of its table row are committed under bench/results/omni_ctc/seed{n}/<system>.json
(evidence.save_scores; no weights, no transcripts), and the report is made from those files alone: `--report-only`
rebuilds the section from a clone, and bench/claims.py its claims table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from claim_specs import WEIGHTS  # bench/claim_specs.py
from claims import committed_claims, committed_rows  # bench/claims.py
from evidence import RESULTS, Claim, claim_rows, load_runs, load_scores, save_scores  # bench/evidence.py
from report import (cached, corpus, device_name, log_progress, measured_on, seed_folder, wall, wall_of,  # bench/report.py
                    write_section)

LANGS = ["en", "fr", "de", "sw"]
CORPUS = dict(langs=LANGS, voices=4, test_voices=1, train_per_lang=500, test_per_lang=40, max_chars=120, seed=0)
SYSTEMS = {"dense": ("dense_ctc", None), **{f"switch-{e}": ("switch_ctc", e) for e in (2, 4, 8)},
           **{f"omni-{e}": ("omni_ctc", e) for e in (2, 4, 8)}}
# Omni-router's headline claims (Tables 1-2: lower WER than Switch and than dense), as paired comparisons of
# CER (WER is near 100 % for every system at this scale) and WER: (A, B, claim); the paper reports A < B.
MARK = ("<!-- omni_ctc -->", "<!-- /omni_ctc -->")


def overrides(out: Path, corpus_dir: Path, experts: int | None, steps: int, seed: int = 0) -> list[str]:
    keys = {"out": str(out), "data.corpus": str(corpus_dir), "data.langs": LANGS, "train.steps": steps,
            "train.eval_every": steps // 5, "train.logging_steps": max(1, min(10, steps // 10)), "train.save_every": steps // 2,
            "eval.routing_batches": 2}
    if experts is not None:
        keys["moe.num_experts"] = experts
    if seed != 0:  # seed 0: the recipes as they are
        keys.update({"train.seed": seed, "data.seed": seed, **({"moe.seed": seed} if experts is not None else {})})
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def run_system(name: str, out: Path, corpus_dir: Path, steps: int, seed: int = 0) -> dict:
    from moekit.training.asr import train_asr
    from moekit.training.recipe import load_recipe

    recipe_name, experts = SYSTEMS[name]
    folder = seed_folder(out, name, seed)

    def go() -> dict:
        recipe = load_recipe(Path("recipes/asr") / f"{recipe_name}.yaml", overrides(folder, corpus_dir, experts, steps, seed))
        trainer = train_asr(recipe, overwrite=True, resume=True)  # from the last checkpoint if any
        return {"loss": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h],
                "device": device_name()}

    return cached(folder, go)


def label(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name} (seed {seed})"


def row(name: str, seed: int, r: dict) -> str:
    """The table's row of one committed run (keep)."""
    langs = " / ".join(f"{lang} {100 * v['wer']:.1f}" for lang, v in r["languages"].items())
    cer = " / ".join(f"{lang} {100 * v['cer']:.1f}" for lang, v in r["languages"].items())
    last = np.mean([v for _, v in r["loss"][-3:]])
    rt = r.get("routing")
    routing = "– | – | – | – | – | – | –" if rt is None else (
        f"{np.nanmean(rt['cramers_v']):.2f} | {np.mean(rt['usage_entropy']):.2f} | {np.mean(rt['token_entropy']):.2f} | "
        f"{rt['wer_change']['0.1']:+.1f} | {rt['wer_change']['0.5']:+.1f} | "
        f"{rt['permutation']['deltas']['0.1']:+.3f} | {rt['permutation']['deltas']['0.5']:+.3f}")
    p = r["params"]
    return (f"| {label(name, seed)} | {100 * r['avg']['wer']:.1f} | {langs} | {100 * r['avg']['cer']:.1f} | {cer} | {last:.3f} | "
            f"{routing} | {p['total'] / 1e6:.2f}M | {p['active'] / 1e6:.2f}M | {wall(r)} |")


def curves(summaries: dict) -> list[str]:
    """Training loss (mean of the logged values in each fifth of training) per system."""
    steps = max(st for s in summaries.values() for st, _ in s["loss"])
    edges = np.linspace(0, steps, 6)
    head = " | ".join(f"≤{int(e)}" for e in edges[1:])
    lines = [f"| system | {head} |", "|---" * 6 + "|"]
    for (name, seed), s in summaries.items():
        loss = np.array(s["loss"])
        means = [loss[(loss[:, 0] > a) & (loss[:, 0] <= b), 1].mean() for a, b in zip(edges[:-1], edges[1:])]
        lines.append(f"| {label(name, seed)} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return lines


def utterance_errors(folder: Path) -> dict[str, np.ndarray]:
    """Per test utterance (languages in order), in %: 'cer', 'wer' and, as weights that make the weighted mean the
    unweighted mean over languages of each language's corpus rate (the table's "avg"), 'cer weight', 'wer weight'."""
    from moekit.speech.text import error_rates

    r = json.loads((folder / "results.json").read_text())
    rows = {k: [] for k in ("cer", "wer", "cer weight", "wer weight")}
    for lang, items in r["transcripts"].items():
        er = [error_rates([t["ref"]], [t["hyp"]], lang) for t in items]
        words, chars = sum(max(e["words"], 1) for e in er), sum(max(e["chars"], 1) for e in er)
        for e in er:
            rows["wer"].append(100 * e["wer"])
            rows["cer"].append(100 * e["cer"])
            rows["wer weight"].append(max(e["words"], 1) / words)
            rows["cer weight"].append(max(e["chars"], 1) / chars)
    return {k: np.array(v) for k, v in rows.items()}


ROUTING = ("cramers_v", "usage_entropy", "token_entropy", "wer_change")  # what a row reports of results["routing"]


def keep(name: str, seed: int, out: Path, summary: dict, hours: float, root: Path = RESULTS) -> None:
    """Commit one finished run under root/omni_ctc/: its per-utterance errors and its row's numbers."""
    folder = seed_folder(out, name, seed)
    r = json.loads((folder / "results.json").read_text())
    rt = r.get("routing")
    routing = None if rt is None else {**{k: rt[k] for k in ROUTING},
                                       "permutation": {"deltas": rt["permutation"]["deltas"]}}
    run = {"languages": {lang: {k: v[k] for k in ("wer", "cer")} for lang, v in r["languages"].items()},
           "avg": {k: r["avg"][k] for k in ("wer", "cer")}, "routing": routing,
           "params": {k: r["params"][k] for k in ("total", "active")}, "loss": summary["loss"],
           **wall_of(summary), "device": summary.get("device"), "corpus_hours": hours}
    save_scores("omni_ctc", name, seed, utterance_errors(folder), root, run)


def claims(root: Path = RESULTS) -> list[str]:
    """The claims (claim_specs.SPECS) from every committed seed, one verdict each, on CER (WER, the paper's metric, is
    near 100 % for every system here, so it is reported beside the table, not judged): paired interval over seeds ×
    test utterances (evidence.claim_interval), verdict by VERDICT_RULE."""
    on_wer = [Claim(**{**r["claim"].__dict__, "key": "wer", "metric": "WER %"}) for r in committed_rows("omni_ctc", root)]
    if not on_wer:
        return []
    rows = claim_rows(on_wer, load_scores("omni_ctc", root), WEIGHTS["omni_ctc"])
    wer = "; ".join(f"{r['claim'].a} − {r['claim'].b} {r['stat']['mean']:+.1f} [{r['stat']['lo']:+.1f}, "
                    f"{r['stat']['hi']:+.1f}]" for r in rows)
    levels = [x for r in rows for x in r["stat"]["a"] + r["stat"]["b"]]  # each system's WER per seed
    return committed_claims("omni_ctc", "Headline claims over seeds (Omni-router Tables 1-2: the paper reports lower WER "
                            f"for A). One verdict per claim, on CER: WER, the paper's metric, is {min(levels):.1f}-"
                            f"{max(levels):.1f} % for every system and seed here, so it cannot rank them (Δ WER in "
                            f"points, same interval: {wer}). CER is the mean over languages of the language's corpus "
                            "rate; Δ = A − B in points.", root)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/omni_ctc"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each one cached run per system (0: the recipes as they are); default 0")
    ap.add_argument("--report-only", action="store_true",
                    help="report the (system, seed) runs committed under --results, run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished run's per-utterance scores and row are committed, and reported from")
    args = ap.parse_args(argv)
    log_progress()
    if not args.report_only:  # every system of one seed before the next seed
        corpus_dir = corpus(args.out / "corpus", **CORPUS)
        hours = json.loads((corpus_dir / "corpus.json").read_text())["hours"]
        for s in args.seeds:
            for n in args.systems:
                keep(n, s, args.out, run_system(n, args.out, corpus_dir, args.steps, s), hours, args.results)
    committed = load_runs("omni_ctc", args.results)
    summaries = {(n, s): committed[(n, s)] for s in args.seeds for n in args.systems if (n, s) in committed}
    missing = [label(n, s) for s in args.seeds for n in args.systems if (n, s) not in summaries]
    status = f" **Incomplete run: {', '.join(missing)} not finished yet.**" if missing else ""
    hours = max((r["corpus_hours"] for r in summaries.values()), default=float("nan"))
    cmd = (f".venv/bin/python bench/omni_ctc.py --out {args.out} --steps {args.steps} --systems {' '.join(args.systems)}"
           + ("" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}")
           + (f" --write {args.write}" if args.write else ""))
    lines = [MARK[0], "## Omni-router in miniature: dense vs Switch vs Omni-router CTC (bench/omni_ctc.py)", "",
             f"`{cmd}` — {measured_on(summaries.values())}. Corpus: espeak-ng, {', '.join(LANGS)}; "
             f"{CORPUS['train_per_lang']} training utterances per language by {CORPUS['voices']} voices, "
             f"{CORPUS['test_per_lang']} held-out texts per language by a held-out voice "
             f"({hours:.2f} h in all). Every system: recipes/asr/*_ctc.yaml (6 layers, d=144, FFN 576, "
             f"frames stacked ×4), {args.steps} steps of 16 utterances, §5.3's recipe: AdamW 1e-3 (wd 0.01), warm-up + "
             f"cosine (no final ×0.5 step decay), clipping 0.1, SpecAugment 2×F30 + 10×T50 (≤ 0.1); MoE on every layer, top-1, load balance of "
             f"eqs. 3.3-3.5 summed over layers (weight 0.09 = §5.3's 10 / 112 characters per utterance: the paper states no CTC reduction, we assume a sum per utterance and use a mean per target character); characters as outputs, where §5.2 has 8k word pieces. Fig. 5 entropy: mean over "
             f"layers of the per-token routing entropy of the 100 most frequent tokens (frames labelled by the best "
             f"path, blanks out); Fig. 6: relative WER change (%) with each frame's expert replaced at random with "
             f"probability p, on the first 2 eval batches (32 utterances) per language. Seed n > 0 adds "
             f"`train.seed=n data.seed=n moe.seed=n` (same corpus and test utterances).{status}", "",
             "| system | WER avg | WER per language | CER avg | CER per language | final train loss | Cramér's V "
             "(adjacent, mean) | usage entropy (mean) | token entropy (Fig. 5) | ΔWER % p=0.1 (Fig. 6) | ΔWER % p=0.5 | "
             "Δloss perm p=0.1 | Δloss perm p=0.5 | params | active | wall (min) |",
             "|---" * 16 + "|", *[row(n, seed, r) for (n, seed), r in summaries.items()], "",
             "Training loss (CTC per target character, mean of the logged values) by fifth of training:", "",
             *(curves(summaries) if summaries else []), "", *claims(args.results), "", MARK[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
