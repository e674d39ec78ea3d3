"""Whole-model throughput: an upcycled SmolLM2-135M-shaped model in moekit's form vs the same weights in
transformers' native MoE classes (eager and grouped_mm experts). Qwen3-MoE needs a Qwen3 source (q/k
norms); a Llama source exports to Mixtral (every layer MoE) and to Qwen2-MoE (dense layers kept, zero q/k/v
biases, and always a shared expert: so the every-4th-layer model gets a gated shared expert in both forms).

The dense model is a LlamaConfig with SmolLM2-135M's sizes and random weights (no download), or --dense DIR
(e.g. the cached `moekit.assets` smollm2-135m conversion). It is upcycled with E=8/top-2 in every 4th layer
(vs Qwen2-MoE) and in every layer (vs Mixtral). The native models are built
from moekit's exporter config and hold *the same Parameter objects* as the moekit model (load_state_dict
assign=True), so one AdamW and one copy of the weights serve every system: memory stays at one model's, and
all systems see the same weights. Their logits are checked equal to moekit's before timing.

Measured, interleaved across systems, median of --repeats after one warm-up each: a training step (forward,
LM loss, backward, AdamW step) on --batch × --seq tokens, and the same with the router losses each side trains
with (moekit: MoETrainer's, load balance + z-loss with per-layer logs; native: output_router_logits=True, its
load_balancing_loss_func); prefill (no-grad forward with cache) on the same
tokens; greedy generation of --new tokens after a 32-token prompt at batch 1 and 8 (prompt included).
Every cell says how noisy it was ((p75 − p25) / median). Each finished row is kept in --out, one file per
configuration, so an interrupted run (the full table took 32 minutes on 2 idle cores) resumes where it stopped.

    .venv/bin/python bench/model_throughput.py --write BENCHMARKS.md
    .venv/bin/python bench/model_throughput.py --quick      # sanity run: 4 layers, small batches

On a GPU (`--device cuda --dtype bfloat16`, its own section): peak memory per task beside tokens/s, every step
synchronized before the clock is read, and `--qwen3` adds a random Qwen3-MoE-shaped model (a Qwen3 dense of
--qwen3-layers layers, H=1024, FFN 384, upcycled to E=64 top-8 in every layer, against transformers' native
Qwen3-MoE holding the same Parameters).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import time
from collections import defaultdict
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

from moekit._fs import write_text_atomic
from moekit.checkpoint.export.base import EXPORTERS
from moekit.moe.spec import MoESpec
from moekit.checkpoint.upcycle_model import upcycle
from moekit.methods import method
from moekit.moe.layer import moe_layers
from moekit.training.recipe import AuxConfig
from report import spread, write_section  # bench/report.py

MARK = ("<!-- model_throughput -->", "<!-- /model_throughput -->")
MARK_CUDA = ("<!-- model_throughput_cuda -->", "<!-- /model_throughput_cuda -->")
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")
NATIVE_NAMES = [(r"\.mlp\.router\.weight$", ".mlp.gate.weight"), (r"\.mlp\.experts\.gate_up$", ".mlp.experts.gate_up_proj"),
                (r"\.mlp\.experts\.down$", ".mlp.experts.down_proj"), (r"\.mlp\.shared\.", ".mlp.shared_expert."),
                (r"\.mlp\.shared_gate\.weight$", ".mlp.shared_expert_gate.weight")]
PROMPT = 32


def dense_model(layers: int, dense_dir: Path | None):
    if dense_dir is not None:
        from moekit.checkpoint.dense import load_dense

        return load_dense(dense_dir)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers}))


def moekit_model(layers: int, every: int | None, dense_dir: Path | None):
    """Every layer: Mixtral's form. Every 4th: Qwen2-MoE's (a gated shared expert; its only Llama-source
    native class with dense layers, which always runs a shared expert)."""
    spec = MoESpec(num_experts=8, top_k=2, every=every, init="noise", shared_expert=every is not None,
                   shared_gate=every is not None, router={"init": "normal", "scoring": "topk_softmax"})
    return upcycle(dense_model(layers, dense_dir), spec)


def qwen3_moe_model(layers: int):
    """A random Qwen3 dense model (H=1024, FFN 384, 16 heads, 8 KV heads) upcycled to E=64 top-8 in every layer:
    Qwen3-MoE's layer shape at 1-2B parameters, exported against transformers' Qwen3-MoE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=384, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    spec = MoESpec(num_experts=64, top_k=8, init="noise", shared_expert=False,
                   router={"init": "normal", "scoring": "topk_softmax"})
    return upcycle(Qwen3ForCausalLM(cfg), spec)


def native_model(model, fmt: str):
    """`fmt`'s native class holding the moekit model's own Parameter objects (no copy of the weights)."""
    exporter = EXPORTERS.get(fmt)
    plan = exporter.plan(model)
    with no_init_weights():
        native = exporter.native(exporter.config(model, plan))
    state = exporter.extra_tensors(model, plan)  # e.g. Qwen2-MoE's zero q/k/v biases
    for name, p in model.named_parameters(remove_duplicate=False):
        for pattern, repl in NATIVE_NAMES:
            name = re.sub(pattern, repl, name)
        state[name] = p
    native.load_state_dict(state, strict=True, assign=True)
    native.to(next(model.parameters()).device)  # its buffers (rotary frequencies) were made on the CPU
    native.generation_config = model.generation_config
    return native


def systems(model, every: int | None, fmt: str | None = None, impls=("eager", "grouped_mm")) -> dict:
    """{name: (model, experts implementation or None)}; Mixtral only where every layer is MoE."""
    out = {"moekit": (model, None)}
    fmt = fmt or ("mixtral" if every is None else "qwen2_moe")
    native = native_model(model, fmt)
    for impl in impls:
        out[f"{fmt} {impl}"] = (native, impl)
    return out


def check_equal(syss: dict, ids: torch.Tensor, tol: float = 1e-4) -> None:
    """Every system's logits equal moekit's: elementwise (fp32), or as a whole (bf16: ‖a − b‖ / ‖b‖ ≤ tol)."""
    with torch.no_grad():
        ref = None
        for name, (m, impl) in syss.items():
            select(m, impl).eval()
            logits = m(ids).logits.float()
            if ref is None:
                ref = logits
            if tol == 1e-4:
                torch.testing.assert_close(logits, ref, rtol=tol, atol=tol, msg=lambda s: f"{name}: {s}")
            else:
                err = ((logits - ref).norm() / ref.norm()).item()
                assert err <= tol, f"{name}: logits differ from moekit's by {err:.3g} (relative norm)"


def select(m, impl: str | None):
    if impl is not None:
        m.set_experts_implementation(impl)
    return m


def train_step(m, opt, ids, trainer=None):
    """One training step; with `trainer` (aux, aux_logs) the router losses each side trains with: moekit's
    MoETrainer losses and logs (λ_lb·LB + λ_z·Z, per-layer LB, z, usage entropy and max load;
    MoEMethod.extra_loss), the native class's own (output_router_logits=True: its load_balancing_loss_func,
    weighted by router_aux_loss_coef)."""
    m.train()
    if trainer is None:
        loss = m(ids, labels=ids).loss
    elif moe_layers(m):
        loss = m(ids, labels=ids).loss + method("moe").extra_loss(trainer, m, None)
        trainer.aux_logs.clear()  # MoETrainer reads them back at each log (every logging_steps): not timed here
    else:
        loss = m(ids, labels=ids, output_router_logits=True).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def prefill(m, ids):
    m.eval()
    with torch.no_grad():
        m(ids, use_cache=True)


def generate(m, ids, new):
    m.eval()
    m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(syss: dict, fn, repeats: int) -> dict:
    """{system: (median s, IQR / median, peak GPU bytes or None)}: fn(model) interleaved across systems, one
    warm-up each; on a GPU each call is synchronized and the allocator's peak is reset before it."""
    times, peak = {n: [] for n in syss}, {n: None for n in syss}
    cuda = torch.cuda.is_available()
    for r in range(repeats + 1):
        for name, (m, impl) in syss.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            fn(select(m, impl))
            sync()
            if r:
                times[name].append(time.perf_counter() - t0)
                peak[name] = torch.cuda.max_memory_allocated() if cuda else None
    return {n: (*spread(t), peak[n]) for n, t in times.items()}


TASKS = ("train step", "prefill", "generate b=1", "generate b=8")
AUX_TASK = "train step + router losses"  # measured since 2026-11-28: rows of earlier runs have none


def profile_generation(syss: dict, prompt: torch.Tensor, label: str, folder: Path) -> None:
    """torch.profiler's table of one greedy generation (batch 1, 8 new tokens) per system, sorted by self CPU time:
    where the per-token host time goes (on a GPU, generation is launch- and host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name, (m, impl) in syss.items():
        generate(select(m, impl), prompt, 8)  # warm-up
        sync()
        with profile(activities=activities) as prof:
            generate(m, prompt, 8)
            sync()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "generate_profile.txt", "a") as f:
            f.write(f"\n### {label}, {name}: generate b=1, 8 new tokens\n{table}\n")


def measure(label: str, model, every: int | None, args, done: dict, save, fmt: str | None = None) -> None:
    """Time every task of TASKS not yet in `done` ({task: row}, rows of an earlier interrupted run), adding
    each row to it and calling save() as soon as it is measured."""
    device = torch.device(args.device)
    model.to(device, getattr(torch, args.dtype))
    syss = systems(model, every, fmt, ("grouped_mm",) if device.type == "cuda" else ("eager", "grouped_mm"))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    prompts = {b: torch.randint(0, model.config.vocab_size, (b, PROMPT), generator=g).to(device) for b in (1, 8)}
    check_equal(syss, batch[:2, :32], 1e-4 if args.dtype == "float32" else 2e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    trainer = SimpleNamespace(aux=AuxConfig(), aux_logs=defaultdict(list))
    tasks = [("train step", args.batch * args.seq, lambda m: train_step(m, opt, batch)),
             (AUX_TASK, args.batch * args.seq, lambda m: train_step(m, opt, batch, trainer)),
             ("prefill", args.batch * args.seq, lambda m: prefill(m, batch))]
    tasks += [(f"generate b={b}", b * args.new, lambda m, b=b: generate(m, prompts[b], args.new)) for b in (1, 8)]
    if args.profile is not None:
        profile_generation(syss, prompts[1], label, args.profile)
    for task, tokens, fn in tasks:
        if task not in done:
            t = timed(syss, fn, args.repeats)
            done[task] = (label, task, {n: (tokens / s, noise, mem) for n, (s, noise, mem) in t.items()})
            print(done[task], flush=True)
            save()


def render(rows: list[tuple], args, cmd: str, load: str) -> str:
    names = ["moekit", "mixtral eager", "mixtral grouped_mm", "qwen2_moe eager", "qwen2_moe grouped_mm"]
    out = [MARK[0], "## Whole-model throughput (bench/model_throughput.py)", "",
           f"`{cmd}` — {date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
           f"{torch.__version__}, transformers {transformers.__version__}, fp32, {args.layers} layers; load average "
           f"{load} (start → end). Tokens/s, median of {args.repeats} interleaved repeats after one warm-up "
           f"(noise = (p75 − p25) / median). Train step and prefill: {args.batch} × {args.seq} tokens; generate: "
           f"greedy, {PROMPT}-token prompt + {args.new} new tokens, prompt time included. ratio = moekit / the "
           "faster native system. All systems share one set of weights; logits checked equal before timing.", "",
           "| model | task | " + " | ".join(names) + " | ratio |", "|---|---|" + "---|" * (len(names) + 1)]
    for label, task, res in rows:
        cells = [f"{res[n][0]:.1f} (±{100 * res[n][1]:.0f} %)" if n in res else "—" for n in names]
        best_native = max(v[0] for n, v in res.items() if n != "moekit")
        out.append(f"| {label} | {task} | " + " | ".join(cells) + f" | {res['moekit'][0] / best_native:.2f}× |")
    return "\n".join(out + ["", MARK[1]])


def render_cuda(rows: list[tuple], args, cmd: str, env: dict) -> str:
    out = [MARK_CUDA[0], "## Whole-model throughput on a GPU (bench/model_throughput.py)", "",
           f"`{cmd}` — {env['date']}, {env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
           f"{args.dtype} weights and AdamW states (no fp32 master copy), SmolLM2 rows {args.layers} layers. "
           f"Tokens/s (peak GPU memory allocated during the task), median of {args.repeats} interleaved repeats after "
           f"one warm-up, each synchronized (noise = (p75 − p25) / median). Train step and prefill: {args.batch} × "
           f"{args.seq} tokens; generate: greedy, {PROMPT}-token prompt + {args.new} new tokens. native = "
           "transformers' own class with `grouped_mm` experts holding the same Parameters; ratio = moekit's "
           "tokens/s / native's; logits checked against moekit's before timing (relative norm ≤ 2e-2 in bf16)."
           + (f" \"{AUX_TASK}\": moekit with MoETrainer's load balance + z-loss and per-layer logs, native with "
              "output_router_logits=True (its load_balancing_loss_func)." if any(r[1] == AUX_TASK for r in rows)
              else ""), "",
           "| model (native class) | task | moekit | native grouped_mm | ratio | peak memory moekit / native |",
           "|---|---|---|---|---|---|"]
    for label, task, res in rows:
        (native_name, native), = [(n, v) for n, v in res.items() if n != "moekit"]
        ours = res["moekit"]
        cell = lambda v: f"{v[0]:,.0f} ({v[2] / 2**30:.2f} GiB, ±{100 * v[1]:.0f} %)"  # noqa: E731
        out.append(f"| {label} ({native_name.split()[0]}) | {task} | {cell(ours)} | {cell(native)} | "
                   f"{ours[0] / native[0]:.2f}× | {ours[2] / native[2]:.2f}× |")
    return "\n".join(out + ["", MARK_CUDA[1]])


def loadavg() -> str:
    p = Path("/proc/loadavg")
    return p.read_text().split()[0] if p.exists() else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dense", type=Path, help="a dense SmolLM2-135M directory instead of random weights")
    ap.add_argument("--quick", action="store_true", help="sanity run: 4 layers, batch 2 × 64, 8 new tokens, 3 repeats")
    ap.add_argument("--write", type=Path, help="update this markdown file's model_throughput section")
    ap.add_argument("--out", type=Path, default=Path("runs/model_throughput"), help="finished rows, for resuming")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--qwen3", action="store_true", help="add the Qwen3-MoE-shaped model (E=64 top-8)")
    ap.add_argument("--qwen3-layers", type=int, default=24)
    ap.add_argument("--only-every-layer", action="store_true", help="skip the every-4th-layer SmolLM2 model")
    ap.add_argument("--report-only", action="store_true", help="render the table from --out's finished rows")
    ap.add_argument("--profile", type=Path, help="write torch.profiler tables of a batch-1 generation to "
                                                 "DIR/generate_profile.txt")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.batch, args.seq, args.new, args.repeats = 4, 2, 64, 8, 3
    # finished rows are kept in --out (one file per configuration), so an interrupted run resumes
    config = (f"layers{args.layers}-b{args.batch}-s{args.seq}-new{args.new}-r{args.repeats}-{args.dense or 'random'}"
              f"-{args.device}-{args.dtype}")
    cache = args.out / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', config)}.json"
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    if args.device != "cpu" and "env" not in done:  # what the rows were measured on, for --report-only
        from report import device_name

        done["env"] = {"device": device_name(torch.device(args.device)), "torch": torch.__version__,
                       "transformers": transformers.__version__, "date": str(date.today())}

    def save():
        args.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache, json.dumps(done))

    load, rows = loadavg(), []
    models = [] if args.only_every_layer else [("E=8 top-2 + gated shared, every 4th layer", 4, None)]
    models.append(("E=8 top-2, every layer", None, None))
    if args.qwen3:
        models.append((f"Qwen3-MoE shape, {args.qwen3_layers} layers, E=64 top-8", None, "qwen3_moe"))
    for label, every, fmt in models:
        rows_of = done.setdefault(label, {})
        if args.report_only and any(t not in rows_of for t in TASKS):
            raise SystemExit(f"{cache} has no finished rows of {label}: run it without --report-only")
        if any(t not in rows_of for t in TASKS):
            model = (qwen3_moe_model(args.qwen3_layers) if fmt else moekit_model(args.layers, every, args.dense))
            measure(label, model, every, args, rows_of, save, fmt)
            del model
        rows += [rows_of[t] for t in (TASKS[0], AUX_TASK, *TASKS[1:]) if t in rows_of]
    gpu = args.device != "cpu"
    cmd = (f"{'python' if gpu else '.venv/bin/python'} bench/model_throughput.py"
           + (" --quick" if args.quick else f" --layers {args.layers} --repeats {args.repeats}")
           + (f" --batch {args.batch} --seq {args.seq} --device {args.device} --dtype {args.dtype}" if gpu else "")
           + (f" --qwen3 --qwen3-layers {args.qwen3_layers}" if args.qwen3 else "")
           + (" --only-every-layer" if args.only_every_layer else "")
           + (f" --write {args.write}" if args.write else ""))
    section = render_cuda(rows, args, cmd, done["env"]) if gpu else render(rows, args, cmd, f"{load} → {loadavg()}")
    print(section)
    if args.write:
        write_section(args.write, section, MARK_CUDA if gpu else MARK)


if __name__ == "__main__":
    main()
