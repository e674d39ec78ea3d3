"""Trainable-state bytes of selective expert fine-tuning vs training whole fused expert tensors (RISE Table 12).

For K selected experts (spread evenly over the MoE layers) on random transformers v5 MoE models with
64 experts per layer, moekit.selection.finetune.attach is applied, one AdamW step is taken on a small
batch, and the bytes of every trainable parameter, its gradient and its AdamW state (exp_avg,
exp_avg_sq, step) are summed from the actual tensors. The baseline trains the whole 3-D expert
tensors (requires_grad on the fused parameters, everything else frozen), which is all requires_grad
can express when all experts of a layer are one Parameter.

    .venv/bin/python bench/select_memory.py --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import platform
import random
from datetime import date
from pathlib import Path

import torch
import transformers

from moekit.routing.sites import find_sites
from moekit.selection.finetune import attach
from moekit.testing import tiny_olmoe, tiny_qwen3_moe
from report import write_section  # bench/report.py

MARK = ("<!-- select_memory -->", "<!-- /select_memory -->")
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             num_experts=64, num_experts_per_tok=8)
MODELS = {"Qwen3-MoE": lambda: tiny_qwen3_moe(**SHAPE, head_dim=64, moe_intermediate_size=128),
          "OLMoE": lambda: tiny_olmoe(**SHAPE, intermediate_size=128)}
KS = (8, 32, 128)


def state_bytes(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of the trainable tensors, from the tensors themselves."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    p = sum(nbytes(x) for x in params)
    g = sum(nbytes(x.grad) for x in params if x.grad is not None)
    s = sum(nbytes(v) for x in params for v in opt.state[x].values() if torch.is_tensor(v))
    return p, g, s


def one_step(model, params) -> tuple[int, int, int]:
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return state_bytes(params, opt)


def selection(model, k: int, seed: int = 0) -> dict[str, list[int]]:
    sites = find_sites(model)
    rng = random.Random(seed)
    per = [k // len(sites) + (i < k % len(sites)) for i in range(len(sites))]
    return {s.name: sorted(rng.sample(range(s.num_experts), n)) for s, n in zip(sites, per)}


def whole_experts(model) -> list[torch.nn.Parameter]:
    """requires_grad on the fused expert tensors only."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for s in find_sites(model) for p in s.experts.parameters(recurse=False)
              if p.shape[0] == s.num_experts]
    for p in params:
        p.requires_grad_(True)
    return params


def measure(name: str) -> list[tuple]:
    rows = []
    for k in KS:
        model = MODELS[name]()
        handle = attach(model, selection(model, k))
        rows.append((name, "selected experts", k, handle.num_trainable, *one_step(model, handle.trainable)))
    model = MODELS[name]()
    params = whole_experts(model)
    total = sum(s.num_experts for s in find_sites(model))
    rows.append((name, "whole expert tensors", total, sum(p.numel() for p in params), *one_step(model, params)))
    return rows


def render(rows, cmd: str) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    out = [MARK[0], "## Selective fine-tuning: trainable-state memory (bench/select_memory.py)", "",
           f"`{cmd}` — {date.today()}, {platform.machine()}, torch {torch.__version__}, transformers "
           f"{transformers.__version__}, fp32. Random models, 4 MoE layers × 64 experts, top-8, hidden 256, "
           "expert intermediate 128 (one expert = 98,304 parameters). Bytes summed from the actual tensors "
           "after one AdamW step: trainable parameters + gradients + AdamW state (exp_avg, exp_avg_sq, step). "
           "K experts are spread evenly over the layers. The frozen full expert tensors are the model's "
           "weights in both cases and are not counted.", "",
           "| model | trains | K | trainable elements | params (MiB) | grads (MiB) | AdamW state (MiB) | "
           "total (MiB) | bytes per expert | of whole tensors |", "|---|---|---|---|---|---|---|---|---|---|"]
    whole = {name: p + g + s for name, what, k, n, p, g, s in rows if what.startswith("whole")}
    for name, what, k, n, p, g, s in rows:
        total = p + g + s
        out.append(f"| {name} | {what} | {k} | {n:,} | {mib(p)} | {mib(g)} | {mib(s)} | {mib(total)} | "
                   f"{total / k:,.0f} | {100 * total / whole[name]:.1f} % |")
    out += ["", "Reading: the selective state grows linearly in K at a constant 16 bytes per fp32 expert "
                "parameter (parameter, gradient, two AdamW moments; the per-tensor step counters add 4 bytes "
                "each, visible only at K = 8), so K experts cost K/256 of the whole expert tensors. With "
                "requires_grad on the fused tensors, training any K experts costs the whole-tensor row. Not "
                "counted (not trainable state): during backward each layer's gradient w.r.t. its full (E, ...) "
                "weight exists transiently before only the K selected rows are kept.", "", MARK[1]]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="update this markdown file's select_memory section")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [r for name in MODELS for r in measure(name)]
    cmd = "bench/select_memory.py" + (f" --write {args.write}" if args.write else "")
    section = render(rows, f".venv/bin/python {cmd}")
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
