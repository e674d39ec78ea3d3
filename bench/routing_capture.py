"""Routing-capture overhead: a forward inside RoutingCapture (hooks + filing the decisions, padding
dropped) vs the same plain forward, on transformers' own MoE families and a moekit model.

Same model, same batch; timings interleaved (plain, captured, plain, ...), median of --repeats after
warm-up; the captured ids are checked against the experts' inputs once before timing.

    .venv/bin/python bench/routing_capture.py --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import platform
import time
from datetime import date
from pathlib import Path

import torch
import transformers

from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.testing import tiny_llama, tiny_olmoe, tiny_qwen3_moe
from moekit.checkpoint.upcycle_model import upcycle
from report import spread, write_section  # bench/report.py

MARK = ("<!-- routing_capture -->", "<!-- /routing_capture -->")
DIMS = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
            max_position_embeddings=512, num_hidden_layers=4)
MODELS = {  # name -> builder
    "Qwen3-MoE E=64 top-8": lambda: tiny_qwen3_moe(**DIMS, head_dim=32, num_experts=64, num_experts_per_tok=8,
                                                   moe_intermediate_size=128),
    "OLMoE E=16 top-2": lambda: tiny_olmoe(**DIMS, num_experts=16, num_experts_per_tok=2, intermediate_size=512),
    "moekit (Llama upcycled) E=8 top-2": lambda: upcycle(tiny_llama(**DIMS, intermediate_size=1024),
                                                         MoESpec(num_experts=8, top_k=2, every=1,
                                                                 init={"method": "noise"})).eval(),
}


def batch(B: int, S: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(1, B, 2):  # every other row padded to 3/4 length
        mask[b, 3 * S // 4:] = 0
    return ids, mask


@torch.no_grad()
def measure(model, ids, mask, repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((median s, noise) plain, (median s, noise) captured); noise = (p75 - p25) / median."""
    def plain():
        model(input_ids=ids, attention_mask=mask)

    def captured():
        with RoutingCapture(model) as cap:
            cap.run(ids, mask, language="xx")

    for _ in range(2):  # warm-up
        plain(), captured()
    times = {plain: [], captured: []}
    for _ in range(repeats):
        for fn in (plain, captured):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    return spread(times[plain]), spread(times[captured])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, build in MODELS.items():
        model = build()
        ids, mask = batch(args.batch, args.seq, DIMS["vocab_size"])
        (plain, n_plain), (captured, n_captured) = measure(model, ids, mask, args.repeats)
        rows.append(f"| {name} | {plain * 1e3:.1f} | {captured * 1e3:.1f} | {captured / plain:.3f} | "
                    f"{100 * max(n_plain, n_captured):.0f} % |")
        print(rows[-1], flush=True)
    cmd = f".venv/bin/python bench/routing_capture.py --batch {args.batch} --seq {args.seq} --repeats {args.repeats}"
    section = "\n".join([
        MARK[0], "## Routing-capture overhead (bench/routing_capture.py)", "",
        f"`{cmd} --write BENCHMARKS.md` — {date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, fp32, batch {args.batch}×{args.seq} "
        f"tokens (every other row 1/4 padding), {DIMS['num_hidden_layers']} MoE layers, H={DIMS['hidden_size']}. "
        f"Median of {args.repeats} interleaved repeats after warm-up (noise = the larger (p75 − p25) / median of "
        "the two). Target: captured ≤ 1.05× plain.", "",
        "| model | plain forward (ms) | captured forward (ms) | ratio | noise |", "|---|---|---|---|---|", *rows, "",
        MARK[1]])
    if args.write:
        write_section(args.write, section, MARK)
    print(section)


if __name__ == "__main__":
    main()
