"""Omni-router Tables 1-2 in miniature: dense vs Switch vs Omni-router CTC encoders with 2, 4 and 8 experts,
trained from scratch on synthesized multilingual speech (espeak-ng; en, fr, de, sw) for the same number of
steps; WER/CER per language on held-out voices and texts, training-loss curves, adjacent-layer Cramér's V,
per-token routing entropy (Fig. 5) and the expert-permutation test (Fig. 6: relative WER change). Each system is recipes/asr/{dense,switch,omni}_ctc.yaml
with the overrides below; finished systems are cached (summary.json), so an interrupted run resumes.

    .venv/bin/python bench/omni_ctc.py --out runs/omni_ctc --write BENCHMARKS.md [--systems dense switch-4 omni-4]
"""
from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import numpy as np

from report import cached, corpus, write_section  # bench/report.py

LANGS = ["en", "fr", "de", "sw"]
CORPUS = dict(langs=LANGS, voices=4, test_voices=1, train_per_lang=500, test_per_lang=40, max_chars=120, seed=0)
SYSTEMS = {"dense": ("dense_ctc", None), **{f"switch-{e}": ("switch_ctc", e) for e in (2, 4, 8)},
           **{f"omni-{e}": ("omni_ctc", e) for e in (2, 4, 8)}}
MARK = ("<!-- omni_ctc -->", "<!-- /omni_ctc -->")


def overrides(out: Path, corpus_dir: Path, experts: int | None, steps: int) -> list[str]:
    keys = {"out": str(out), "data.corpus": str(corpus_dir), "data.langs": LANGS, "train.steps": steps,
            "train.eval_every": steps // 5, "train.logging_steps": max(1, min(10, steps // 10)), "train.save_every": steps // 2,
            "eval.routing_batches": 2}
    if experts is not None:
        keys["moe.num_experts"] = experts
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


def run_system(name: str, out: Path, corpus_dir: Path, steps: int) -> dict:
    from moekit.train.asr import train_asr
    from moekit.train.recipe import load_recipe

    recipe_name, experts = SYSTEMS[name]
    folder = out / name

    def go() -> dict:
        recipe = load_recipe(Path("recipes/asr") / f"{recipe_name}.yaml", overrides(folder, corpus_dir, experts, steps))
        trainer = train_asr(recipe, overwrite=True, resume=True)  # from the last checkpoint if any
        return {"loss": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]}

    return cached(folder, go)


def row(name: str, out: Path, s: dict) -> str:
    r = json.loads((out / name / "results.json").read_text())
    langs = " / ".join(f"{lang} {100 * v['wer']:.1f}" for lang, v in r["languages"].items())
    cer = " / ".join(f"{lang} {100 * v['cer']:.1f}" for lang, v in r["languages"].items())
    last = np.mean([v for _, v in s["loss"][-3:]])
    rt = r.get("routing")
    routing = "– | – | – | – | – | – | –" if rt is None else (
        f"{np.nanmean(rt['cramers_v']):.2f} | {np.mean(rt['usage_entropy']):.2f} | {np.mean(rt['token_entropy']):.2f} | "
        f"{rt['wer_change']['0.1']:+.1f} | {rt['wer_change']['0.5']:+.1f} | "
        f"{rt['permutation']['deltas']['0.1']:+.3f} | {rt['permutation']['deltas']['0.5']:+.3f}")
    p = r["params"]
    return (f"| {name} | {100 * r['avg']['wer']:.1f} | {langs} | {100 * r['avg']['cer']:.1f} | {cer} | {last:.3f} | "
            f"{routing} | {p['total'] / 1e6:.2f}M | {p['active'] / 1e6:.2f}M | {s['seconds'] / 60:.1f} |")


def curves(out: Path, summaries: dict) -> list[str]:
    """Training loss (mean of the logged values in each fifth of training) per system."""
    steps = max(st for s in summaries.values() for st, _ in s["loss"])
    edges = np.linspace(0, steps, 6)
    head = " | ".join(f"≤{int(e)}" for e in edges[1:])
    lines = [f"| system | {head} |", "|---" * 6 + "|"]
    for name, s in summaries.items():
        loss = np.array(s["loss"])
        means = [loss[(loss[:, 0] > a) & (loss[:, 0] <= b), 1].mean() for a, b in zip(edges[:-1], edges[1:])]
        lines.append(f"| {name} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/omni_ctc"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    args = ap.parse_args()
    corpus_dir = corpus(args.out / "corpus", **CORPUS)
    summaries = {name: run_system(name, args.out, corpus_dir, args.steps) for name in args.systems}
    info = json.loads((corpus_dir / "corpus.json").read_text())
    cmd = (f".venv/bin/python bench/omni_ctc.py --out {args.out} --steps {args.steps} --systems {' '.join(args.systems)}"
           + (f" --write {args.write}" if args.write else ""))
    lines = [MARK[0], "## Omni-router in miniature: dense vs Switch vs Omni-router CTC (bench/omni_ctc.py)", "",
             f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores. Corpus: espeak-ng, {', '.join(LANGS)}; "
             f"{CORPUS['train_per_lang']} training utterances per language by {CORPUS['voices']} voices, "
             f"{CORPUS['test_per_lang']} held-out texts per language by a held-out voice "
             f"({info['hours']:.2f} h in all). Every system: recipes/asr/*_ctc.yaml (6 layers, d=144, FFN 576, "
             f"frames stacked ×4), {args.steps} steps of 16 utterances, §5.2's recipe: AdamW 1e-3 (wd 0.01), warm-up + "
             f"cosine, clipping 0.1, SpecAugment 2×F30 + 10×T50 (≤ 0.1); MoE on every layer, top-1, load balance of "
             f"eqs. 3.3-3.5 summed over layers (weight 0.09 for our per-character CTC mean). Fig. 5 entropy: mean over "
             f"layers of the per-token routing entropy of the 100 most frequent tokens (frames labelled by the best "
             f"path, blanks out); Fig. 6: relative WER change (%) with each frame's expert replaced at random with "
             f"probability p, on the first 2 eval batches (32 utterances) per language.", "",
             "| system | WER avg | WER per language | CER avg | CER per language | final train loss | Cramér's V "
             "(adjacent, mean) | usage entropy (mean) | token entropy (Fig. 5) | ΔWER % p=0.1 (Fig. 6) | ΔWER % p=0.5 | "
             "Δloss perm p=0.1 | Δloss perm p=0.5 | params | active | wall (min) |",
             "|---" * 16 + "|", *[row(n, args.out, s) for n, s in summaries.items()], "",
             "Training loss (CTC per target character, mean of the logged values) by fifth of training:", "",
             *curves(args.out, summaries), "", MARK[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
