"""MoE FFN speed vs the physical limit (k x dense FFN cost) and vs transformers' own v5 experts.

For each shape, all implementations get the same weights, the same routing (top_k_index,
top_k_weights) and the same upstream gradient; outputs and gradients are checked equal before
timing. Timings are interleaved across implementations, median of --repeats after warm-up.

    .venv/bin/python bench/moe_layer.py --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from moekit.moe.experts import Experts
from report import write_section  # bench/report.py

SHAPES = [  # (name, E, k, H, I)
    ("E=8/top-2/H=1024/I=3072", 8, 2, 1024, 3072),
    ("E=64/top-8/H=512/I=384", 64, 8, 512, 384),
]
MARK = ("<!-- moe_layer -->", "<!-- /moe_layer -->")


def make_inputs(E, k, H, I, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)  # (T, k)
    w = w / w.sum(-1, keepdim=True)
    gate_up = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    down = torch.randn(E, H, I, generator=g) * I**-0.5
    grad = torch.randn(T, H, generator=g)
    return x, ids, w, gate_up, down, grad


class Dense(torch.nn.Module):
    """One dense gated FFN of the same shape: the unit of the limit."""

    def __init__(self, gate_up, down):
        super().__init__()
        self.gate_up, self.down = torch.nn.Parameter(gate_up[0].clone()), torch.nn.Parameter(down[0].clone())

    def forward(self, x, ids, w):
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.down)


def build(name, E, k, H, I, gate_up, down):
    if name == "dense":
        return Dense(gate_up, down)
    if name == "moekit":
        m = Experts(E, H, I, "silu", gated=True)
        m.gate_up.data.copy_(gate_up)
        m.down.data.copy_(down)
        return m
    cfg = MixtralConfig(num_local_experts=E, num_experts_per_tok=k, hidden_size=H, intermediate_size=I,
                        hidden_act="silu", experts_implementation=name.removeprefix("hf_"))
    m = MixtralExperts(cfg)
    m.gate_up_proj.data.copy_(gate_up)
    m.down_proj.data.copy_(down)
    return m


def step(m, x, ids, w, grad, backward):
    x = x.detach().requires_grad_(backward)
    y = m(x, ids, w)
    if backward:
        y.backward(grad)
    return y, x.grad


def weight_grads(m):
    return [p.grad for p in m.parameters()]


def check_equal(mods, x, ids, w, grad):
    ref_y, ref_gx = step(mods["moekit"], x, ids, w, grad, True)
    ref_gw = weight_grads(mods["moekit"])
    for name in ("hf_eager", "hf_grouped_mm"):
        y, gx = step(mods[name], x, ids, w, grad, True)
        for a, b in [(y, ref_y), (gx, ref_gx), *zip(weight_grads(mods[name]), ref_gw)]:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for m in mods.values():
        m.zero_grad(set_to_none=True)


def time_all(mods, x, ids, w, grad, backward, repeats):
    times = {n: [] for n in mods}
    for n, m in mods.items():  # warm-up
        step(m, x, ids, w, grad, backward)
    for _ in range(repeats):
        for n, m in mods.items():
            m.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step(m, x, ids, w, grad, backward)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def run_shape(label, E, k, H, I, T, repeats):
    x, ids, w, gate_up, down, grad = make_inputs(E, k, H, I, T)
    names = ["dense", "moekit", "hf_eager", "hf_grouped_mm"]
    mods = {n: build(n, E, k, H, I, gate_up, down) for n in names}
    check_equal(mods, x, ids, w, grad)
    rows = []
    for mode, bwd in (("fwd+bwd", True), ("fwd", False)):
        with torch.set_grad_enabled(bwd):
            t = time_all(mods, x, ids, w, grad, bwd, repeats)
        limit = k * t["dense"]
        rows.append((label, mode, limit, {n: t[n] / limit for n in names[1:]}, {n: t[n] for n in names[1:]}))
    return rows


def render(rows, T, repeats, cmd):
    out = [MARK[0], "## MoE layer speed (bench/moe_layer.py)", "",
           f"`{cmd}` — {date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
           f"{torch.__version__}, transformers {transformers.__version__}, fp32, {T} tokens, median of "
           f"{repeats} interleaved repeats after warm-up. Outputs and gradients of all three "
           "implementations checked equal (rtol/atol 1e-4) before timing.", "",
           "Ratio = time / limit, limit = k × the time of one dense FFN of the same shape on the same tokens.", "",
           "| shape | pass | limit (ms) | moekit | transformers eager | transformers grouped_mm |",
           "|---|---|---|---|---|---|"]
    for label, mode, limit, ratio, t in rows:
        cells = [f"{ratio[n]:.2f}× ({1000 * t[n]:.0f} ms)" for n in ("moekit", "hf_eager", "hf_grouped_mm")]
        out.append(f"| {label} | {mode} | {1000 * limit:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(out + ["", MARK[1]])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--write", type=Path, help="update this markdown file's moe_layer section")
    args = ap.parse_args()
    rows = []
    for label, E, k, H, I in SHAPES:
        rows += run_shape(label, E, k, H, I, args.tokens, args.repeats)
    cmd = f".venv/bin/python bench/moe_layer.py --tokens {args.tokens} --repeats {args.repeats}" + (
        f" --write {args.write}" if args.write else "")
    section = render(rows, args.tokens, args.repeats, cmd)
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
