"""SPRI Table 2 in miniature with real weights, in its own modality (speech -> text): a speech-LLM assembled from
shipped real parts the way Qwen2-Audio / Qwen3-ASR are built (the `whisper-base-smollm2-135m` asset: Whisper base's
encoder, a new linear adapter, SmolLM2-135M-Instruct; moekit.speech.assemble), its adapter trained first on
synthesized English ASR (stage 0), then fine-tuned En->fr/de/es/sw on synthesized English speech of Bible verses by
every system of Table 2 with the same steps, optimizer and data; BLEU and chrF per direction on held-out verses
spoken by held-out voices; SPRI's three headline claims (claim_specs.SPECS["spri_s2tt"]) with an interval over seeds
× test items and a verdict.

    .venv/bin/python bench/spri_s2tt.py --seeds 0 1 2 3 4 --write BENCHMARKS.md   # runs what is missing, reports
    .venv/bin/python bench/spri_s2tt.py --seeds 0 1 2 3 4 --report-only --write BENCHMARKS.md

Resumable: the corpus, stage 0 and every (seed, system) run are cached (summary.json written after results.json),
and a killed run resumes from its last checkpoint. Each run lives in OUT/seed{n}/{system}/. Each finished run's
per-item scores (sentence BLEU and chrF of every test verse of every direction, from the evaluation's "per_item";
stage 0: WER and CER, committed as seed 0) and the numbers of its table row are committed under
bench/results/spri_s2tt/seed{n}/<system>.json (evidence.save_scores; no outputs, no weights), and the report is made
from those files alone: `--report-only` rebuilds the section from a clone, and bench/claims.py its claims table.
Every system is recipes/spri_s2tt.yaml with SHARED and its own overrides (SYSTEMS); deviations from the paper's
setting are the recipe's own plus those named in SHARED's comments.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from claim_specs import BEST  # bench/claim_specs.py
from claims import committed_claims  # bench/claims.py
from evidence import RESULTS, load_runs, save_scores  # bench/evidence.py
from report import cached, corpus, device_name, log_progress, measured_on, wall, write_section  # bench/report.py

RECIPE = Path("recipes/spri_s2tt.yaml")
MODEL = "whisper-base-smollm2-135m"
DIRECTIONS = ["fr", "de", "es", "sw"]  # Bible translations l, e, v, h: every verse in each (moekit.data.parallel)
# English speech of Bible verses: 4 training voices, 1 held-out test voice, held-out test verses; 120 characters at
# most (under 15 s of speech, the recipe's data.max_seconds and the model's audio window)
CORPUS = dict(langs=["en"], targets=DIRECTIONS, voices=4, test_voices=1, train_per_lang=800, test_per_lang=48,
              max_chars=120, seed=0)
SHARED = [
    f"data.directions=[{', '.join(DIRECTIONS)}]", "data.max_prompt_tokens=512",
    "model.freeze_audio=true",  # encoder and the stage-0 adapter frozen in every system: no backward through Whisper
    "train.batch_size=8", "train.grad_accum=1",  # the paper's global batch is 1024
    "optim.lr=1e-4",  # the paper's 2e-5 is for 4,240 steps at batch 1024; a few hundred small steps need more
    "train.logging_steps=5", "train.eval_every=0", "train.save_total_limit=1",
    "eval.batch_size=16", "eval.max_new_tokens=64", "eval.loss_per_direction=16",
]
UPCYCLED = ["moe.init.method=spri"]  # the recipe's SPRI init (rho 1e-3, delta 1e-12, down projections)
SYSTEMS = {  # name: overrides of recipes/spri_s2tt.yaml (two-stage SPRI as the recipe has it)
    "dense_ft": ["method=dense", "moe=null", "freeze.schedule=none"],
    "naive": ["moe.init={method: naive}", "freeze.schedule=none"],
    "noise": ["moe.init={method: noise, ratio: 0.5, std: 0.01}", "freeze.schedule=none"],
    "drop": ["moe.init={method: drop, ratio: 0.5}", "freeze.schedule=none"],
    "spri": ["freeze.schedule=none"],
    "spri_two_stage": [],
}
# stage 0: the adapter alone learns English ASR (transcripts of the same training verses); WER before and after
STAGE0 = ["method=dense", "moe=null", "freeze.schedule=none", "model.freeze_audio=false",
          "freeze.frozen=[model.audio_tower, model.language_model, lm_head]", "data.directions=[en]",
          f"data.transcripts_from={DIRECTIONS[0]}", "optim.lr=1e-3", "train.batch_size=8", "train.grad_accum=1",
          "train.logging_steps=5", "train.eval_every=0", "train.save_total_limit=1", "eval.batch_size=16",
          "eval.max_new_tokens=64", "eval.loss_per_direction=16"]
BENCH = "spri_s2tt"  # bench/results/spri_s2tt/
MARK = ("<!-- spri_s2tt -->", "<!-- /spri_s2tt -->")


def precision() -> list[str]:
    import torch

    return ["train.precision=bf16" if torch.cuda.is_available() else "train.precision=fp32"]


def run(name: str, folder: Path, overrides: list[str], steps: int) -> dict:
    """One `moekit train` of recipes/spri_s2tt.yaml with `overrides` and `steps` into `folder`, cached by its
    summary.json (a cached run of other steps stops the bench: another configuration belongs in another --out) and
    resumed from its last checkpoint if it was killed."""
    from moekit.config import load_yaml
    from moekit.training.recipe import SpeechLLMRecipe
    from moekit.training.run import train

    def go() -> dict:
        recipe = load_yaml(RECIPE, SpeechLLMRecipe, [*overrides, *precision(), f"train.steps={steps}",
                                                     f"train.save_every={saves(steps)}", f"name={name}", f"out={folder}"])
        trainer = train(recipe, overwrite=True, resume=True)
        return {"device": device_name(), "steps": trainer.state.global_step}

    summary = cached(folder, go)
    if summary["steps"] != steps:
        raise SystemExit(f"{folder} holds a finished run of {summary['steps']} steps, not {steps}: give this "
                         "configuration its own --out")
    return summary


def keep(name: str, seed: int, folder: Path, summary: dict, hours: dict, root: Path = RESULTS) -> None:
    """Commit one finished run under root/spri_s2tt/: its per-item scores (each metric of the evaluation's
    "per_item", the test rows of every direction in order: sentence BLEU and chrF; stage 0: WER and CER) and its
    row's numbers (with the corpus' `hours`)."""
    r = json.loads((folder / "results.json").read_text())
    per = r["per_item"]
    scores = {k: [x for d in per for x in per[d][k]] for k in next(iter(per.values()))}
    run = {"directions": {d: {k: v[k] for k in ("n", "bleu", "chrf", "wer", "cer", "loss") if k in v}
                          for d, v in r["directions"].items()},
           "avg": {k: r["avg"][k] for k in ("bleu", "chrf", "loss") if k in r["avg"]},
           "params": {k: r["params"][k] for k in ("total", "active")}, **summary, "hours": hours}
    save_scores(BENCH, name, seed, scores, root, run)


def saves(steps: int) -> int:
    """Checkpoint interval: four per run from 100 steps on (a killed run resumes), none below (it starts over)."""
    return steps // 4 if steps >= 100 else 0


def stage0(out: Path, data: Path, steps: int, test: list[str], root: Path, hours: dict) -> Path:
    """The adapter trained on English ASR; its WER before (0 steps) and after, each committed as seed 0. Returns the
    trained model folder."""
    common = [f"model.path={MODEL}", f"data.path={data}", f"data.clips={data / 'audio' / 'en'}", *STAGE0, *test]
    for name, n, extra in (("stage0_untrained", 1, ["optim.lr=1e-12"]),  # WER before: one step moving nothing
                           ("stage0", steps, [])):
        keep(name, 0, out / name, run("stage0", out / name, [*common, *extra], n), hours, root)
    return out / "stage0" / "model"


def systems(out: Path, data: Path, model: Path, seeds: list[int], steps: int, only: list[str], test: list[str],
            root: Path, hours: dict) -> None:
    common = [f"model.path={model}", f"data.path={data}", f"data.clips={data / 'audio' / 'en'}", *SHARED, *test]
    for seed in seeds:  # every system of one seed before the next seed
        for name in only:
            extra = SYSTEMS[name]
            seeded = [f"train.seed={seed}", *([] if name == "dense_ft" else [f"moe.seed={seed}"])] if seed else []
            folder = out / f"seed{seed}" / name
            keep(name, seed, folder, run(name, folder, [*common, *extra, *seeded], steps), hours, root)


# ------------------------------------------------------------------------------------------------------ report


def fmt(x, nd=1) -> str:
    return "–" if not isinstance(x, (int, float)) else f"{x:.{nd}f}"


def table(runs: dict) -> list[str]:
    """One row per committed (system, seed); `runs` maps (name, seed) to its committed values (keep)."""
    head = ["| system | seed | BLEU avg | chrF avg | BLEU " + " / ".join(DIRECTIONS) + " | chrF " + " / ".join(DIRECTIONS)
            + " | target loss avg | total / active params | steps | wall (min) |", "|---" * 10 + "|"]
    rows = []
    for (name, seed), r in runs.items():
        per = {k: " / ".join(fmt(r["directions"][d].get(k)) for d in DIRECTIONS) for k in ("bleu", "chrf")}
        rows.append(f"| {name} | {seed} | {fmt(r['avg'].get('bleu'), 2)} | {fmt(r['avg'].get('chrf'), 2)} | "
                    f"{per['bleu']} | {per['chrf']} | {fmt(r['avg'].get('loss'), 3)} | "
                    f"{r['params']['total'] / 1e6:.1f} M / {r['params']['active'] / 1e6:.1f} M | {r['steps']} | "
                    f"{wall(r)} |")
    return [*head, *rows]


CLAIMS_INTRO = ("Headline claims over seeds (SPRI §4 / Table 2: the paper reports A > B in each, in BLEU and COMET; "
                "COMET is not computed here). Metric: sacreBLEU's sentence BLEU and chrF of each test verse, averaged "
                f"over the test verses of the {len(DIRECTIONS)} directions; Δ = A − B. The best upcycling baseline is "
                f"the one of {', '.join(BEST[BENCH][1])} with the highest mean sentence chrF over its committed runs, "
                "chosen on the same test items.")


def stage0_lines(committed: dict) -> list[str]:
    lines = []
    for name, when in (("stage0_untrained", "before"), ("stage0", "after")):
        if (name, 0) in committed:
            r = committed[(name, 0)]
            en = r["directions"]["en"]
            lines.append(f"| {when} | {r['steps']} | {fmt(en.get('wer'), 3)} | {fmt(en.get('cer'), 3)} | "
                         f"{fmt(en.get('loss'), 3)} | {wall(r)} |")
    return ["| adapter | steps | WER | CER | target loss | wall (min) |", "|---" * 6 + "|", *lines] if lines else \
        ["Stage 0 has not finished yet."]


def report(root: Path, seeds: list[int], cmd: str) -> str:
    """The section, from the runs committed under root/spri_s2tt/ alone."""
    committed = load_runs(BENCH, root)
    runs = {(n, s): committed[(n, s)] for s in seeds for n in SYSTEMS if (n, s) in committed}
    missing = [f"{n} (seed {s})" for s in seeds for n in SYSTEMS if (n, s) not in runs]
    status = f" **Not finished: {', '.join(missing)}.**" if missing else ""
    h = next((r["hours"] for r in committed.values()), None)
    hours = f"{h['train']:.2f} h of training speech, {h['test']:.2f} h of test speech" if h else "no run committed yet"
    claims = committed_claims(BENCH, CLAIMS_INTRO, root) or ["No claim has both of its systems committed yet."]
    return "\n".join([
        MARK[0], "## SPRI Table 2 in miniature with real weights: speech translation (bench/spri_s2tt.py)", "",
        f"`{cmd}` — {measured_on(committed.values()) if committed else 'nothing measured yet'}. "
        f"Model: `{MODEL}` (Whisper base encoder + linear adapter + SmolLM2-135M-Instruct as transformers' "
        f"Qwen2AudioForConditionalGeneration). Corpus: `{CORPUS}` ({hours}). Every system: `{RECIPE}` with "
        f"`{' '.join(SHARED)}` and its own overrides (bench/spri_s2tt.py SYSTEMS); seed n > 0 adds `train.seed=n` "
        f"and, for MoE systems, `moe.seed=n`. Made from bench/results/{BENCH}/ alone.{status}", "",
        "Stage 0, the adapter alone on English ASR of the training verses (WER on the held-out verses and voice):", "",
        *stage0_lines(committed), "", *table(runs), "", *claims, "", MARK[1]])


def speech_hours(data: Path) -> dict[str, float]:
    """Hours of speech in the corpus' training and test splits."""
    rows = [json.loads(line) for line in (data / "manifest.jsonl").read_text().splitlines()]
    return {k: sum(r.get("seconds", 0) for r in rows if r.get("split") == k) / 3600 for k in ("train", "test")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/spri_s2tt"))
    ap.add_argument("--corpus", type=Path, default=Path("runs/spri_s2tt/corpus"),
                    help="the speech corpus, built there if missing (default: runs/spri_s2tt/corpus)")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished run's per-item scores and row are committed, and reported from")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="default: 0 1 2 3 4")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of every system (default: 300)")
    ap.add_argument("--stage0-steps", type=int, default=600, help="adapter steps on English ASR (default: 600)")
    ap.add_argument("--test-per-direction", type=int, help="test verses per direction (default: all, 48)")
    ap.add_argument("--only", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS), metavar="SYSTEM",
                    help=f"train only these systems (default: all of {', '.join(SYSTEMS)})")
    ap.add_argument("--stage0-only", action="store_true", help="build the corpus and train stage 0, nothing else")
    ap.add_argument("--report-only", action="store_true",
                    help="report the runs committed under --results, train nothing")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section in this file (BENCHMARKS.md)")
    args = ap.parse_args(argv)
    log_progress()
    data = args.corpus
    test = [f"data.test_per_direction={args.test_per_direction}"] if args.test_per_direction else []
    if not args.report_only:
        hours = speech_hours(corpus(data, **CORPUS))
        model = stage0(args.out, data, args.stage0_steps, test, args.results, hours)
        if not args.stage0_only:
            systems(args.out, data, model, args.seeds, args.steps, args.only, test, args.results, hours)
    cmd = (f".venv/bin/python bench/spri_s2tt.py --out {args.out} --corpus {args.corpus} --seeds {' '.join(map(str, args.seeds))} "
           f"--steps {args.steps} --stage0-steps {args.stage0_steps}"
           + (f" --test-per-direction {args.test_per_direction}" if args.test_per_direction else "")
           + (f" --only {' '.join(args.only)}" if args.only != list(SYSTEMS) else "")
           + (f" --write {args.write}" if args.write else ""))
    section = report(args.results, args.seeds, cmd)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
