"""SPRI Table 2 in miniature with real weights, in its own modality (speech -> text): a speech-LLM assembled from
shipped real parts the way Qwen2-Audio / Qwen3-ASR are built (the `whisper-base-smollm2-135m` asset: Whisper base's
encoder, a new linear adapter, SmolLM2-135M-Instruct; moekit.speech.assemble), its adapter trained first on
synthesized English ASR (stage 0), then fine-tuned En->fr/de/es/sw on synthesized English speech of Bible verses by
every system of Table 2 with the same steps, optimizer and data; BLEU and chrF per direction on held-out verses
spoken by held-out voices; SPRI's three headline claims with a Student-t interval over seeds.

    .venv/bin/python bench/spri_s2tt.py --seeds 0 1 2 3 4 --write BENCHMARKS.md   # runs what is missing, reports
    .venv/bin/python bench/spri_s2tt.py --seeds 0 1 2 3 4 --report-only --write BENCHMARKS.md

Resumable: the corpus, stage 0 and every (seed, system) run are cached (summary.json written after results.json),
and a killed run resumes from its last checkpoint. Each run lives in OUT/seed{n}/{system}/; its small result files
are copied to bench/results/spri_s2tt/ (no weights), from which --report-only also reports, so the table
regenerates from a clone. Every system is recipes/spri_s2tt.yaml with SHARED and its own overrides (SYSTEMS);
deviations from the paper's setting are the recipe's own plus those named in SHARED's comments.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
from datetime import date
from pathlib import Path

from evidence import VERDICT_RULE, Claim, claims_table, seed_interval  # bench/evidence.py
from report import cached, corpus, device_name, log_progress, measured_on, write_section  # bench/report.py

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
UPCYCLING_BASELINES = ("naive", "noise", "drop")
# stage 0: the adapter alone learns English ASR (transcripts of the same training verses); WER before and after
STAGE0 = ["method=dense", "moe=null", "freeze.schedule=none", "model.freeze_audio=false",
          "freeze.frozen=[model.audio_tower, model.language_model, lm_head]", "data.directions=[en]",
          f"data.transcripts_from={DIRECTIONS[0]}", "optim.lr=1e-3", "train.batch_size=8", "train.grad_accum=1",
          "train.logging_steps=5", "train.eval_every=0", "train.save_total_limit=1", "eval.batch_size=16",
          "eval.max_new_tokens=64", "eval.loss_per_direction=16"]
RESULTS = Path("bench/results")  # small per-run files, committed: RESULTS/<name of --out>/...
MARK = ("<!-- spri_s2tt -->", "<!-- /spri_s2tt -->")


def precision() -> list[str]:
    import torch

    return ["train.precision=bf16" if torch.cuda.is_available() else "train.precision=fp32"]


def run(name: str, folder: Path, overrides: list[str], keep: Path, steps: int) -> dict:
    """One `moekit train` of recipes/spri_s2tt.yaml with `overrides` and `steps` into `folder`, cached by its
    summary.json (a cached run of other steps stops the bench: another configuration belongs in another --out) and
    resumed from its last checkpoint if it was killed; the small result files are copied to `keep` (no weights)."""
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
    keep.mkdir(parents=True, exist_ok=True)
    for f in ("recipe.yaml", "results.json", "data.json", "log_history.json", "summary.json"):
        if (folder / f).is_file():
            shutil.copy2(folder / f, keep / f)
    return summary


def saves(steps: int) -> int:
    """Checkpoint interval: four per run from 100 steps on (a killed run resumes), none below (it starts over)."""
    return steps // 4 if steps >= 100 else 0


def stage0(out: Path, data: Path, steps: int, test: list[str]) -> Path:
    """The adapter trained on English ASR; its WER before (0 steps) and after. Returns the trained model folder."""
    common = [f"model.path={MODEL}", f"data.path={data}", f"data.clips={data / 'audio' / 'en'}", *STAGE0, *test]
    for name, n, extra in (("stage0_untrained", 1, ["optim.lr=1e-12"]),  # WER before: one step moving nothing
                           ("stage0", steps, [])):
        run("stage0", out / name, [*common, *extra], results(out) / name, n)
    return out / "stage0" / "model"


def systems(out: Path, data: Path, model: Path, seeds: list[int], steps: int, only: list[str], test: list[str]
            ) -> None:
    common = [f"model.path={model}", f"data.path={data}", f"data.clips={data / 'audio' / 'en'}", *SHARED, *test]
    for seed in seeds:  # every system of one seed before the next seed
        for name in only:
            extra = SYSTEMS[name]
            seeded = [f"train.seed={seed}", *([] if name == "dense_ft" else [f"moe.seed={seed}"])] if seed else []
            run(name, out / f"seed{seed}" / name, [*common, *extra, *seeded], results(out) / f"seed{seed}" / name,
                steps)


# ------------------------------------------------------------------------------------------------------ report


def results(out: Path) -> Path:
    return RESULTS / out.name


def finished(out: Path, seeds: list[int]) -> dict[tuple[str, int], tuple[dict, dict]]:
    """(system, seed) -> (results, summary) of every finished run kept in results(out)."""
    runs = {}
    for seed in seeds:
        for name in SYSTEMS:
            folder = results(out) / f"seed{seed}" / name
            if (folder / "summary.json").is_file() and (folder / "results.json").is_file():
                runs[(name, seed)] = tuple(json.loads((folder / f).read_text()) for f in ("results.json", "summary.json"))
    return runs


def fmt(x, nd=1) -> str:
    return "–" if not isinstance(x, (int, float)) else f"{x:.{nd}f}"


def table(runs: dict) -> list[str]:
    head = ["| system | seed | BLEU avg | chrF avg | BLEU " + " / ".join(DIRECTIONS) + " | chrF " + " / ".join(DIRECTIONS)
            + " | target loss avg | total / active params | steps | wall (min) |", "|---" * 10 + "|"]
    rows = []
    for (name, seed), (r, s) in runs.items():
        per = {k: " / ".join(fmt(r["directions"][d].get(k)) for d in DIRECTIONS) for k in ("bleu", "chrf")}
        rows.append(f"| {name} | {seed} | {fmt(r['avg'].get('bleu'), 2)} | {fmt(r['avg'].get('chrf'), 2)} | "
                    f"{per['bleu']} | {per['chrf']} | {fmt(r['avg'].get('loss'), 3)} | "
                    f"{r['params']['total'] / 1e6:.1f} M / {r['params']['active'] / 1e6:.1f} M | {s.get('steps', '–')} | "
                    f"{s['seconds'] / 60:.1f} |")
    return [*head, *rows]


def claims(runs: dict, seeds: list[int]) -> list[str]:
    """SPRI's three headline claims on chrF and BLEU averaged over the directions: per seed the difference of the two
    systems' averages, a t-interval over the seeds where both finished (bench/evidence.py seed_interval: these runs
    keep corpus-level scores only, so the test items' variance is not in it)."""
    def avg(name, seed, metric):
        return runs[(name, seed)][0]["avg"][metric]

    both = lambda a, b: [s for s in seeds if (a, s) in runs and (b, s) in runs]  # noqa: E731
    done = [b for b in UPCYCLING_BASELINES if both(b, "spri_two_stage")]
    best = max(done, key=lambda b: statistics.mean(avg(b, s, "chrf") for s in both(b, "spri_two_stage")),
               default=None)
    wanted = [("spri_two_stage", "dense_ft", "SPRI beats dense fine-tuning"),
              *([("spri_two_stage", best, f"SPRI beats the best upcycling baseline ({best}, by mean chrF)")]
                if best else []),
              ("spri_two_stage", "spri", "two-stage training beats one-stage")]
    rows = []
    for a, b, text in wanted:
        for metric in ("chrf", "bleu"):
            s = both(a, b)
            if len(s) < 2:
                continue
            sa, sb = [avg(a, x, metric) for x in s], [avg(b, x, metric) for x in s]
            stat = {**seed_interval([x - y for x, y in zip(sa, sb)]), "a": sa, "b": sb,
                    "per_seed": [x - y for x, y in zip(sa, sb)]}
            rows.append({"claim": Claim(text, a, b, metric, f"{metric} avg over {len(DIRECTIONS)} directions", 1),
                         "seeds": s, "stat": stat})
    if not rows:
        return ["No claim has both of its systems finished on two seeds or more yet (a t-interval needs two; the "
                "evidence rule asks for five)."]
    return ["Headline claims (SPRI §4 / Table 2: the paper reports A > B in each), over the seeds named in each row: "
            "Δ = A − B of the corpus-level score averaged over the directions, per seed; its mean over seeds and a "
            "95 % t-interval over the seeds (bench/evidence.py seed_interval). The best upcycling baseline is chosen "
            f"on the same test sets. {VERDICT_RULE}", "", *claims_table(rows)]


def stage0_lines(out: Path) -> list[str]:
    lines = []
    for name, when in (("stage0_untrained", "before"), ("stage0", "after")):
        folder = results(out) / name
        if (folder / "summary.json").is_file():
            r, s = (json.loads((folder / f).read_text()) for f in ("results.json", "summary.json"))
            en = r["directions"]["en"]
            lines.append(f"| {when} | {s.get('steps', '–')} | {fmt(en.get('wer'), 3)} | {fmt(en.get('cer'), 3)} | "
                       f"{fmt(en.get('loss'), 3)} | {s['seconds'] / 60:.1f} |")
    return ["| adapter | steps | WER | CER | target loss | wall (min) |", "|---" * 6 + "|", *lines] if lines else \
        ["Stage 0 has not finished yet."]


def report(out: Path, seeds: list[int], cmd: str, hours: str) -> str:
    runs = finished(out, seeds)
    missing = [f"{n} (seed {s})" for s in seeds for n in SYSTEMS if (n, s) not in runs]
    status = f" **Not finished: {', '.join(missing)}.**" if missing else ""
    summaries = [s for _, s in runs.values()]
    return "\n".join([
        MARK[0], "## SPRI Table 2 in miniature with real weights: speech translation (bench/spri_s2tt.py)", "",
        f"`{cmd}` — {date.today()}, measured on {measured_on(summaries) if summaries else 'nothing yet'}. Model: "
        f"`{MODEL}` (Whisper base encoder + linear adapter + SmolLM2-135M-Instruct as transformers' "
        f"Qwen2AudioForConditionalGeneration). Corpus: `{CORPUS}` ({hours}). Every system: `{RECIPE}` with "
        f"`{' '.join(SHARED)}` and its own overrides (bench/spri_s2tt.py SYSTEMS); seed n > 0 adds `train.seed=n` "
        f"and, for MoE systems, `moe.seed=n`. Wall times were taken while other jobs shared the machine.{status}", "",
        "Stage 0, the adapter alone on English ASR of the training verses (WER on the held-out verses and voice):", "",
        *stage0_lines(out), "", *table(runs), "", *claims(runs, seeds), "", MARK[1]])


def speech_hours(data: Path) -> str:
    rows = [json.loads(line) for line in (data / "manifest.jsonl").read_text().splitlines()]
    split = {k: sum(r.get("seconds", 0) for r in rows if r.get("split") == k) / 3600 for k in ("train", "test")}
    return f"{split['train']:.2f} h of training speech, {split['test']:.2f} h of test speech"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/spri_s2tt"))
    ap.add_argument("--corpus", type=Path, default=Path("runs/spri_s2tt/corpus"),
                    help="the speech corpus, built there if missing (default: runs/spri_s2tt/corpus)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="default: 0 1 2 3 4")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of every system (default: 300)")
    ap.add_argument("--stage0-steps", type=int, default=600, help="adapter steps on English ASR (default: 600)")
    ap.add_argument("--test-per-direction", type=int, help="test verses per direction (default: all, 48)")
    ap.add_argument("--only", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS), metavar="SYSTEM",
                    help=f"train only these systems (default: all of {', '.join(SYSTEMS)})")
    ap.add_argument("--stage0-only", action="store_true", help="build the corpus and train stage 0, nothing else")
    ap.add_argument("--report-only", action="store_true", help="report the finished runs, train nothing")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section in this file (BENCHMARKS.md)")
    args = ap.parse_args()
    log_progress()
    data = args.corpus
    test = [f"data.test_per_direction={args.test_per_direction}"] if args.test_per_direction else []
    if not args.report_only:
        corpus(data, **CORPUS)
        model = stage0(args.out, data, args.stage0_steps, test)
        if not args.stage0_only:
            systems(args.out, data, model, args.seeds, args.steps, args.only, test)
    cmd = (f".venv/bin/python bench/spri_s2tt.py --out {args.out} --corpus {args.corpus} --seeds {' '.join(map(str, args.seeds))} "
           f"--steps {args.steps} --stage0-steps {args.stage0_steps}"
           + (f" --test-per-direction {args.test_per_direction}" if args.test_per_direction else "")
           + (f" --only {' '.join(args.only)}" if args.only != list(SYSTEMS) else "")
           + (f" --write {args.write}" if args.write else ""))
    hours = speech_hours(data) if (data / "manifest.jsonl").is_file() else "corpus not on this machine"
    section = report(args.out, args.seeds, cmd, hours)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
