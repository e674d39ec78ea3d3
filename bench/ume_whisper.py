"""UME Tables I-III in miniature: the real pretrained Whisper tiny.en adapted to synthesized English speech
(espeak-ng, 4 training voices) for the same number of steps — pretrained baseline, FMFT (full fine-tuning),
UME (8 dense-copied experts, renormalized top-2, only MoE layers train, α = 0.01), UME without freezing and
UME without balancing. WER on held-out texts spoken by held-out espeak-ng voices (in-domain) and by flite
voices, a family never used in training (forgetting check); parameters and real-time factor. Each system is
a recipe of recipes/asr/ with the overrides below; finished systems are cached (summary.json).

    .venv/bin/python bench/ume_whisper.py --out runs/ume_whisper --write BENCHMARKS.md

Seeds (`--seeds 0 1 2`): seed n sets `train.seed=n` (the Trainer's seed), `data.seed=n` (training order and
SpecAugment draws) and, for UME, `moe.seed=n` (router initialization); seed 0 adds no override (today's
configuration); the pretrained model is evaluated once (seed 0), being the same for every seed, and the rows no
claim compares (the ablations w/o freezing / balancing, the scratch baselines) run once, at seed 0. The corpus
and its test utterances are the same for every seed. Each (system, seed) is its own cached, resumable run
(report.seed_folder); the report gives each claim of claim_specs.SPECS an interval (evidence.claim_interval) over seeds × test utterances
and a verdict (report.VERDICT_RULE):

    .venv/bin/python bench/ume_whisper.py --out runs/ume_whisper --seeds 0 1 2

Each finished run's per-utterance WER per voice family (in %, with its reference words) and the numbers of its table
row are committed under bench/results/<section>/seed{n}/<system>.json (evidence.save_scores; <section>: ume_whisper, or
ume_whisper_scratch for a run with a scratch system; no weights, no transcripts), and the report is made from those
files alone: `--report-only` rebuilds the section from a clone, and bench/claims.py its claims table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from claim_specs import specs  # bench/claim_specs.py
from claims import committed_claims  # bench/claims.py
from evidence import RESULTS, load_runs, save_scores  # bench/evidence.py
from report import (cached, corpus, device_name, log_progress, measured_on, seed_folder, wall, wall_of,  # bench/report.py
                    write_section)

CORPUS = dict(langs=["en"], voices=4, test_voices=2, train_per_lang=640, test_per_lang=48, max_chars=120,
              flite_test=True, seed=0)
SYSTEMS = {"pretrained": None, "fmft": "fmft_whisper_tiny", "ume": "ume_whisper_tiny",
           "ume w/o freezing": "ume_whisper_tiny_nofreeze", "ume w/o balancing": "ume_whisper_tiny_nobalance"}
# UME Table I's scratch-trained baselines (C2: a dense model of the MoE's total size, C3: the MoE itself, both
# from random initialization), in miniature (issue 30): Whisper tiny.en's architecture with transformers' random
# init (no pretrained weight), trained in full for the same steps and data. scratch dense: encoder/decoder FFN
# widened 8× (1536 -> 12288) to UME's total parameters; scratch MoE: UME's architecture (8 experts, renormalized
# top-2, balance α = 0.01) with freshly drawn experts (init scratch) and nothing frozen.
SCRATCH = {"scratch dense": ("fmft_whisper_tiny", {"ffn": 8}, {}),
           "scratch MoE": ("ume_whisper_tiny_nofreeze", {"ffn": 1},
                                                {"moe.init": {"method": "scratch"}, "moe.router.scoring": "topk_softmax"})}
SYSTEMS.update({name: recipe for name, (recipe, _, _) in SCRATCH.items()})
# UME's headline claims (Table I-II: lower error rates than FMFT; §IV-D / Table III: less forgetting), as
# paired WER comparisons on the in-domain and the unseen voice family: (A, B, family, claim); the paper
# reports A < B.
MARK = ("<!-- ume_whisper -->", "<!-- /ume_whisper -->")
EXTRA_MARK = ("<!-- ume_whisper_scratch -->", "<!-- /ume_whisper_scratch -->")  # runs with a SCRATCH system
BENCHES = {MARK: "ume_whisper", EXTRA_MARK: "ume_whisper_scratch"}  # bench/results/<…>
FAMILIES = ("espeak-ng", "flite")


def scratch_whisper(out: Path, ffn_factor: int, seed: int = 0) -> Path:
    """Whisper tiny.en's architecture (FFN widths × ffn_factor) with transformers' random init, saved once
    beside the pretrained model's tokenizer, feature extractor and generation files."""
    import shutil

    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from moekit.assets import resolve_model

    folder = out / f"scratch_whisper_ffn{ffn_factor}_seed{seed}"
    if (folder / "done").is_file():
        return folder
    src = resolve_model("whisper-tiny.en")
    cfg = WhisperConfig.from_pretrained(src)
    cfg.encoder_ffn_dim *= ffn_factor
    cfg.decoder_ffn_dim *= ffn_factor
    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    WhisperForConditionalGeneration(cfg).save_pretrained(folder)
    for f in src.iterdir():  # tokenizer, feature extractor, generation config: everything but the weights
        if f.is_file() and f.suffix not in (".safetensors", ".bin") and not f.name.endswith(".index.json") \
                and f.name != "config.json":
            shutil.copy2(f, folder / f.name)
    (folder / "done").write_text("")
    return folder


def recipe_for(name: str, folder: Path, corpus_dir: Path, steps: int, seed: int = 0):
    from moekit.training.recipe import load_recipe

    keys = {"out": str(folder), "data.corpus": str(corpus_dir), "train.steps": steps, "train.eval_every": steps // 4,
            "train.logging_steps": max(1, min(5, steps // 10)), "train.save_every": steps // 2, "eval.routing_batches": 2}
    if seed != 0:  # seed 0: the recipes as they are
        keys.update({"train.seed": seed, "data.seed": seed, **({"moe.seed": seed} if is_moe(name) else {})})
    if name in SCRATCH:
        _, arch, extra = SCRATCH[name]
        keys.update({"model.path": str(scratch_whisper(folder.parent, arch["ffn"], seed)), **extra})
    return load_recipe(Path("recipes/asr") / f"{SYSTEMS[name] or 'fmft_whisper_tiny'}.yaml",
                       [f"{k}={json.dumps(v)}" for k, v in keys.items()])


def is_moe(name: str) -> bool:
    return (SYSTEMS[name] or "").startswith("ume")


def default_systems() -> list[str]:
    return [n for n in SYSTEMS if n not in SCRATCH]


def folder_of(out: Path, name: str, seed: int = 0) -> Path:
    return seed_folder(out, name.replace(" ", "_").replace("/", ""), seed)


def run_system(name: str, out: Path, corpus_dir: Path, steps: int, seed: int = 0) -> dict:
    from moekit.speech.data import load_split
    from moekit.training.asr import build, report, train_asr

    folder = folder_of(out, name, seed)
    recipe = recipe_for(name, folder, corpus_dir, steps, seed)

    def go() -> dict:
        if SYSTEMS[name] is None:  # the pretrained model, evaluated as it is
            train, test = load_split(recipe.data)
            model, speech = build(recipe, train)
            folder.mkdir(parents=True, exist_ok=True)
            report(recipe, model, speech, test, [])
            loss = []
        else:
            trainer = train_asr(recipe, overwrite=True, resume=True)  # from the last checkpoint if any
            loss = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
        return {"loss": loss, "device": device_name()}

    return {**cached(folder, go), "folder": str(folder)}


def utterance_wer(folder: Path, family: dict[str, str], name: str):
    """(per-utterance WER, reference words) of one run's test utterances by voices of the family `name`
    (`family`: utterance id -> voice family); the words-weighted mean is the family's corpus WER (the
    table's column)."""
    import numpy as np

    from moekit.speech.text import error_rates

    r = json.loads((folder / "results.json").read_text())
    er = [error_rates([t["ref"]], [t["hyp"]], lang) for lang, items in r["transcripts"].items() for t in items
          if family[t["id"]] == name]
    return np.array([e["wer"] for e in er]), np.array([max(e["words"], 1) for e in er], float)


def keep(name: str, seed: int, out: Path, corpus_dir: Path, summary: dict, bench: str, root: Path = RESULTS) -> None:
    """Commit one finished run under root/<bench>/: per voice family, its per-utterance WER in % ("wer <family>") and
    reference words ("words <family>"), and its row's numbers."""
    from moekit.speech.corpus import read_manifest

    folder = folder_of(out, name, seed)
    family = {u.id: u.family for u in read_manifest(corpus_dir)}
    scores = {}
    for fam in FAMILIES:
        wer, words = utterance_wer(folder, family, fam)
        scores[f"wer {fam}"], scores[f"words {fam}"] = 100 * wer, words
    r = json.loads((folder / "results.json").read_text())
    run = {"families": {fam: {k: r["families"][fam][k] for k in ("wer", "cer")} for fam in FAMILIES},
           "params": {k: r["params"][k] for k in ("total", "active")}, "rtf": r["rtf"],
           "loss": summary["loss"][-1:], **wall_of(summary), "device": summary.get("device"),
           "corpus_hours": json.loads((corpus_dir / "corpus.json").read_text())["hours"]}
    save_scores(bench, name, seed, scores, root, run)


CLAIMS_INTRO = ("Headline claims over seeds (UME Tables I-III: the paper reports lower error rates for A). Metric: WER of "
                "the voice family (corpus rate: per-utterance WER weighted by reference words); Δ = A − B in points.")


def row(name: str, seed: int, r: dict) -> str:
    """The table's row of one committed run (keep)."""
    fam, p = r["families"], r["params"]
    loss = f"{r['loss'][-1][1]:.3f}" if r["loss"] else "–"
    return (f"| {name if seed == 0 else f'{name} (seed {seed})'} | {100 * fam['espeak-ng']['wer']:.1f} | {100 * fam['flite']['wer']:.1f} | "
            f"{100 * fam['espeak-ng']['cer']:.1f} | {100 * fam['flite']['cer']:.1f} | {loss} | {p['total'] / 1e6:.1f}M | "
            f"{p['active'] / 1e6:.1f}M | {r['rtf']:.3f} | {wall(r)} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/ume_whisper"))
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=default_systems(),
                    help=f"default: {', '.join(default_systems())}; also {', '.join(SCRATCH)} (UME Table I's "
                         "scratch-trained baselines, issue 30)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each one cached run per trained system (0: the recipes as they are); default 0")
    ap.add_argument("--report-only", action="store_true",
                    help="report the (system, seed) runs committed under --results, run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished run's per-utterance scores and row are committed, and reported from")
    args = ap.parse_args(argv)
    log_progress()
    mark = EXTRA_MARK if any(n in SCRATCH for n in args.systems) else MARK  # its own section beside the main one
    bench = BENCHES[mark]
    # every system of one seed before the next seed; the pretrained model is the same for every seed, and the
    # rows no claim compares (ablations, scratch baselines) are single runs (seed 0)
    claimed = {n for c in specs("ume_whisper") for n in (c.a, c.b)}
    wanted = [(n, s) for s in args.seeds for n in args.systems if s == 0 or (SYSTEMS[n] and n in claimed)]
    if not args.report_only:
        corpus_dir = corpus(args.out / "corpus", **CORPUS)
        for n, s in wanted:
            keep(n, s, args.out, corpus_dir, run_system(n, args.out, corpus_dir, args.steps, s), bench, args.results)
    committed = load_runs(bench, args.results)
    summaries = {(n, s): committed[(n, s)] for n, s in wanted if (n, s) in committed}
    missing = [n if s == 0 else f"{n} (seed {s})" for n, s in wanted if (n, s) not in summaries]
    status = f" **Incomplete run: {', '.join(missing)} not finished yet.**" if missing else ""
    hours = max((r["corpus_hours"] for r in summaries.values()), default=float("nan"))
    cmd = (f".venv/bin/python bench/ume_whisper.py --out {args.out} --steps {args.steps}"
           + ("" if args.systems == default_systems() else " --systems " + " ".join(f"'{s}'" for s in args.systems))
           + ("" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}")
           + (f" --write {args.write}" if args.write else ""))
    title = ("UME Table I's scratch-trained baselines in miniature (issue 30)" if mark == EXTRA_MARK
             else "UME on Whisper tiny.en in miniature")
    lines = [mark[0], f"## {title} (bench/ume_whisper.py)", "",
             f"`{cmd}` — {measured_on(summaries.values())}. Whisper tiny.en (real, converted from its "
             f"CTranslate2 package). Training: {CORPUS['train_per_lang']} English utterances (Bible verses of ≤ "
             f"{CORPUS['max_chars']} characters) by {CORPUS['voices']} espeak-ng voices; {args.steps} steps of 8, "
             f"AdamW 1e-4, linear schedule, 10 % warm-up. Test: {CORPUS['test_per_lang']} held-out verses spoken by "
             f"{CORPUS['test_voices']} held-out espeak-ng voice{'s' if CORPUS['test_voices'] > 1 else ''} (in-domain) and by the 4 flite voices (never seen "
             f"in training: the forgetting check); {hours:.2f} h of audio in all. WER/CER after Whisper's "
             "English normalizer; RTF = decoding time / audio time (greedy, batch 8). Seed n > 0 adds "
             f"`train.seed=n data.seed=n` and, for UME, `moe.seed=n` (same corpus and test utterances); rows no claim "
             "compares (ablations, scratch baselines) are single runs at seed 0."
             + (" Scratch rows (UME Table I's C2/C3 in miniature): Whisper tiny.en's architecture with transformers' "
                "random init, every parameter trained, same data, steps and optimizer; scratch dense has 8× wider FFNs "
                "(UME's total parameters), scratch MoE is UME's architecture with freshly drawn experts."
                if any(n in SCRATCH for n, _ in summaries) else "") + status, "",
             "| system | WER espeak (in-domain) | WER flite (unseen family) | CER espeak | CER flite | final train loss "
             "| params | active | RTF | wall (min) |", "|---" * 10 + "|",
             *[row(n, seed, r) for (n, seed), r in summaries.items()], "",
             *(committed_claims(bench, CLAIMS_INTRO, args.results) if mark == MARK else []), "", mark[1]]
    section = "\n".join(lines)
    print(section)
    if args.write:
        write_section(args.write, section, mark)


if __name__ == "__main__":
    main()
