"""UME Tables I-III in miniature: the real pretrained Whisper tiny.en adapted to synthesized English speech
(espeak-ng, 4 training voices) for the same number of steps — pretrained baseline, FMFT (full fine-tuning),
UME (8 dense-copied experts, renormalized top-2, only MoE layers train, α = 0.01), UME without freezing and
UME without balancing. WER on held-out texts spoken by held-out espeak-ng voices (in-domain) and by flite
voices, a family never used in training (forgetting check); parameters and real-time factor. Each system is
a recipe of recipes/asr/ with the overrides below; finished systems are cached (summary.json).

    .venv/bin/python bench/ume_whisper.py --out runs/ume_whisper --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

from report import cached, corpus, write_section  # bench/report.py

CORPUS = dict(langs=["en"], voices=4, test_voices=2, train_per_lang=640, test_per_lang=48, max_chars=120,
              flite_test=True, seed=0)
SYSTEMS = {"pretrained": None, "fmft": "fmft_whisper_tiny", "ume": "ume_whisper_tiny",
           "ume w/o freezing": "ume_whisper_tiny_nofreeze", "ume w/o balancing": "ume_whisper_tiny_nobalance"}
MARK = ("<!-- ume_whisper -->", "<!-- /ume_whisper -->")


def recipe_for(name: str, folder: Path, corpus_dir: Path, steps: int):
    from moekit.train.recipe import load_recipe

    keys = {"out": str(folder), "data.corpus": str(corpus_dir), "train.steps": steps, "train.eval_every": steps // 4,
            "train.logging_steps": max(1, min(5, steps // 10)), "train.save_every": steps // 2, "eval.routing_batches": 2}
    return load_recipe(Path("recipes/asr") / f"{SYSTEMS[name] or 'fmft_whisper_tiny'}.yaml",
                       [f"{k}={json.dumps(v)}" for k, v in keys.items()])


def run_system(name: str, out: Path, corpus_dir: Path, steps: int) -> dict:
    from moekit.speech.data import load_split
    from moekit.train.asr import build, report, train_asr

    folder = out / name.replace(" ", "_").replace("/", "")
    recipe = recipe_for(name, folder, corpus_dir, steps)

    def go() -> dict:
        if SYSTEMS[name] is None:  # the pretrained model, evaluated as it is
            train, test = load_split(recipe.data)
            model, speech = build(recipe, train)
            folder.mkdir(parents=True, exist_ok=True)
            report(recipe, model, speech, test, [])
            return {"loss": []}
        trainer = train_asr(recipe, overwrite=True, resume=True)  # from the last checkpoint if any
        return {"loss": [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]}

    return {**cached(folder, go), "folder": str(folder)}


def row(name: str, s: dict) -> str:
    r = json.loads((Path(s["folder"]) / "results.json").read_text())
    fam, p = r["families"], r["params"]
    loss = f"{s['loss'][-1][1]:.3f}" if s["loss"] else "–"
    return (f"| {name} | {100 * fam['espeak-ng']['wer']:.1f} | {100 * fam['flite']['wer']:.1f} | "
            f"{100 * fam['espeak-ng']['cer']:.1f} | {100 * fam['flite']['cer']:.1f} | {loss} | {p['total'] / 1e6:.1f}M | "
            f"{p['active'] / 1e6:.1f}M | {r['rtf']:.3f} | {s['seconds'] / 60:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/ume_whisper"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    corpus_dir = corpus(args.out / "corpus", **CORPUS)
    summaries = {name: run_system(name, args.out, corpus_dir, args.steps) for name in SYSTEMS}
    info = json.loads((corpus_dir / "corpus.json").read_text())
    cmd = f".venv/bin/python bench/ume_whisper.py --out {args.out} --steps {args.steps}" + (
        f" --write {args.write}" if args.write else "")
    lines = [MARK[0], "## UME on Whisper tiny.en in miniature (bench/ume_whisper.py)", "",
             f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores. Whisper tiny.en (real, converted from its "
             f"CTranslate2 package). Training: {CORPUS['train_per_lang']} English utterances (Bible verses of ≤ "
             f"{CORPUS['max_chars']} characters) by {CORPUS['voices']} espeak-ng voices; {args.steps} steps of 8, "
             f"AdamW 1e-4, linear schedule, 10 % warm-up. Test: {CORPUS['test_per_lang']} held-out verses spoken by "
             f"{CORPUS['test_voices']} held-out espeak-ng voice{'s' if CORPUS['test_voices'] > 1 else ''} (in-domain) and by the 4 flite voices (never seen "
             f"in training: the forgetting check); {info['hours']:.2f} h of audio in all. WER/CER after Whisper's "
             "English normalizer; RTF = decoding time / audio time (greedy, batch 8, 2 cores).", "",
             "| system | WER espeak (in-domain) | WER flite (unseen family) | CER espeak | CER flite | final train loss "
             "| params | active | RTF | wall (min) |", "|---" * 10 + "|", *[row(n, s) for n, s in summaries.items()],
             "", MARK[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
