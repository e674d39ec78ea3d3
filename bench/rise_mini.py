"""Routing isolation + RISE in miniature: an MoE LM with learned routing on an imbalanced 8-language
Bible mix, its routing traces on identical held-out verses, and RISE / ESFT / top-K / random expert
selections for a low-resource target, each fine-tuned alone and pruned to check causality.

How the MoE model is made (stage 1, cached in OUT/base): SmolLM2-135M (moekit.assets) upcycled with
Drop-Upcycling, re-initialization ratio 0.2 (E=8, top-2, every 3rd block: 10 MoE layers, 80 experts), then only the MoE layers
(experts + routers, UME-style) trained as a causal LM for STAGE1_STEPS steps on 4 high-resource
languages (HIGH_N verses each) and 4 low-resource ones (LOW_N verses each), λ_lb = 1e-2, λ_z = 1e-3.
Stages 2-5 are cheap and re-run each time from the cached model.

    .venv/bin/python bench/rise_mini.py --out runs/rise_mini --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from moekit.assets import bible_verses, resolve_model
from moekit.data.parallel import TranslationCollator
from moekit.io import load, load_dense, save
from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.routing.report import write_report
from moekit.routing.stats import activation_frequency, overlap_share
from moekit.select.finetune import encode_lines, train_selected
from moekit.select.prune import prune
from moekit.select.registry import select
from moekit.train.freeze import FreezeCallback
from moekit.train.recipe import AuxConfig, FreezeConfig
from moekit.train.run import load_tokenizer
from moekit.train.trainer import MoETrainer
from moekit.upcycling import upcycle
from report import write_section  # bench/report.py

LANGS = {"en": "k", "fr": "l", "de": "e", "es": "v", "sw": "h", "tl": "f", "id": "6", "vi": "7"}
HIGH, LOW, TARGET = ["en", "fr", "de", "es"], ["sw", "tl", "id", "vi"], "sw"
HIGH_N, LOW_N = 400, 40  # 10:1 imbalance in the stage-1 mix
TRACE_N, EVAL_N, TARGET_N = 48, 32, 160  # held-out verses: traces, loss evaluation; target fine-tuning set
STAGE1_STEPS, FT_STEPS, BATCH, MAX_LEN = 120, 30, 8, 64
BUDGET, METHODS = 16, ["rise", "esft", "topk", "random"]
SPEC = MoESpec(num_experts=8, top_k=2, every=3, init={"method": "drop", "ratio": 0.2}, seed=0)
MARK = ("<!-- rise_mini -->", "<!-- /rise_mini -->")


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


def stage1(out: Path, data, tok) -> float:
    """Upcycle and train the MoE layers on the imbalanced mix; cached as a moekit checkpoint."""
    if (out / "base" / "moekit.json").is_file():
        return json.loads((out / "stage1.json").read_text())["seconds"]
    from transformers import TrainingArguments

    t0 = time.perf_counter()
    model = upcycle(load_dense(resolve_model("smollm2-135m")), SPEC)
    lines = [line for lang in LANGS for line in data[lang]["train"]]
    random.Random(0).shuffle(lines)
    args = TrainingArguments(output_dir=str(out / "stage1_tmp"), max_steps=STAGE1_STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=2e-4, warmup_steps=0.1, lr_scheduler_type="linear", weight_decay=0.01,
                             logging_steps=10, save_strategy="no", report_to=[], seed=0, data_seed=0,
                             remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = MoETrainer(model=model, args=args, train_dataset=encode_lines(lines, tok, MAX_LEN),
                         data_collator=TranslationCollator(tok.pad_token_id), aux=AuxConfig(),
                         callbacks=[FreezeCallback(model, FreezeConfig(schedule="ume"))])
    trainer.train()
    save(model.eval(), out / "base", overwrite=True, tokenizer=tok)
    seconds = time.perf_counter() - t0
    (out / "stage1.json").write_text(json.dumps({"seconds": seconds, "log": trainer.state.log_history}))
    return seconds


def batches(tok, lines: list[str], batch: int = 16) -> list[dict]:
    ex = encode_lines(lines, tok, MAX_LEN)
    collate = TranslationCollator(tok.pad_token_id)
    return [collate(ex[i:i + batch]) for i in range(0, len(ex), batch)]


@torch.no_grad()
def losses(model, tok, data) -> dict[str, float]:
    """Mean token NLL per language on the held-out eval verses."""
    out = {}
    for lang in LANGS:
        tot = n = 0.0
        for b in batches(tok, data[lang]["eval"]):
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            labels = b["labels"][:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")
            tot, n = tot + float(nll), n + int((labels != -100).sum())
        out[lang] = tot / n
    return out


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


def run(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    data = corpus()
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    s1 = stage1(out, data, tok)
    base = load(out / "base")
    trace = collect(base, tok, data)
    trace.save(out / "trace.npz")
    write_report(trace, out / "report", reference="en", overwrite=True)
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    before = losses(base, tok, data)
    a = activation_frequency(trace)  # (Λ, L, E)
    rows = {}
    for method in METHODS:
        sel = select(trace, method, TARGET, BUDGET)
        sel.save(out / f"selection_{method}.json")
        omega = overlap_share(a, trace.layers, sel.experts)  # (Λ,) share of assignments (normalized eq. 12)
        t0 = time.perf_counter()
        model = load(out / "base")
        train_selected(model, sel, tok, data[TARGET]["target"], steps=FT_STEPS, lr=5e-4, batch_size=BATCH,
                       max_length=MAX_LEN)
        ft = losses(model, tok, data)
        ft_s = time.perf_counter() - t0
        pruned = load(out / "base")
        prune(pruned, sel)
        pr = losses(pruned, tok, data)
        rows[method] = {"count": sel.count, "omega": dict(zip(trace.languages, map(float, omega))),
                        "ft": delta(ft, before), "prune": delta(pr, before), "ft_seconds": ft_s,
                        "per_layer": {k: len(v) for k, v in sel.experts.items()}}
    result = {"stage1_seconds": s1, "before": before, "methods": rows, "metrics": metrics}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    return result


def render(r: dict, cmd: str) -> str:
    m = r["metrics"]
    langs = list(LANGS)
    jac = m["jaccard"]
    lines = [MARK[0], "## Routing isolation + RISE in miniature (bench/rise_mini.py)", "",
             f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores. SmolLM2-135M, Drop-Upcycled (ratio 0.2) to E=8/top-2 on "
             f"every 3rd block (10 MoE layers, 80 experts); stage 1 trains only the MoE layers for {STAGE1_STEPS} steps "
             f"of {BATCH} verses on {', '.join(HIGH)} ({HIGH_N} verses each) and {', '.join(LOW)} ({LOW_N} each) "
             f"({r['stage1_seconds'] / 60:.1f} min). Traces: {TRACE_N} held-out verses per language, identical content. "
             f"Target {TARGET}, budget K={BUDGET} experts; each selection fine-tuned alone for {FT_STEPS} steps of "
             f"{BATCH} on {TARGET_N} other {TARGET} verses (AdamW, lr 5e-4); loss = mean token NLL on {EVAL_N} "
             "further held-out verses per language.", "",
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
    b = r["before"]
    lines += ["", f"Loss before fine-tuning: {TARGET} {b[TARGET]:.3f}, others mean "
              f"{np.mean([v for k, v in b.items() if k != TARGET]):.3f}.", "",
              f"| method | experts | Ω_{TARGET} | Ω others (mean) | FT Δloss {TARGET} | FT Δloss others | "
              f"prune Δloss {TARGET} | prune Δloss others |", "|---|---|---|---|---|---|---|---|"]
    for name, row in r["methods"].items():
        om = row["omega"]
        others = np.mean([v for k, v in om.items() if k != TARGET])
        lines.append(f"| {name} | {row['count']} | {om[TARGET]:.3f} | {others:.3f} | {row['ft'][0]:+.4f} | "
                     f"{row['ft'][1]:+.4f} | {row['prune'][0]:+.4f} | {row['prune'][1]:+.4f} |")
    lines += ["", MARK[1]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/rise_mini"))
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    r = run(args.out)
    cmd = f".venv/bin/python bench/rise_mini.py --out {args.out}" + (f" --write {args.write}" if args.write else "")
    section = render(r, cmd)
    if args.write:
        write_section(args.write, section, MARK)
    print(section)


if __name__ == "__main__":
    main()
