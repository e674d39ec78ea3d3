"""`moekit demo`: the main job on the built-in default (SmolLM2-135M, Bible verses).

Fetches SmolLM2-135M and the verse-aligned Bible, upcycles the model with naive upcycling and
with SPRI (E=8, top-2, every 4th block, dense-copied shared expert as SPRI §3.2), saves both, and
compares them at initialization: expert diversity, KL(dense ‖ MoE) on held-out English verses,
total and active parameters, conversion time.
"""
from __future__ import annotations

import copy
import random
import time
from pathlib import Path

from rich.table import Table

from moekit.assets import bible_verses, resolve_model
from moekit.cli.common import err_console, human, load_tokenizer, out_console
from moekit.io import check_output_dir, load_dense, save
from moekit.metrics import diversity, kl_on_texts, param_counts
from moekit.moe.spec import MoESpec
from moekit.upcycle import upcycle

METHODS = ("naive", "spri")


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the built-in demo (SmolLM2-135M, naive vs SPRI upcycling)",
                       description=__doc__)
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--verses", type=int, default=64, help="held-out English verses for the KL (default 64)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(run=run)


def run(args) -> None:
    out = check_output_dir(args.out, args.overwrite)
    log = err_console()
    model_dir = resolve_model("smollm2-135m", log=log.print)
    texts = [v.text for v in random.Random(0).sample(bible_verses("k", log=log.print), args.verses)]
    tokenizer = load_tokenizer(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    dense = load_dense(model_dir)
    table = Table(title="SmolLM2-135M upcycled at init (E=8, top-2, every 4th block, shared expert)")
    for col in ("method", "upcycle (s)", "diversity", "KL(dense‖MoE)/token", "total params", "active params"):
        table.add_column(col)
    for method in METHODS:
        spec = MoESpec(num_experts=8, top_k=2, every=4, shared_expert=True, init=method)
        with log.status(f"upcycling with {method}"):
            t0 = time.perf_counter()
            moe = upcycle(copy.deepcopy(dense), spec)
            seconds = time.perf_counter() - t0
            save(moe, Path(out) / method, overwrite=True, tokenizer=tokenizer)
        with log.status(f"KL on {len(texts)} held-out verses"):
            kl = kl_on_texts(dense, moe, tokenizer, texts)
        total, active = param_counts(moe)
        table.add_row(method, f"{seconds:.1f}", f"{round(diversity(moe), 4) + 0.0:.4f}", f"{kl:.3g}", human(total), human(active))
    out_console().print(table)
    out_console().print(f"checkpoints: {out}/{{{','.join(METHODS)}}} (inspect with `moekit inspect`)")
