"""SIMoE layer cost (SIMoE issue targets): forward time of a sparse interpolated linear vs a plain linear
of the same shape at equal tokens (target ≤ 2.2×), and training memory of a SIMoE model vs a sparse-
upcycled one with the same M (target ≤ 0.7×).

Forward: nn.Linear vs SILinear (M = 8, instance routing) in train mode with median gates (eqs. 6-7, the
default), in train mode with sampled hard-concrete gates (`simoe.gates: sampled`, fresh draws each call)
and in eval mode (median gates) on B × T tokens, timings interleaved, median of --repeats after warm-up.
Memory: a Llama with SmolLM2-135M's widths (hidden 576, FFN 1536, 9/3 heads) and --layers blocks,
random weights, trained 3 AdamW steps on 4 × 128 tokens in a fresh process per system; reported are the
bytes of parameters + gradients + AdamW state from the tensors themselves, and the process's peak RSS
growth over its RSS before the model was built. Systems: dense full fine-tuning, SIMoE (every attention/
MLP linear and norm, M = 8), sparse upcycling (every FFN → 8 dense-copied experts, top-2).

    .venv/bin/python bench/simoe_layer.py --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

from report import spread, write_section  # bench/report.py

MARK = ("<!-- simoe_layer -->", "<!-- /simoe_layer -->")
SHAPES = [(576, 1536), (1536, 576), (576, 576)]
M = 8


def forward_times(d_in: int, d_out: int, tokens: tuple[int, int], repeats: int) -> dict[str, tuple[float, float]]:
    from moekit.simoe.layer import MaskInit, Routing, SILinear

    torch.manual_seed(0)
    plain = nn.Linear(d_in, d_out)
    routing = Routing()
    si = {sampled: SILinear(nn.Linear(d_in, d_out), M, MaskInit(0.05, 0.01, torch.Generator().manual_seed(0),
                                                                sampled), routing) for sampled in (False, True)}
    for layer in si.values():
        layer.delta.data.normal_(std=0.01)
    routing.weights = torch.softmax(torch.randn(tokens[0], M), -1)  # (B, M)
    x = torch.randn(*tokens, d_in)
    fns = {"plain": lambda: plain(x), "simoe_train": lambda: si[False].train()(x),
           "simoe_sampled": lambda: si[True].train()(x), "simoe_eval": lambda: si[False].eval()(x)}
    times = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(3):
            for f in fns.values():
                f()
        for _ in range(repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: spread(v) for k, v in times.items()}  # (median s, noise)


def memory_child(system: str, layers: int) -> dict:
    """One system's training memory (runs in its own process)."""
    import transformers

    from moekit.moe.spec import MoESpec
    from moekit.simoe.model import SIMoEConfig, simoe_upcycle
    from moekit.simoe.objective import param_groups, penalty
    from moekit.checkpoint.upcycle_model import upcycle

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    if system == "simoe":
        simoe_upcycle(model, SIMoEConfig(num_experts=M))
        opt = torch.optim.AdamW(param_groups(model, 1e-4, 0.0))
    else:
        if system == "upcycle":
            upcycle(model, MoESpec(num_experts=M, top_k=2, every=1, init={"method": "naive"}))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 49152, (4, 128), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        if system == "simoe":
            loss = loss + penalty(model)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(p.grad) for p in trainable) + \
        sum(nbytes(v) for p in trainable for v in opt.state[p].values() if torch.is_tensor(v))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"state_bytes": state, "peak_rss_growth": peak - rss0,
            "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainable)}


def memory(system: str, layers: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", system, "--layers", str(layers)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tokens", type=int, nargs=2, default=(8, 256), metavar=("B", "T"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(memory_child(args.child, args.layers)))
        return
    rows = []
    for d_in, d_out in SHAPES:
        t = forward_times(d_in, d_out, tuple(args.tokens), args.repeats)
        cells = [f"{1e3 * t[k][0]:.2f} | {t[k][0] / t['plain'][0]:.2f}×"
                 for k in ("simoe_train", "simoe_sampled", "simoe_eval")]
        rows.append(f"| {d_in}→{d_out} | {1e3 * t['plain'][0]:.2f} | " + " | ".join(cells)
                    + f" | {100 * max(n for _, n in t.values()):.0f} % |")
    mem = {s: memory(s, args.layers) for s in ("dense", "simoe", "upcycle")}
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    mrows = [f"| {s} | {m['params']:,} | {m['trainable']:,} | {gib(m['state_bytes'])} | {gib(m['peak_rss_growth'])} | "
             f"{m['state_bytes'] / mem['upcycle']['state_bytes']:.2f}× | "
             f"{m['peak_rss_growth'] / mem['upcycle']['peak_rss_growth']:.2f}× |" for s, m in mem.items()]
    cmd = ".venv/bin/python bench/simoe_layer.py" + (f" --write {args.write}" if args.write else "")
    section = "\n".join([
        MARK[0], "## SIMoE layer cost (bench/simoe_layer.py)", "",
        f"`{cmd}` — {date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, fp32. "
        f"Forward: {args.tokens[0]}×{args.tokens[1]} tokens, M = {M}, instance routing, median of {args.repeats} "
        "interleaved repeats (noise = the largest (p75 − p25) / median of the row). Target: SIMoE ≤ 2.2× plain.",
        "",
        "| shape | plain (ms) | SIMoE train, median gates (ms) | ratio | SIMoE train, sampled gates (ms) | ratio "
        "| SIMoE eval (ms) | ratio | noise |", "|---" * 9 + "|",
        *rows, "",
        f"Training memory, Llama with SmolLM2-135M widths and {args.layers} blocks, 3 AdamW steps on 4×128 tokens, "
        "one process per system. Target: SIMoE ≤ 0.7× sparse upcycling (M = 8).", "",
        "| system | parameters | trainable | params+grads+AdamW (GiB) | peak RSS growth (GiB) | state vs upcycling "
        "| RSS vs upcycling |", "|---|---|---|---|---|---|---|", *mrows, "", MARK[1]])
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
