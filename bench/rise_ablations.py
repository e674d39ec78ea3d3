"""RISE's ablations in miniature (issue 30), on bench/rise_mini.py's stage-1 MoE model, data and protocol:
the layer-group ablations of Fig. 3 (w/o shallow / middle / deep, only one group), the sensitivity studies of
Fig. 4 (activation scale α, budget ratios across the groups, budget K) and LoRA as the PEFT baseline of
Table 6. Every variant is fine-tuned alone for rise_mini's FT_STEPS steps on the same target verses and
evaluated on the same held-out verses as rise_mini's rows (loss change on the target and on the other 7
languages); full RISE is also pruned (its experts disabled), as in rise_mini.

    .venv/bin/python bench/rise_ablations.py --out runs/rise_ablations --base-from runs/rise_mini --write BENCHMARKS.md

--base-from copies rise_mini's cached stage-1 model, trace and losses before fine-tuning (seed 0) from its
output folder, so the variants start from the very model of rise_mini's table; without it (or when that
folder has none yet) stage 1 runs here, as rise_mini would run it. Each variant is cached
(OUT/variant_<name>/summary.json): an interrupted run resumes with the variants it has not finished.

What the paper's figures show is not in its text (they are images), so the report gives the measurements
and each variant's paired difference to full RISE on the target loss, not a comparison with Fig. 3/4 values.

Each finished variant's per-verse losses (rise_mini.verse_scores) and row, and the stage-1 model's ("base": the
losses before fine-tuning), are committed under bench/results/rise_ablations/seed0/ (evidence.save_scores; no
weights), and the report is made from those files alone: `--report-only` rebuilds the section from a clone.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

import rise_mini as R  # bench/rise_mini.py: corpus, stage 1, losses, the protocol's constants
from evidence import RESULTS, load_runs, load_scores, save_scores  # bench/evidence.py
from report import cached, log_progress, paired_bootstrap, write_section  # bench/report.py

THIRD = 1 / 3
# name: (selection settings, budget K); None: LoRA
VARIANTS: dict[str, tuple[dict, int] | None] = {
    "rise": ({}, R.BUDGET),
    # Fig. 3: groups removed or kept alone (the selection of full RISE restricted to them)
    "rise w/o shallow": ({"groups": ["middle", "deep"]}, R.BUDGET),
    "rise w/o middle": ({"groups": ["shallow", "deep"]}, R.BUDGET),
    "rise w/o deep": ({"groups": ["shallow", "middle"]}, R.BUDGET),
    "rise only shallow": ({"groups": ["shallow"]}, R.BUDGET),
    "rise only middle": ({"groups": ["middle"]}, R.BUDGET),
    "rise only deep": ({"groups": ["deep"]}, R.BUDGET),
    # Fig. 4(a): activation scale α of eq. 8 (default 10)
    "rise α=0": ({"alpha": 0.0}, R.BUDGET),
    "rise α=100": ({"alpha": 100.0}, R.BUDGET),
    # Fig. 4(b): budget ratios (ρ_s, ρ_m, ρ_d) (default 0.35/0.25/0.40, Qwen3's)
    "rise ratios 1/3 each": ({"ratios": [THIRD, THIRD, 1 - 2 * THIRD]}, R.BUDGET),
    "rise ratios 0.5/0/0.5": ({"ratios": [0.5, 0.0, 0.5]}, R.BUDGET),
    "rise ratios 0.125/0.6875/0.1875": ({"ratios": [0.125, 0.6875, 0.1875]}, R.BUDGET),  # Phi-3.5-MoE's (Table 11)
    # Fig. 4(c): budget K
    "rise K=8": ({}, 8),
    "rise K=32": ({}, 32),
    # Table 6: LoRA on the same data and steps
    "lora": None,
}
LORA = dict(r=8, alpha=16, dropout=0.05, lr=5e-4)  # lr: the protocol's (rise_mini's expert fine-tuning)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MARK = ("<!-- rise_ablations -->", "<!-- /rise_ablations -->")
STAGE1_FILES = ["base", "stage1.json", "trace.npz", "report", "before"]


def adopt_stage1(out: Path, source: Path) -> bool:
    """Copy rise_mini's seed-0 stage-1 outputs (model, trace, report, losses before fine-tuning) into `out`."""
    if not all((source / f).exists() for f in STAGE1_FILES) or (out / "stage1.json").is_file():
        return False
    out.mkdir(parents=True, exist_ok=True)
    for f in STAGE1_FILES:
        src = source / f
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, out / f)
    return True


def train_lora(model, tok, lines: list[str], seed: int = 0):
    """LoRA adapters (r = 8) on every attention and dense-FFN projection (the MoE layers' fused experts are
    not nn.Linear modules), trained as the selections are (AdamW, linear schedule, FT_STEPS steps of BATCH,
    same lr), then merged back. Returns the merged model and the trainable parameter count."""
    import random

    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from moekit.data.parallel import TranslationCollator
    from moekit.training.finetune import encode_lines

    data = encode_lines(lines, tok, R.MAX_LEN)
    random.Random(seed).shuffle(data)
    peft = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                            target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rise-lora-") as tmp:
        args = TrainingArguments(output_dir=tmp, max_steps=R.FT_STEPS, per_device_train_batch_size=R.BATCH,
                                 learning_rate=LORA["lr"], lr_scheduler_type="linear", seed=seed, data_seed=seed,
                                 logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True,
                                 remove_unused_columns=False, dataloader_num_workers=0, use_cpu=True)
        Trainer(model=peft, args=args, train_dataset=data, data_collator=TranslationCollator(tok.pad_token_id)).train()
    return peft.merge_and_unload().eval(), trainable


def run_variant(name: str, out: Path, data, tok, trace, before: dict, seed: int = 0) -> dict:
    import moekit
    from moekit.routing.stats import activation_frequency, overlap_mass, overlap_share
    from moekit.training.finetune import train_selected
    from moekit.selection.prune import prune
    from moekit.selection.registry import select

    def go() -> dict:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        if VARIANTS[name] is None:
            model, trainable = train_lora(moekit.load(out / "base"), tok, data[R.TARGET]["target"], seed)
            ft = R.item_losses(model, tok, data)
            return {"count": None, "trainable": trainable, "ft": R.delta(R.mean_losses(ft), before), "ft_items": ft,
                    "ft_seconds": time.perf_counter() - t0}
        params, budget = VARIANTS[name]
        sel = select(trace, "rise", R.TARGET, budget, **params)
        sel.save(out / f"selection_{name.replace(' ', '_').replace('/', '-')}.json", overwrite=True)
        a = activation_frequency(trace)  # (Λ, L, E)
        model = moekit.load(out / "base")
        train_selected(model, sel, tok, data[R.TARGET]["target"], steps=R.FT_STEPS, lr=5e-4, batch_size=R.BATCH,
                       max_length=R.MAX_LEN, seed=seed)
        ft = R.item_losses(model, tok, data)
        ft_s = time.perf_counter() - t0
        pr = None
        if name == "rise":  # the ablations are about fine-tuning; pruning is measured for full RISE only
            pruned = moekit.load(out / "base")
            prune(pruned, sel)
            pr = R.item_losses(pruned, tok, data)
        return {"count": sel.count, "per_region": sel.params["region_budgets"], "groups": params.get("groups"),
                "omega": dict(zip(trace.languages, map(float, overlap_share(a, trace.layers, sel.experts)))),
                "omega_mass": dict(zip(trace.languages, map(float, overlap_mass(a, trace.layers, sel.experts)))),
                "ft": R.delta(R.mean_losses(ft), before),
                "prune": None if pr is None else R.delta(R.mean_losses(pr), before),
                "ft_items": ft, "prune_items": pr, "ft_seconds": ft_s}

    return cached(out / f"variant_{name.replace(' ', '_').replace('/', '-')}", go)


def keep(name: str, row: dict, root: Path = RESULTS) -> None:
    """Commit a finished variant (run_variant's row; "base": the stage-1 model's, its losses before fine-tuning as
    "ft_items") under root/rise_ablations/seed0/."""
    save_scores("rise_ablations", name, 0, R.verse_scores(row["ft_items"]), root,
                {k: v for k, v in row.items() if k not in ("ft_items", "prune_items")})


def render(rows: dict, scores: dict, before: dict, stage1_from: str | None, cmd: str) -> str:
    """The section from committed variants: `rows` their values, `scores` their per-verse losses (load_scores)."""
    langs = list(R.LANGS)
    others = [lang for lang in langs if lang != R.TARGET]
    fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
    lines = [MARK[0], "## RISE ablations in miniature: Fig. 3 layer groups, Fig. 4 α / ratios / K, LoRA (bench/rise_ablations.py)",
             "", f"`{cmd}` — {date.today()}, {platform.machine()}, 2 cores. The stage-1 MoE model, traces, data and protocol of "
             "rise_mini (target " + R.TARGET + f", {R.FT_STEPS} steps of {R.BATCH} verses, AdamW lr 5e-4, linear; loss = "
             f"mean token NLL on {R.EVAL_N} held-out verses per language)"
             + (f", stage 1 copied from {stage1_from}" if stage1_from else ", stage 1 run here") + ". Loss before "
             f"fine-tuning: {R.TARGET} {before[R.TARGET]:.3f}, others mean {np.mean([before[k] for k in others]):.3f}. "
             "w/o X / only X: full RISE's selection (K = 16) without X's experts / with X's only (Fig. 3: the budget "
             "of the removed groups is dropped, not moved). Ω: the target's routing overlap with the selection, as "
             "the share of its (token, slot) assignments (overlap_share) and as eq. 12's raw sum (overlap_mass; "
             "10 MoE layers × top-2 = 20 for all experts). LoRA: r = 8, α = 16 on every attention and dense-FFN "
             "projection (not the fused experts), same lr, data and steps. Δ vs rise: paired bootstrap over the "
             "held-out target verses (token-weighted, 2000 resamples), one seed.", "",
             f"| variant | experts (S/M/D) | Ω_{R.TARGET} share | Ω_{R.TARGET} raw (eq. 12) | Ω others share (mean) | "
             f"FT Δloss {R.TARGET} | Δ vs rise [95 % CI] | FT Δloss others | prune Δloss {R.TARGET} | prune Δloss others |",
             "|---" * 10 + "|"]
    ref = rows.get("rise")
    for name, r in rows.items():
        if r["count"] is None:
            experts = f"LoRA, {r['trainable']:,} parameters"
            om = om_raw = om_o = None
        else:
            pr = r["per_region"]
            keep = r.get("groups") or ["shallow", "middle", "deep"]
            experts = f"{r['count']} ({'/'.join(str(pr[g] if g in keep else 0) for g in ('shallow', 'middle', 'deep'))})"
            om, om_raw = r["omega"][R.TARGET], r["omega_mass"][R.TARGET]
            om_o = float(np.mean([r["omega"][k] for k in others]))
        if ref is not None and name != "rise":
            a, b = scores[(name, 0)], scores[("rise", 0)]
            s = paired_bootstrap(a["target"][None], b["target"][None], weights=a["target tokens"][None])
            vs = f"{s['mean']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}]"
        else:
            vs = "–"
        prune_ = r.get("prune") or (None, None)
        lines.append(f"| {name} | {experts} | {fmt(om, '.3f')} | {fmt(om_raw, '.2f')} | {fmt(om_o, '.3f')} | "
                     f"{r['ft'][0]:+.4f} | {vs} | {r['ft'][1]:+.4f} | {fmt(prune_[0], '+.4f')} | {fmt(prune_[1], '+.4f')} |")
    return "\n".join([*lines, "", MARK[1]])


def main(argv: list[str] | None = None) -> None:
    from moekit.assets import resolve_model
    from moekit.routing.trace import RoutingTrace
    from moekit.training.run import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/rise_ablations"))
    ap.add_argument("--base-from", type=Path, metavar="RISE_MINI_OUT",
                    help="rise_mini's output folder: copy its seed-0 stage 1 (model, trace, losses before) from there")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--report-only", action="store_true",
                    help="report the variants committed under --results, run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="where each finished variant's per-verse losses and row are committed, and reported from")
    args = ap.parse_args(argv)
    log_progress()
    out = args.out
    if not args.report_only:
        import moekit

        copied = adopt_stage1(out, args.base_from) if args.base_from else False
        if copied:
            (out / "stage1_from.txt").write_text(str(args.base_from))
        data = R.corpus()
        tok = load_tokenizer(resolve_model("smollm2-135m"))
        R.stage1(out, data, tok, 0)
        if (out / "trace.npz").is_file():
            trace = RoutingTrace.load(out / "trace.npz")
        else:
            trace = R.collect(moekit.load(out / "base"), tok, data)
            trace.save(out / "trace.npz")
        items = cached(out / "before", lambda: {"items": R.item_losses(moekit.load(out / "base"), tok, data)})["items"]
        stage1_from = (out / "stage1_from.txt").read_text() if (out / "stage1_from.txt").is_file() else None
        keep("base", {"ft_items": items, "before": R.mean_losses(items), "stage1_from": stage1_from}, args.results)
        for name in args.variants:
            keep(name, run_variant(name, out, data, tok, trace, R.mean_losses(items)), args.results)
    committed = {n: r for (n, _), r in load_runs("rise_ablations", args.results).items()}
    rows = {n: committed[n] for n in args.variants if n in committed}
    if not rows or "base" not in committed:
        ap.exit(1, f"no variant is committed in {args.results}\n")
    before, stage1_from = committed["base"]["before"], committed["base"]["stage1_from"]
    cmd = (f".venv/bin/python bench/rise_ablations.py --out {out}"
           + (f" --base-from {args.base_from}" if args.base_from else "")
           + ("" if args.variants == list(VARIANTS) else " --variants " + " ".join(f"'{v}'" for v in args.variants))
           + (f" --write {args.write}" if args.write else ""))
    section = render(rows, load_scores("rise_ablations", args.results), before, stage1_from, cmd)
    if args.write:
        write_section(args.write, section, MARK)
    print(section)


if __name__ == "__main__":
    main()
