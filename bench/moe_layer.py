"""MoE FFN speed vs the physical limit and vs transformers' own v5 experts (eager and grouped_mm).

For each shape, all implementations get the same weights, the same routing (top_k_index,
top_k_weights) and the same upstream gradient; outputs and gradients are checked equal before
timing. Timings are interleaved across implementations in an order rotated every repeat, median of
--repeats after warm-up (of --decode-repeats at the decode sizes, which take milliseconds and are
noisier); each row says how noisy it was (the largest interquartile range / median over its
implementations).

Rows: --tokens tokens, fwd+bwd and fwd, limit = k × one dense FFN on the same tokens; decode sizes
(T = 1, 8, 64), fwd, limit = n_hit × one dense FFN on ⌈T·k / n_hit⌉ tokens, n_hit the distinct experts
touched (each one's weights must be read once). The router column is moekit's Router (+ load-balance
and z-loss, forward and backward, in fwd+bwd rows) as a share of the whole MoE layer (router + experts).

    .venv/bin/python bench/moe_layer.py --write BENCHMARKS.md
    python bench/moe_layer.py --device cuda --dtype bfloat16 --tokens 16384 --write BENCHMARKS.md   # a GPU
(its own section; every step synchronized with the GPU before the clock is read).

On a GPU the table gains moekit's two CUDA paths side by side ("moekit" = the default dispatch, moekit's
Triton kernels; "moekit grouped_mm" = torch's grouped_mm GEMMs with moekit's Triton SwiGLU), Liger-Kernel's fused
MoE where liger_kernel is installed (`make gpu-wheels` carries it), and the limit is
the roofline of the card as measured in the same run: max(model FLOPs / the measured dense bf16 GEMM rate,
bytes of the hit experts' weights / the measured device-to-device copy bandwidth). `--profile DIR` writes
torch.profiler's kernel-by-kernel table of each implementation's fwd+bwd step there, and of the router's
(with its load-balance and z-loss). Decode rows on a GPU add each forward replayed as a CUDA graph.
"""
from __future__ import annotations

import argparse
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from moekit.moe.losses import layer_stats
from moekit.moe.experts import Experts
from moekit.moe.router import Router
from report import device_name, spread, write_section  # bench/report.py

SHAPES = [  # (name, E, k, H, I)
    ("E=8/top-2/H=1024/I=3072", 8, 2, 1024, 3072),
    ("E=64/top-8/H=512/I=384", 64, 8, 512, 384),
]
DECODE = (1, 8, 64)
MARK = ("<!-- moe_layer -->", "<!-- /moe_layer -->")
MARK_CUDA = ("<!-- moe_layer_cuda -->", "<!-- /moe_layer_cuda -->")


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


class RouterAux(Router):
    """moekit's router with the training losses (as MoETrainer computes them, usage statistics included): what the
    MoE layer spends besides its experts."""

    def __init__(self, E, k, H):
        super().__init__(H, E, k, "topk_softmax")
        torch.nn.init.normal_(self.weight, std=H**-0.5, generator=torch.Generator().manual_seed(2))

    def forward(self, x, ids, w):
        info = super().forward(x)
        if not torch.is_grad_enabled():
            return info.topk_weights
        stats = layer_stats([info])  # what MoETrainer computes: LB, z-loss and the usage statistics it logs
        aux = stats["lb"][0] + stats["z"][0]
        return x[:, :1] * info.topk_weights.sum(-1, keepdim=True) + aux  # (T, 1): every output gets a gradient


class LigerExperts(torch.nn.Module):
    """Liger-Kernel's fused MoE experts (liger_kernel.ops.fused_moe, pure Triton, BSD-2; the issue's baseline to
    time against): transformers' weight layout, gate_up (E, 2I, H) and down (E, H, I). Its forward reads the
    number of row tiles back to the host (one `.item()` per call)."""

    def __init__(self, gate_up, down):
        super().__init__()
        import os

        if os.environ.get("TRITON_INTERPRET") == "1":  # its autotuner benchmarks on a GPU: one config instead
            os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        self.fn = LigerFusedMoEFunction
        self.gate_up, self.down = torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())

    def forward(self, x, ids, w):
        return self.fn.apply(x, self.gate_up, self.down, ids.int(), w)


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def build(name, E, k, H, I, gate_up, down):
    if name == "dense":
        return Dense(gate_up, down)
    if name == "router":
        return RouterAux(E, k, H)
    if name == "liger":
        return LigerExperts(gate_up, down)
    if name.startswith("moekit"):
        m = Experts(E, H, I, "silu", gated=True)
        m.gate_up.data.copy_(gate_up)
        m.down.data.copy_(down)
        m.dispatch = "grouped" if name == "moekit grouped_mm" else "auto"
        return m
    cfg = MixtralConfig(num_local_experts=E, num_experts_per_tok=k, hidden_size=H, intermediate_size=I,
                        hidden_act="silu", experts_implementation=name.removeprefix("hf_"))
    m = MixtralExperts(cfg)
    m.gate_up_proj.data.copy_(gate_up)
    m.down_proj.data.copy_(down)
    return m


def step(m, x, ids, w, grad, backward):
    if not backward:
        return m(x, ids, w), None
    x = x.detach().requires_grad_()
    y = m(x, ids, w)
    y.backward(grad[:, :y.shape[1]])
    return y, x.grad


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_grads(m):
    return [p.grad for p in m.parameters()]


def check_equal(mods, impls, x, ids, w, grad):
    ref_y, ref_gx = step(mods["moekit"], x, ids, w, grad, True)
    ref_gw = weight_grads(mods["moekit"])
    for name in impls[1:]:
        y, gx = step(mods[name], x, ids, w, grad, True)
        for a, b in [(y, ref_y), (gx, ref_gx), *zip(weight_grads(mods[name]), ref_gw)]:
            if a.dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            else:  # bf16 sums over thousands of tokens in another order: the tensors agree as a whole
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err <= 1e-2, f"relative error {err:.3g} between implementations"
    for m in mods.values():
        m.zero_grad(set_to_none=True)


def time_all(mods, inputs, backward, repeats):
    """{name: (median seconds, IQR / median)}; inputs {name: (x, ids, w, grad)}, run interleaved, the order
    rotated every repeat: in a fixed order, moekit and transformers' grouped_mm (the same CPU kernel at E=8
    decode sizes) read 3-5 % apart in three runs but equal when timed by themselves."""
    times, names = {n: [] for n in mods}, list(mods)
    device = next(iter(inputs.values()))[0].device
    for n, m in mods.items():  # warm-up
        step(m, *inputs[n], backward)
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            m = mods[n]
            m.zero_grad(set_to_none=True)
            sync(device)
            t0 = time.perf_counter()
            step(m, *inputs[n], backward)
            sync(device)
            times[n].append(time.perf_counter() - t0)
    return {n: spread(t) for n, t in times.items()}


def dense_tokens(ids, E, decode):
    """(units, tokens): the limit is units × one dense FFN on `tokens` tokens."""
    T, k = ids.shape
    if not decode:
        return k, T
    hit = int(torch.unique(ids).numel())
    return hit, -(-T * k // hit)


def roofline(x, ids, H, I, bwd, peak):
    """Seconds no implementation can beat on this card: max(model FLOPs / GEMM rate, hit experts' weight bytes /
    copy bandwidth); model FLOPs = 2·T·k·3·H·I per pass (gate, up, down), 3 passes with the backward."""
    T, k = ids.shape
    flops = 2 * T * k * 3 * H * I * (3 if bwd else 1)
    weight_bytes = int(torch.unique(ids).numel()) * 3 * H * I * x.element_size()
    return max(flops / peak["flops"], weight_bytes / peak["bandwidth"])


def graph_time(m, x, ids, w, repeats):
    """Median seconds of one replay (launch to synchronize) of m's forward captured in a CUDA graph, after a
    warm-up on a side stream (autotuning, probes); or the capture's error, shortened."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x, ids, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                m(x, ids, w)
        except RuntimeError as e:
            return f"capture fails: {str(e).splitlines()[0][:60]}"
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return spread(times)[0]


GRAPHED = ("moekit", "hf_grouped_mm")  # decode rows on a GPU: also timed as CUDA graph replays


def timed_row(label, mode, mods, impls, x, ids, w, grad, E, repeats, decode, peak=None):
    bwd = mode == "fwd+bwd"
    units, m = dense_tokens(ids, E, decode)
    inputs = {n: (x, ids, w, grad) for n in mods}
    inputs["dense"] = (x[:m], ids[:m], w[:m], grad[:m])
    with torch.set_grad_enabled(bwd):
        t = time_all(mods, inputs, bwd, repeats)
    H, I = mods["moekit"].hidden_size, mods["moekit"].intermediate_size
    limit = units * t["dense"][0] if peak is None else roofline(x, ids, H, I, bwd, peak)
    router = t["router"][0] / (t["router"][0] + t["moekit"][0])
    noise = max(v[1] for v in t.values())
    graphs = {n: graph_time(mods[n], x, ids, w, repeats) for n in GRAPHED} if decode and peak is not None else {}
    return (label, x.shape[0], mode, limit, {n: t[n][0] for n in impls}, router, noise, graphs)


IMPLS = ("moekit", "hf_eager", "hf_grouped_mm")
IMPLS_CUDA = ("moekit", "moekit grouped_mm", "hf_eager", "hf_grouped_mm", "liger")
NAMES = {"moekit": "moekit", "moekit grouped_mm": "moekit (grouped_mm GEMMs)", "hf_eager": "transformers eager",
         "hf_grouped_mm": "transformers grouped_mm", "liger": "Liger fused_moe"}


def peaks(device, dtype) -> dict:
    """The card's ceilings, measured now: an 8192³ matrix product's rate (FLOP/s) and a 2 GiB device-to-device
    copy's bandwidth (bytes read + written per second), medians of 10 after 3 warm-ups on random data."""
    from triton.testing import do_bench

    a, b = (torch.randn(8192, 8192, device=device, dtype=dtype) for _ in range(2))
    mm = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median") / 1e3
    src = torch.randn(2**30 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    cp = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") / 1e3
    return {"flops": 2 * 8192**3 / mm, "bandwidth": 2 * src.nbytes / cp}


def profile(mods, impls, x, ids, w, grad, label, folder: Path):
    """torch.profiler's per-kernel table of each implementation's (and the router's) fwd+bwd step (5 steps after
    2 warm-ups)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for n in (*impls, "router"):
        m = mods[n]
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            step(m, x, ids, w, grad, True)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                m.zero_grad(set_to_none=True)
                step(m, x, ids, w, grad, True)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        with open(folder / "profile.txt", "a") as f:
            f.write(f"\n### {label} fwd+bwd, {n}, 5 steps\n{table}\n")


def on(device, dtype, x, ids, w, grad):
    return x.to(device, dtype), ids.to(device), w.to(device, dtype), grad.to(device, dtype)


def run_shape(label, E, k, H, I, T, repeats, decode_repeats, device=torch.device("cpu"), dtype=torch.float32,
              peak=None, profile_dir=None):
    impls = [n for n in (IMPLS_CUDA if device.type == "cuda" else IMPLS) if n != "liger"]
    x, ids, w, gate_up, down, grad = make_inputs(E, k, H, I, T)
    mods = {n: build(n, E, k, H, I, gate_up, down).to(device, dtype) for n in ("dense", "router", *impls)}
    x, ids, w, grad = on(device, dtype, x, ids, w, grad)
    check_equal(mods, impls, x, ids, w, grad)
    if device.type == "cuda" and liger_installed():  # the baseline: a column only where it computes the same
        try:
            mods["liger"] = build("liger", E, k, H, I, gate_up, down).to(device, dtype)
            check_equal(mods, ["moekit", "liger"], x, ids, w, grad)
            impls.append("liger")
        except (AssertionError, RuntimeError, ImportError) as e:
            print(f"{label}: no Liger column ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            mods.pop("liger", None)
    if profile_dir is not None:
        profile(mods, impls, x, ids, w, grad, label, profile_dir)
    rows = [shown(timed_row(label, mode, mods, impls, x, ids, w, grad, E, repeats, False, peak))
            for mode in ("fwd+bwd", "fwd")]
    for t in DECODE:
        xd, idsd, wd, *_, gradd = make_inputs(E, k, H, I, t, seed=t)
        rows.append(shown(timed_row(label, "fwd", mods, impls, *on(device, dtype, xd, idsd, wd, gradd), E,
                                    decode_repeats, True, peak)))
    return rows


def shown(row):
    """`row`, printed at once (label, T, pass, median ms per implementation): a run stopped before the table is
    rendered (a device call's time limit) still has the rows it timed."""
    label, T, mode, _, times, *_ = row
    print(label, T, mode, "ms", {n: round(1000 * t, 4) for n, t in times.items()}, flush=True)
    return row


def render(rows, T, repeats, decode_repeats, cmd, load, device, dtype, mark, peak=None):
    impls = list(dict.fromkeys(n for row in rows for n in row[4]))  # a baseline may be missing from some shapes
    if peak is not None:
        return render_cuda(rows, impls, T, repeats, decode_repeats, cmd, load, device, dtype, mark, peak)
    out = [mark[0], "## MoE layer speed (bench/moe_layer.py)", "",
           f"`{cmd}` — {date.today()}, {device_name(device)}, torch "
           f"{torch.__version__}, transformers {transformers.__version__}, {str(dtype).removeprefix('torch.')}, median of "
           f"{repeats} interleaved repeats after warm-up ({decode_repeats} at decode sizes); load average {load} "
           "before → after. Outputs and "
           "gradients of all three implementations checked equal before timing (fp32: rtol/atol 1e-4; bf16: "
           "‖a − b‖ / ‖b‖ ≤ 1e-2 per tensor).", "",
           f"Ratio = time / limit. At {T} tokens the limit is k × the time of one dense FFN of the same shape "
           "on the same tokens; at decode sizes it is n_hit × one dense FFN on ⌈T·k/n_hit⌉ tokens (n_hit = "
           "distinct experts touched). router = moekit's router (+ load-balance and z-loss in fwd+bwd) as a "
           "share of router + experts. noise = the largest (p75 − p25) / median of the row's timings.", "",
           "| shape | T | pass | limit (ms) | moekit | transformers eager | transformers grouped_mm | router | noise |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, t, mode, limit, times, router, noise, _ in rows:
        cells = [f"{times[n] / limit:.2f}× ({1000 * times[n]:.3g} ms)" for n in impls]
        out.append(f"| {label} | {t} | {mode} | {1000 * limit:.3g} | " + " | ".join(cells)
                   + f" | {100 * router:.1f} % | {100 * noise:.0f} % |")
    return "\n".join(out + ["", mark[1]])


def render_cuda(rows, impls, T, repeats, decode_repeats, cmd, load, device, dtype, mark, peak):
    import triton

    out = [mark[0], "## MoE layer speed on a GPU (bench/moe_layer.py)", "",
           f"`{cmd}` — {date.today()}, {device_name(device)}, torch {torch.__version__}, Triton {triton.__version__}, "
           f"transformers {transformers.__version__}, {str(dtype).removeprefix('torch.')}, median of {repeats} "
           f"interleaved repeats after warm-up ({decode_repeats} at decode sizes), each step timed from its launch "
           f"to a device synchronize (host overhead included); load average {load} before → after. Outputs and "
           "gradients of every implementation checked against moekit's before timing (‖a − b‖ / ‖b‖ ≤ 1e-2 per "
           "tensor).", "",
           f"Ceilings measured in this run: an 8192³ {str(dtype).removeprefix('torch.')} matrix product at "
           f"{peak['flops'] / 1e12:.0f} TFLOP/s, a device-to-device copy at {peak['bandwidth'] / 1e12:.2f} TB/s "
           "(bytes read + written). limit = max(model FLOPs / that rate, the hit experts' weight bytes / that "
           "bandwidth); model FLOPs = 2·T·k·3·H·I per pass, 3 passes with the backward. Each cell: time / limit "
           "(time); \"vs grouped_mm\" = moekit's time / transformers grouped_mm's. router = moekit's router (+ "
           "load-balance and z-loss in fwd+bwd) as a share of router + experts. noise = the largest (p75 − p25) / "
           "median of the row's timings. Decode rows also time moekit's and transformers grouped_mm's forward "
           "captured once in a CUDA graph and replayed (the same inputs; launch to synchronize): what a caller "
           "that captures the layer (a static-cache `generate` under torch.compile) pays.", "",
           "| shape | T | pass | limit (ms) | " + " | ".join(NAMES[n] for n in impls)
           + " | moekit vs grouped_mm | " + " | ".join(f"{NAMES[n]}, CUDA graph" for n in GRAPHED)
           + " | graph: moekit vs grouped_mm | router | noise |", "|---" * (len(impls) + 10) + "|"]
    for label, t, mode, limit, times, router, noise, graphs in rows:
        cells = [f"{times[n] / limit:.2f}× ({1000 * times[n]:.3g} ms)" if n in times else "—" for n in impls]
        cells.append(f"{times['moekit'] / times['hf_grouped_mm']:.2f}×")
        cells += [f"{graphs[n] / limit:.2f}× ({1000 * graphs[n]:.3g} ms)" if isinstance(graphs.get(n), float)
                  else graphs.get(n, "—") for n in GRAPHED]
        both = all(isinstance(graphs.get(n), float) for n in GRAPHED)
        cells.append(f"{graphs['moekit'] / graphs['hf_grouped_mm']:.2f}×" if both else "—")
        out.append(f"| {label} | {t} | {mode} | {1000 * limit:.3g} | " + " | ".join(cells)
                   + f" | {100 * router:.1f} % | {100 * noise:.0f} % |")
    return "\n".join(out + ["", mark[1]])


def loadavg():
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--decode-repeats", type=int, default=200, help="repeats of the decode rows (milliseconds each)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--write", type=Path, help="update this markdown file's moe_layer section")
    ap.add_argument("--profile", type=Path, help="on a GPU: write torch.profiler's kernel tables to DIR/profile.txt")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gpu = device.type == "cuda"
    peak = peaks(device, dtype) if gpu else None
    load, rows = loadavg(), []
    for label, E, k, H, I in SHAPES:
        rows += run_shape(label, E, k, H, I, args.tokens, args.repeats, args.decode_repeats, device, dtype, peak,
                          args.profile if gpu else None)
    cmd = (f"{'python' if gpu else '.venv/bin/python'} bench/moe_layer.py --tokens {args.tokens} --repeats "
           f"{args.repeats} --decode-repeats {args.decode_repeats}"
           + (f" --device {args.device} --dtype {args.dtype}" if gpu or args.dtype != "float32" else "")
           + (f" --write {args.write}" if args.write else ""))
    mark = MARK_CUDA if gpu else MARK
    section = render(rows, args.tokens, args.repeats, args.decode_repeats, cmd, f"{load} → {loadavg()}", device,
                     dtype, mark, peak)
    print(section)
    if args.write:
        write_section(args.write, section, mark)


if __name__ == "__main__":
    main()
