"""Routing isolation + RISE in miniature: an MoE LM with learned routing on an imbalanced 8-language
Bible mix, its routing traces on identical held-out verses, and RISE / ESFT / top-K / random expert
selections for a low-resource target, each fine-tuned alone and pruned to check causality.

How the MoE model is made (stage 1, cached in OUT/base): SmolLM2-135M (moekit.assets) upcycled with
Drop-Upcycling, re-initialization ratio 0.2 (E=8, top-2, every 3rd block: 10 MoE layers, 80 experts), then only the MoE layers
(experts + routers, UME-style) trained as a causal LM for STAGE1_STEPS steps on 4 high-resource
languages (HIGH_N verses each) and 4 low-resource ones (LOW_N verses each), λ_lb = 1e-2, λ_z = 1e-3.
Stages 2-5 start from the cached model; the trace, the losses before fine-tuning and each selection's
fine-tuning and pruning are cached too (OUT/trace.npz, OUT/before.json, OUT/method_<name>/summary.json), and
stage 1 itself saves a checkpoint every STAGE1_SAVE_EVERY steps, so an interrupted run resumes with what it has
not finished (tests/test_bench_resume.py).

    .venv/bin/python bench/rise_mini.py --out runs/rise_mini --write BENCHMARKS.md

Seeds (`--seeds 0 1 2`): seed n repeats the whole pipeline in OUT/seed{n} (seed 0 in OUT itself): the
upcycling seed (Drop-Upcycling's re-initialized neurons, routers), stage 1's Trainer seed and data order,
the random selection's draw and each selection's fine-tuning seed (data order); seed 0 is today's
configuration. The corpus split is the same for every seed, so every seed is scored on the same held-out
verses, and the report gives each claim of claim_specs.SPECS an interval (evidence.claim_interval) over seeds × held-out verses and a
verdict (report.VERDICT_RULE).

Each finished seed is committed under bench/results/rise_mini/seed{n}/ (evidence.save_scores): per held-out verse,
the mean token NLL and token count on the target and pooled over the other languages, of the stage-1 model ("base")
and of each selection after fine-tuning, with the numbers of the report's rows (no weights, no trace). The report is
made from those files alone: `--report-only` rebuilds the section from a clone, and bench/claims.py its claims table.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from moekit.assets import bible_verses, resolve_model
from moekit.data.parallel import TranslationCollator
from moekit.checkpoint.format import load, save
from moekit.checkpoint.dense import load_dense
from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.routing.report import write_report
from moekit.routing.stats import activation_frequency, overlap_mass, overlap_share
from moekit.training.finetune import encode_lines, train_selected
from moekit.selection.prune import prune
from moekit.selection.registry import select
from moekit.methods.freeze import FreezeCallback, FreezeConfig
from moekit.training.recipe import AuxConfig
from moekit.training.common import last_checkpoint, load_tokenizer, resume_from
from moekit.training.trainer import MoETrainer
from moekit.checkpoint.upcycle_model import upcycle
from claims import committed_claims  # bench/claims.py
from evidence import RESULTS, load_runs, save_scores  # bench/evidence.py
from report import cached, device_name, log_progress, measured_on, write_section  # bench/report.py

LANGS = {"en": "k", "fr": "l", "de": "e", "es": "v", "sw": "h", "tl": "f", "id": "6", "vi": "7"}
HIGH, LOW, TARGET = ["en", "fr", "de", "es"], ["sw", "tl", "id", "vi"], "sw"
HIGH_N, LOW_N = 400, 40  # 10:1 imbalance in the stage-1 mix
TRACE_N, EVAL_N, TARGET_N = 48, 32, 160  # held-out verses: traces, loss evaluation; target fine-tuning set
STAGE1_STEPS, FT_STEPS, BATCH, MAX_LEN = 120, 30, 8, 64
STAGE1_SAVE_EVERY = 40  # stage 1's checkpoints: a run stopped mid-way resumes from the last one
BUDGET, METHODS = 16, ["rise", "esft", "topk", "random"]
MARK = ("<!-- rise_mini -->", "<!-- /rise_mini -->")
# RISE's headline claims (abstract, Table 3, Obs. 1-2), as paired comparisons of held-out mean token NLL
# after fine-tuning (lower is better): (A, B, languages, claim), "base" = the stage-1 model before any
# fine-tuning; the paper reports A < B (for the last: no increase over the base model).


def spec(seed: int = 0) -> MoESpec:
    return MoESpec(num_experts=8, top_k=2, every=3, init={"method": "drop", "ratio": 0.2}, seed=seed)


def seed_dir(out: Path, seed: int) -> Path:
    """Seed 0's pipeline in OUT itself (where the single-seed benchmark kept it), seed n's in OUT/seed{n}."""
    return out if seed == 0 else out / f"seed{seed}"


def corpus() -> dict[str, dict[str, list[str]]]:
    """Per language: 'trace', 'eval', 'train' (stage 1) and, for the target, 'target' — same verses across languages."""
    texts = {lang: {(v.book, v.chapter, v.verse): v.text for v in bible_verses(code)} for lang, code in LANGS.items()}
    keys = sorted(set.intersection(*(set(t) for t in texts.values())))
    random.Random(0).shuffle(keys)
    cuts = np.cumsum([TRACE_N, EVAL_N, HIGH_N, TARGET_N])
    parts = {"trace": keys[:cuts[0]], "eval": keys[cuts[0]:cuts[1]], "train": keys[cuts[1]:cuts[2]],
             "target": keys[cuts[2]:cuts[3]]}
    out = {}
    for lang, t in texts.items():
        n_train = HIGH_N if lang in HIGH else LOW_N
        out[lang] = {"trace": [t[k] for k in parts["trace"]], "eval": [t[k] for k in parts["eval"]],
                     "train": [t[k] for k in parts["train"][:n_train]], "target": [t[k] for k in parts["target"]]}
    return out


def stage1(out: Path, data, tok, seed: int = 0) -> float:
    """Upcycle and train the MoE layers on the imbalanced mix; cached as a moekit checkpoint. A stage 1 stopped
    mid-way continues from its last checkpoint in OUT/stage1_tmp (the Trainer restores weights, optimizer,
    schedule, RNG and data order)."""
    if (out / "base" / "moekit.json").is_file() and (out / "stage1.json").is_file():
        return json.loads((out / "stage1.json").read_text())["seconds"]
    from transformers import TrainingArguments

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = upcycle(load_dense(resolve_model("smollm2-135m")), spec(seed))
    lines = [line for lang in LANGS for line in data[lang]["train"]]
    random.Random(seed).shuffle(lines)
    args = TrainingArguments(output_dir=str(out / "stage1_tmp" / "checkpoints"), max_steps=STAGE1_STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=2e-4, warmup_steps=0.1,
                             lr_scheduler_type="linear", weight_decay=0.01, logging_steps=10, save_strategy="steps",
                             save_steps=STAGE1_SAVE_EVERY, save_total_limit=1, report_to=[], seed=seed, data_seed=seed,
                             remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = MoETrainer(model=model, args=args, train_dataset=encode_lines(lines, tok, MAX_LEN),
                         data_collator=TranslationCollator(tok.pad_token_id), aux=AuxConfig(),
                         callbacks=[FreezeCallback(model, FreezeConfig(schedule="ume"))])
    resume_from(trainer, last_checkpoint(out / "stage1_tmp"))
    save(model.eval(), out / "base", overwrite=True, tokenizer=tok)
    seconds = time.perf_counter() - t0
    (out / "stage1.json").write_text(json.dumps({"seconds": seconds, "log": trainer.state.log_history}))
    if (out / "stage1_tmp").exists():  # its checkpoints (weights and optimizer state) are not needed once cached
        shutil.rmtree(out / "stage1_tmp")
    return seconds


def batches(tok, lines: list[str], batch: int = 16) -> list[dict]:
    ex = encode_lines(lines, tok, MAX_LEN)
    collate = TranslationCollator(tok.pad_token_id)
    return [collate(ex[i:i + batch]) for i in range(0, len(ex), batch)]


@torch.no_grad()
def item_losses(model, tok, data) -> dict[str, dict[str, list[float]]]:
    """Per language, per held-out eval verse: summed token NLL ('nll') and its token count ('tokens')."""
    out = {}
    for lang in LANGS:
        nlls, counts = [], []
        for b in batches(tok, data[lang]["eval"]):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            labels = b["labels"][:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            nlls += nll.sum(1).tolist()  # ignored positions give 0
            counts += (labels != -100).sum(1).tolist()
        out[lang] = {"nll": nlls, "tokens": counts}
    return out


def mean_losses(items: dict) -> dict[str, float]:
    """Mean token NLL per language on the held-out eval verses (from item_losses)."""
    return {lang: sum(v["nll"]) / sum(v["tokens"]) for lang, v in items.items()}


def collect(model, tok, data):
    with RoutingCapture(model) as cap:
        for lang in LANGS:
            for i, b in enumerate(batches(tok, data[lang]["trace"])):
                cap.run(b["input_ids"], b["attention_mask"], language=lang,
                        sample_ids=torch.arange(i * 16, i * 16 + len(b["input_ids"])))
    return cap.trace(model="smollm2-135m drop-upcycled, stage 1")


def delta(after: dict, before: dict) -> tuple[float, float]:
    """(target loss change, mean loss change over the other 7 languages)."""
    others = [after[lang] - before[lang] for lang in LANGS if lang != TARGET]
    return after[TARGET] - before[TARGET], float(np.mean(others))


def run(out: Path, seed: int = 0, methods: list[str] = METHODS) -> dict:
    """The whole pipeline of one seed in `out` (seed_dir), every stage cached."""
    from moekit.routing.trace import RoutingTrace

    out.mkdir(parents=True, exist_ok=True)
    data = corpus()
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    s1 = stage1(out, data, tok, seed)
    base = load(out / "base")
    if (out / "trace.npz").is_file():
        trace = RoutingTrace.load(out / "trace.npz")
    else:
        trace = collect(base, tok, data)
        trace.save(out / "trace.npz")
    if not (out / "report" / "metrics.json").is_file():
        write_report(trace, out / "report", reference="en", overwrite=True)
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    before_items = cached(out / "before", lambda: {"items": item_losses(base, tok, data)})["items"]
    before = mean_losses(before_items)
    del base
    a = activation_frequency(trace)  # (Λ, L, E)
    rows = {}
    for method in methods:
        def go(method=method) -> dict:
            torch.manual_seed(seed)
            sel = select(trace, method, TARGET, BUDGET, **({"seed": seed} if method == "random" else {}))
            sel.save(out / f"selection_{method}.json", overwrite=True)
            omega = overlap_share(a, trace.layers, sel.experts)  # (Λ,) share of assignments (normalized eq. 12)
            t0 = time.perf_counter()
            model = load(out / "base")
            train_selected(model, sel, tok, data[TARGET]["target"], steps=FT_STEPS, lr=5e-4, batch_size=BATCH,
                           max_length=MAX_LEN, seed=seed)
            ft = item_losses(model, tok, data)
            ft_s = time.perf_counter() - t0
            pruned = load(out / "base")
            prune(pruned, sel)
            pr = item_losses(pruned, tok, data)
            mass = overlap_mass(a, trace.layers, sel.experts)  # (Λ,) eq. 12's raw sum (up to L·k)
            return {"count": sel.count, "omega": dict(zip(trace.languages, map(float, omega))),
                    "omega_mass": dict(zip(trace.languages, map(float, mass))),
                    "ft": delta(mean_losses(ft), before), "prune": delta(mean_losses(pr), before), "ft_seconds": ft_s,
                    "per_layer": {k: len(v) for k, v in sel.experts.items()}, "ft_items": ft, "prune_items": pr}
        rows[method] = cached(out / f"method_{method}", go)
    result = {"seed": seed, "stage1_seconds": s1, "before": before, "before_items": before_items, "methods": rows,
              "metrics": metrics}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


def verse_losses(items: dict, langs: list[str]):
    """(mean token NLL per held-out verse pooled over `langs`, its token count): the token-weighted mean is
    the corpus loss over those languages."""
    nll = np.sum([items[lang]["nll"] for lang in langs], 0)
    tokens = np.sum([items[lang]["tokens"] for lang in langs], 0).astype(float)
    return nll / np.maximum(tokens, 1), tokens


def verse_scores(items: dict) -> dict[str, np.ndarray]:
    """The committed per-verse scores of one model: mean token NLL on the target ("target") and pooled over the other
    languages ("others"), each with its token counts (the weights that make the weighted mean the corpus loss)."""
    groups = {"target": [TARGET], "others": [lang for lang in LANGS if lang != TARGET]}
    out = {}
    for group, langs in groups.items():
        out[group], out[f"{group} tokens"] = verse_losses(items, langs)
    return out


METRICS = ("jaccard", "tokens_per_language", "cramers_v", "usage_entropy", "region_jaccard")  # what render reports


def keep(result: dict, out: Path, root: Path = RESULTS) -> None:
    """Commit one seed's run (run's result) under root/rise_mini/seed{n}/: the stage-1 model as "base", each selection
    by its name."""
    seed = result["seed"]
    save_scores("rise_mini", "base", seed, verse_scores(result["before_items"]), root,
                {"stage1_seconds": result["stage1_seconds"], "before": result["before"], "device": device_name(),
                 "metrics": {k: result["metrics"][k] for k in METRICS}})
    for method, row in result["methods"].items():
        save_scores("rise_mini", method, seed, verse_scores(row["ft_items"]), root,
                    {**{k: row[k] for k in ("count", "omega", "ft", "prune")},
                     "omega_mass": omega_mass(out, seed, method, row)})


def committed(seeds: list[int], root: Path = RESULTS) -> dict[int, dict]:
    """The committed seeds among `seeds`, each as render takes it: the base run's values and its "methods"."""
    runs = load_runs("rise_mini", root)
    return {s: {**runs[("base", s)], "methods": {m: runs[(m, s)] for m in METHODS if (m, s) in runs}}
            for s in seeds if ("base", s) in runs}


CLAIMS_INTRO = (f"Headline claims over seeds (RISE abstract, Table 3, Obs. 1-2: the paper reports A < B). Metric: held-out "
                f"mean token NLL after fine-tuning (base: the stage-1 model before it), pooled over the tokens of {TARGET} "
                "or of the 7 other languages; Δ = A − B in nats.")


def omega_mass(out: Path, seed: int, method: str, row: dict) -> dict[str, float]:
    """Eq. 12's raw Ω per language: stored by runs of this version, else recomputed from the run's trace and
    saved selection (runs that stored only the share)."""
    if "omega_mass" in row:
        return row["omega_mass"]
    from moekit.routing.trace import RoutingTrace
    from moekit.selection.selection import Selection

    folder = seed_dir(out, seed)
    trace = RoutingTrace.load(folder / "trace.npz")
    sel = Selection.load(folder / f"selection_{method}.json")
    return dict(zip(trace.languages, map(float, overlap_mass(activation_frequency(trace), trace.layers, sel.experts))))


def render(results: dict[int, dict], cmd: str, root: Path = RESULTS) -> str:
    """Seed 0's (else the first seed's) routing analysis, every seed's method rows (results: committed()), and the
    claims from every committed seed."""
    r = results[min(results)]
    m = r["metrics"]
    langs = list(LANGS)
    jac = m["jaccard"]
    lines = [MARK[0], "## Routing isolation + RISE in miniature (bench/rise_mini.py)", "",
             f"`{cmd}` — {measured_on(results.values())}. SmolLM2-135M, Drop-Upcycled (ratio 0.2) to E=8/top-2 on "
             f"every 3rd block (10 MoE layers, 80 experts); stage 1 trains only the MoE layers for {STAGE1_STEPS} steps "
             f"of {BATCH} verses on {', '.join(HIGH)} ({HIGH_N} verses each) and {', '.join(LOW)} ({LOW_N} each) "
             f"({r['stage1_seconds'] / 60:.1f} min). Traces: {TRACE_N} held-out verses per language, identical content. "
             f"Target {TARGET}, budget K={BUDGET} experts; each selection fine-tuned alone for {FT_STEPS} steps of "
             f"{BATCH} on {TARGET_N} other {TARGET} verses (AdamW, lr 5e-4); loss = mean token NLL on {EVAL_N} "
             "further held-out verses per language." + (
                 f" Seeds {', '.join(map(str, sorted(results)))}: seed n > 0 repeats the whole pipeline (upcycling seed, "
                 "stage-1 Trainer seed and data order, random selection, fine-tuning seed); the routing tables below "
                 f"are seed {min(results)}'s." if len(results) > 1 else ""), "",
             "Global top-K Jaccard between languages (RISE eqs. 1–2):", "",
             "| | " + " | ".join(langs) + " |", "|---" * (len(langs) + 1) + "|"]
    order = list(m["tokens_per_language"])
    for la in langs:
        lines.append(f"| {la} | " + " | ".join(f"{jac[order.index(la)][order.index(lb)]:.2f}" for lb in langs) + " |")
    cv = [v for v in m["cramers_v"] if v == v]  # NaN-free
    lines += ["", f"Cramér's V between adjacent MoE layers' top-1 choices: mean {np.mean(cv):.2f} "
              f"(min {min(cv):.2f}, max {max(cv):.2f}); expert-usage entropy per layer "
              f"{min(m['usage_entropy']):.2f}–{max(m['usage_entropy']):.2f} nats (uniform: {np.log(8):.2f}).",
              "", "Layer-wise Jaccard vs en, region means (RISE eqs. 3–4):", "",
              "| language | shallow | middle | deep |", "|---|---|---|---|"]
    for la in langs:
        if la == "en":
            continue
        reg = m["region_jaccard"][la]
        lines.append(f"| {la} | " + " | ".join(f"{reg[region]:.2f}" for region in ("shallow", "middle", "deep")) + " |")
    lines.append("")
    for seed, res in sorted(results.items()):
        b = res["before"]
        lines.append(f"Loss before fine-tuning{'' if len(results) == 1 else f' (seed {seed})'}: {TARGET} "
                     f"{b[TARGET]:.3f}, others mean {np.mean([v for k, v in b.items() if k != TARGET]):.3f}.")
    lines += ["", f"Ω: the routing overlap of each language with the selection S (RISE eq. 12), as its share of the "
              f"language's (token, slot) assignments (overlap_share; 1 = every assignment lands on S) and as eq. 12's "
              f"raw sum Σ_l Σ_(i∈S) a (overlap_mass; at most 10 MoE layers × top-2 = 20).", "",
              f"| method | experts | Ω_{TARGET} share | Ω_{TARGET} raw (eq. 12) | Ω others share (mean) | Ω others raw "
              f"(mean) | FT Δloss {TARGET} | FT Δloss others | prune Δloss {TARGET} | prune Δloss others |",
              "|---" * 10 + "|"]
    for seed, res in sorted(results.items()):
        for name, row in res["methods"].items():
            om, raw = row["omega"], row["omega_mass"]
            others = np.mean([v for k, v in om.items() if k != TARGET])
            others_raw = np.mean([v for k, v in raw.items() if k != TARGET])
            lines.append(f"| {name if seed == 0 else f'{name} (seed {seed})'} | {row['count']} | {om[TARGET]:.3f} | "
                         f"{raw[TARGET]:.2f} | {others:.3f} | {others_raw:.2f} | {row['ft'][0]:+.4f} | "
                         f"{row['ft'][1]:+.4f} | {row['prune'][0]:+.4f} | {row['prune'][1]:+.4f} |")
    lines += ["", *committed_claims("rise_mini", CLAIMS_INTRO, root), "", MARK[1]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/rise_mini"))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="seeds to run, each the whole pipeline (0: today's configuration, in OUT itself); default 0")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="selections to fine-tune and prune")
    ap.add_argument("--report-only", action="store_true",
                    help="report the seeds committed under --results, run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished seed's per-verse scores and rows are committed, and reported from")
    args = ap.parse_args(argv)
    log_progress()
    if not args.report_only:
        for s in args.seeds:
            keep(run(seed_dir(args.out, s), s, args.methods), seed_dir(args.out, s), args.results)
    results = committed(args.seeds, args.results)
    if not results:
        ap.exit(1, f"no seed of {args.seeds} is committed in {args.results}\n")
    cmd = (f".venv/bin/python bench/rise_mini.py --out {args.out}"
           + ("" if args.seeds == [0] else f" --seeds {' '.join(map(str, args.seeds))}")
           + ("" if args.methods == METHODS else f" --methods {' '.join(args.methods)}")
           + (f" --write {args.write}" if args.write else ""))
    section = render(results, cmd, args.results)
    if args.write:
        write_section(args.write, section, MARK)
    print(section)


if __name__ == "__main__":
    main()
