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
"""
from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import numpy as np

from claim_specs import specs  # bench/claim_specs.py
from report import VERDICT_RULE, log_progress, cached, claims_table, claim_interval, corpus, seed_folder, write_section  # bench/report.py

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
        return {"loss": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]}

    return cached(folder, go)


def label(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name} (seed {seed})"


def row(name: str, seed: int, out: Path, s: dict) -> str:
    r = json.loads((seed_folder(out, name, seed) / "results.json").read_text())
    langs = " / ".join(f"{lang} {100 * v['wer']:.1f}" for lang, v in r["languages"].items())
    cer = " / ".join(f"{lang} {100 * v['cer']:.1f}" for lang, v in r["languages"].items())
    last = np.mean([v for _, v in s["loss"][-3:]])
    rt = r.get("routing")
    routing = "– | – | – | – | – | – | –" if rt is None else (
        f"{np.nanmean(rt['cramers_v']):.2f} | {np.mean(rt['usage_entropy']):.2f} | {np.mean(rt['token_entropy']):.2f} | "
        f"{rt['wer_change']['0.1']:+.1f} | {rt['wer_change']['0.5']:+.1f} | "
        f"{rt['permutation']['deltas']['0.1']:+.3f} | {rt['permutation']['deltas']['0.5']:+.3f}")
    p = r["params"]
    return (f"| {label(name, seed)} | {100 * r['avg']['wer']:.1f} | {langs} | {100 * r['avg']['cer']:.1f} | {cer} | {last:.3f} | "
            f"{routing} | {p['total'] / 1e6:.2f}M | {p['active'] / 1e6:.2f}M | {s['seconds'] / 60:.1f} |")


def curves(out: Path, summaries: dict) -> list[str]:
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
    """Per test utterance (languages in order): 'wer', 'cer' and, as weights that make the weighted mean the
    unweighted mean over languages of each language's corpus rate (the table's "avg"), 'w_words', 'w_chars'."""
    from moekit.speech.text import error_rates

    r = json.loads((folder / "results.json").read_text())
    rows = {k: [] for k in ("wer", "cer", "w_words", "w_chars")}
    for lang, items in r["transcripts"].items():
        er = [error_rates([t["ref"]], [t["hyp"]], lang) for t in items]
        words, chars = sum(max(e["words"], 1) for e in er), sum(max(e["chars"], 1) for e in er)
        for e in er:
            rows["wer"].append(e["wer"])
            rows["cer"].append(e["cer"])
            rows["w_words"].append(max(e["words"], 1) / words)
            rows["w_chars"].append(max(e["chars"], 1) / chars)
    return {k: np.array(v) for k, v in rows.items()}


def claims(out: Path, done: set[tuple[str, int]], experts: int = 4) -> list[str]:
    """The claims (claim_specs.SPECS) at `experts` experts over the seeds where both systems finished, one verdict each, on CER (WER, the
    paper's metric, is near 100 % for every system here, so it is reported beside the table, not judged): paired
    interval over seeds × test utterances (evidence.claim_interval), verdict by VERDICT_RULE."""
    rows, wer, levels = [], [], []
    for claim in specs("omni_ctc", experts):
        a, b = claim.a, claim.b
        seeds = sorted(s for n, s in done if n == a and (b, s) in done)
        if not seeds:
            continue
        A = [utterance_errors(seed_folder(out, a, s)) for s in seeds]
        B = [utterance_errors(seed_folder(out, b, s)) for s in seeds]
        stat = {key: claim_interval(100 * np.stack([x[key] for x in A]), 100 * np.stack([x[key] for x in B]),
                                    np.stack([x[w] for x in A]))
                for key, w in (("cer", "w_chars"), ("wer", "w_words"))}
        rows.append({"claim": claim, "seeds": seeds, "stat": stat["cer"]})
        w = stat["wer"]
        wer.append(f"{a} − {b} {w['mean']:+.1f} [{w['lo']:+.1f}, {w['hi']:+.1f}]")
        levels += w["a"] + w["b"]  # each system's WER per seed
    if not rows:
        return []
    return ["Headline claims over seeds (Omni-router Tables 1-2: the paper reports lower WER for A). One verdict per "
            f"claim, on CER: WER, the paper's metric, is {min(levels):.1f}-{max(levels):.1f} % for every system and seed "
            f"here, so it cannot rank them (Δ WER in points, same interval: {'; '.join(wer)}). CER is the mean over languages of the "
            "language's corpus rate; Δ = A − B in points. " + VERDICT_RULE, "", *claims_table(rows, nd=1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/omni_ctc"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each one cached run per system (0: the recipes as they are); default 0")
    ap.add_argument("--claims-experts", type=int, default=4, choices=(2, 4, 8),
                    help="expert count of the Switch/Omni-router pair the claims compare (default 4)")
    ap.add_argument("--report-only", action="store_true", help="report the (system, seed) runs finished so far, run nothing")
    args = ap.parse_args()
    log_progress()
    corpus_dir = corpus(args.out / "corpus", **CORPUS)
    if args.report_only:
        summaries = {(n, s): json.loads((seed_folder(args.out, n, s) / "summary.json").read_text())
                     for s in args.seeds for n in args.systems if (seed_folder(args.out, n, s) / "summary.json").is_file()}
    else:  # every system of one seed before the next seed
        summaries = {(n, s): run_system(n, args.out, corpus_dir, args.steps, s) for s in args.seeds for n in args.systems}
    missing = [label(n, s) for s in args.seeds for n in args.systems if (n, s) not in summaries]
    status = f" **Incomplete run: {', '.join(missing)} not finished yet.**" if missing else ""
    info = json.loads((corpus_dir / "corpus.json").read_text())
    cmd = (f".venv/bin/python bench/omni_ctc.py --out {args.out} --steps {args.steps} --systems {' '.join(args.systems)}"
           + ("" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}")
           + (f" --write {args.write}" if args.write else ""))
    lines = [MARK[0], "## Omni-router in miniature: dense vs Switch vs Omni-router CTC (bench/omni_ctc.py)", "",
             f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores. Corpus: espeak-ng, {', '.join(LANGS)}; "
             f"{CORPUS['train_per_lang']} training utterances per language by {CORPUS['voices']} voices, "
             f"{CORPUS['test_per_lang']} held-out texts per language by a held-out voice "
             f"({info['hours']:.2f} h in all). Every system: recipes/asr/*_ctc.yaml (6 layers, d=144, FFN 576, "
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
             "|---" * 16 + "|", *[row(n, seed, args.out, s) for (n, seed), s in summaries.items()], "",
             "Training loss (CTC per target character, mean of the logged values) by fifth of training:", "",
             *curves(args.out, summaries), "", *claims(args.out, set(summaries), args.claims_experts), "", MARK[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
