"""Bigger than memory (issue 29): routing analysis, RISE / REAP selection and expert removal of a Qwen3-30B-A3B-wide
MoE straight from its checkpoint, on a 2-core, 24 GB machine.

Checkpoints are generated, not downloaded: random bfloat16 weights (N(0, 0.02²), norms 1) of Qwen3-30B-A3B's width
(hidden 2048, 128 experts of moe_intermediate 768, top-8, 32 heads / 4 kv heads of 128, vocab 151936, untied head)
in the Hub's classic per-expert layout, written tensor by tensor; 12 of its 48 layers, and a 4-layer cut with the
same first 4 layers (each tensor is seeded by its name). Texts: 3 languages x 64 verses of the Bible corpus moekit
ships, tokenized with SmolLM2's tokenizer (49152 ids, all inside the vocabulary): random weights, so the numbers
say what the machinery costs, nothing about any model's routing.

Each step runs as its own `moekit` process (wall and peak RSS from its final line, or /proc for the Python steps),
its result cached in OUT/results.json, so an interrupted run resumes:
  1. routes collect --stream on, 12 layers;
  2. the same 4-layer cut --stream on and --stream off (ids equal?, tokens/s ratio);
  3. select rise (target sw) and select reap --top 64 on the 12-layer trace; prune --keep to 64 experts; the
     pruned checkpoint loaded by transformers and run once;
  4. REAP's own scoring procedure (every expert on every token, as its reference code does; reimplemented from the
     paper's formula) vs moekit's routed-tokens capture on the 4-layer cut: wall, peak RSS, kept sets;
  5. the I/O limit of prune: reading the kept tensors and writing as many bytes.

    .venv/bin/python bench/big_moe.py --out /work/big_moe --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import zlib
from datetime import date
from pathlib import Path

import torch

from report import resumable, write_section  # bench/report.py

MARK = ("<!-- big_moe -->", "<!-- /big_moe -->")
WIDTH = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
             tie_word_embeddings=False, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
             dtype="bfloat16")
LANGS = {"en": "k", "fr": "l", "sw": "h"}
VERSES = 64
TOP = 64  # experts kept per layer
REPEATS = 2  # the timed pairs (streamed vs in-memory, prune vs its I/O limit), interleaved
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
             moe_intermediate_size=32, intermediate_size=128, vocab_size=49152)  # --small: a smoke test's width
MOEKIT = [sys.executable, "-m", "moekit"]


def tensors(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the classic-layout checkpoint, in the Hub's order."""
    H, E, I, V = WIDTH["hidden_size"], WIDTH["num_experts"], WIDTH["moe_intermediate_size"], WIDTH["vocab_size"]
    q, kv, d = WIDTH["num_attention_heads"] * WIDTH["head_dim"], WIDTH["num_key_value_heads"] * WIDTH["head_dim"], \
        WIDTH["head_dim"]
    out = [("model.embed_tokens.weight", (V, H)), ("lm_head.weight", (V, H)), ("model.norm.weight", (H,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (q, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate.weight", (E, H))]
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (I, H)), (p + f"mlp.experts.{e}.up_proj.weight", (I, H)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (H, I))]
    return out


def generate(folder: Path, layers: int) -> Path:
    """The random checkpoint (module docstring), written tensor by tensor with moekit's shard writer."""
    from transformers import Qwen3MoeConfig

    from moekit._fs import output
    from moekit.checkpoint.writer import Planned, ShardWriter

    if (folder / "config.json").is_file():
        return folder
    plan = tensors(layers)
    with output(folder, overwrite=True) as tmp:
        writer = ShardWriter(tmp, [Planned(n, s, torch.bfloat16) for n, s in plan])
        for n, (name, shape) in enumerate(plan):
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
            writer.write(name, t.to(torch.bfloat16))
            if n % 500 == 0:
                print(f"{folder.name}: {n}/{len(plan)} tensors", flush=True)
        writer.close()
        cfg = Qwen3MoeConfig(**{**WIDTH, "num_hidden_layers": layers})
        cfg.architectures = ["Qwen3MoeForCausalLM"]
        cfg.save_pretrained(tmp)
        smollm2_tokenizer(tmp)
    return folder


def smollm2_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer files (the built-in asset) into `folder`."""
    from moekit.assets import resolve_model

    smol = resolve_model("smollm2-135m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / f).is_file():
            (folder / f).write_bytes((smol / f).read_bytes())


def texts(folder: Path, verses: int | None = None) -> list[str]:
    from moekit.assets import bible_verses

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for lang, code in LANGS.items():
        path = folder / f"{lang}.txt"
        if not path.is_file():
            kept = bible_verses(code)[: verses or VERSES]
            path.write_text("\n".join(v.text for v in kept) + "\n")
        out.append(f"{lang}={path}")
    return out


def moekit(*args) -> dict:
    """Run a moekit command; its wall time (s) and, from its final line, peak RSS (GiB)."""
    start = time.perf_counter()
    res = subprocess.run([*MOEKIT, *map(str, args)], capture_output=True, text=True, env={**os.environ})
    if res.returncode != 0:
        raise SystemExit(f"moekit {' '.join(map(str, args))} failed:\n{res.stderr[-3000:]}")
    rss = re.findall(r"peak RSS ([\d.]+) GiB", res.stdout)
    return {"wall": time.perf_counter() - start, "rss": float(rss[-1]) if rss else None, "stdout": res.stdout[-500:]}


def python_step(code: str, *args) -> dict:
    """Run a Python snippet (it prints a JSON dict); its wall time and peak RSS (VmHWM) added."""
    start = time.perf_counter()
    full = code + "\nfrom moekit._fs import peak_memory\nRESULT['rss'] = peak_memory() / 2**30\nprint(json.dumps(RESULT))"
    res = subprocess.run([sys.executable, "-c", full, *map(str, args)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"step failed:\n{res.stderr[-3000:]}")
    return {**json.loads(res.stdout.splitlines()[-1]), "wall": time.perf_counter() - start}


LOAD_PRUNED = '''
import json, sys, torch, transformers as tf
m = tf.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
with torch.no_grad():
    out = m(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
RESULT = {"class": type(m).__name__, "experts": m.config.num_experts, "finite": bool(torch.isfinite(out).all())}
'''

REAP_REFERENCE = '''
import json, sys, time, torch, numpy as np
from moekit.checkpoint.dense import load_tokenizer
from moekit.checkpoint.format import load_model
from moekit.routing.sites import find_sites
from moekit.routing.streamed import batches_of
folder, top, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
model = load_model(folder, dtype=torch.bfloat16).eval()
tok = load_tokenizer(folder); tok.pad_token = tok.pad_token or tok.eos_token
texts = {f.split("=")[0]: open(f.split("=")[1]).read().split("\\n")[:-1] for f in files}
sites = find_sites(model)
sums = np.zeros((len(sites), sites[0].num_experts, 2))  # (L, E, [routed count, sum g*|f|])
state = {}
def hook(li):
    def fn(experts, args):
        if state.get("inside"):
            return
        state["inside"] = True
        x, ids, w = args[:3]
        keep = state["mask"]
        x, ids, w = x[keep], ids[keep], w[keep]
        T, E = x.shape[0], experts.num_experts
        for e in range(E):  # every expert on every token, as REAP's reference code does
            f = experts(x, torch.full((T, 1), e), torch.ones(T, 1, dtype=x.dtype)).float().norm(dim=-1)  # (T,)
            g = (w * (ids == e)).sum(-1).float()  # (T,) the weight the model gives e (0 where not routed)
            routed = (ids == e).any(-1)
            sums[li, e] += [float(routed.sum()), float((g * f)[routed].sum())]
        state["inside"] = False
    return fn
handles = [s.experts.register_forward_pre_hook(hook(i)) for i, s in enumerate(sites)]
start = time.perf_counter()
with torch.no_grad():
    for b in batches_of(tok, texts, 256, 8):
        state["mask"] = b.attention_mask.bool().reshape(-1)
        model(input_ids=b.input_ids, attention_mask=b.attention_mask)
saliency = np.divide(sums[..., 1], sums[..., 0], out=np.zeros(sums.shape[:2]), where=sums[..., 0] > 0)
order = np.argsort(-saliency, axis=1, kind="stable")[:, :top]
RESULT = {"kept": {s.name: sorted(map(int, order[i])) for i, s in enumerate(sites)},
          "seconds": time.perf_counter() - start}
'''

IO_LIMIT = '''
import json, re, sys, time, torch
from moekit.checkpoint.files import ShardReader
src, out, kept = sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())["experts"]
keep = {int(k.split(".")[2]): set(v) for k, v in kept.items()}  # decoder layer -> kept experts
start, n = time.perf_counter(), 0
with ShardReader(src) as r, open(out, "wb") as f:
    for name in r.keys():
        m = re.fullmatch(r"model\.layers\.(\d+)\..*\.experts\.(\d+)\..+", name)  # the Hub's per-expert tensors
        if m and int(m.group(2)) not in keep[int(m.group(1))]:
            continue
        t = r.get(name)
        f.write(t.view(torch.uint8).numpy().tobytes())
        n += t.numel() * t.element_size()
    f.flush(); import os; os.fsync(f.fileno())
RESULT = {"bytes": n, "seconds": time.perf_counter() - start}
'''


def run(out: Path) -> dict:
    results, step = resumable(out)

    big, cut = generate(out / "qwen3-30b-a3b-12L", 12), generate(out / "qwen3-30b-a3b-4L", 4)
    files = texts(out / "texts")
    results["bytes"] = {n: sum(f.stat().st_size for f in (out / n).glob("*.safetensors"))
                        for n in ("qwen3-30b-a3b-12L", "qwen3-30b-a3b-4L")}
    step("collect_12L", lambda: moekit("routes", "collect", "--model", big, "--texts", *files, "--out",
                                       out / "trace12.npz", "--stream", "on", "--overwrite"))
    for rep in range(REPEATS):  # interleaved: on, off, on, off; the faster of each is reported
        for mode in ("on", "off"):
            step(f"collect_4L_{mode}_{rep}", lambda mode=mode: moekit(
                "routes", "collect", "--model", cut, "--texts", *files, "--out", out / f"trace4_{mode}.npz",
                "--stream", mode, "--dtype", "bfloat16", "--overwrite"))
    step("select_rise", lambda: moekit("select", "rise", out / "trace12.npz", "--target", "sw", "--budget",
                                       WIDTH["num_experts"], "--out", out / "rise.json", "--overwrite"))
    step("select_reap", lambda: moekit("select", "reap", out / "trace12.npz", "--top", TOP, "--out",
                                       out / "reap.json", "--overwrite"))
    for rep in range(REPEATS):  # interleaved with its I/O limit; the faster of each is reported
        step(f"io_limit_{rep}", lambda: python_step(IO_LIMIT, big, out / "io_limit.bin", out / "reap.json"))
        (out / "io_limit.bin").unlink(missing_ok=True)
        step(f"prune_keep_{rep}", lambda: moekit("prune", "--model", big, "--experts", out / "reap.json", "--keep",
                                                 "--out", out / "pruned-12L", "--overwrite"))
    step("load_pruned", lambda: python_step(LOAD_PRUNED, out / "pruned-12L"))
    en = [f for f in files if f.startswith("en=")]  # REAP's procedure costs E/k times the MoE: one language
    step("collect_4L_en", lambda: moekit("routes", "collect", "--model", cut, "--texts", *en, "--out",
                                         out / "trace4_en.npz", "--stream", "off", "--dtype", "bfloat16",
                                         "--overwrite"))
    step("select_reap_4L", lambda: moekit("select", "reap", out / "trace4_en.npz", "--top", TOP, "--out",
                                          out / "reap4.json", "--overwrite"))
    step("reap_reference_4L", lambda: python_step(REAP_REFERENCE, cut, TOP, *en))
    return results


def tokens_of(trace: Path) -> int:
    import numpy as np

    with np.load(trace) as z:
        return int(z["token"].shape[0])


def section(results: dict, out: Path) -> str:
    import numpy as np

    from moekit.routing.trace import RoutingTrace

    t12, t_on, t_off = (RoutingTrace.load(out / n) for n in ("trace12.npz", "trace4_on.npz", "trace4_off.npz"))
    gb = {k: v / 1e9 for k, v in results["bytes"].items()}
    fastest = lambda name, key="wall": min((results[f"{name}_{r}"] for r in range(REPEATS)),  # noqa: E731
                                           key=lambda x: x[key])
    c12, on, off = results["collect_12L"], fastest("collect_4L_on"), fastest("collect_4L_off")
    moekit_kept = json.loads((out / "reap4.json").read_text())["experts"]
    ref = results["reap_reference_4L"]
    same = all(sorted(moekit_kept[k]) == v for k, v in ref["kept"].items())
    io, prune = fastest("io_limit", "seconds"), fastest("prune_keep")
    rows = [
        "| step | wall (s) | tokens/s | peak RSS (GiB) | note |", "|---|---|---|---|---|",
        f"| routes collect --stream on, 12 layers ({gb['qwen3-30b-a3b-12L']:.1f} GB) | {c12['wall']:.0f} | "
        f"{t12.num_tokens / c12['wall']:.0f} | {c12['rss']:.2f} | {c12['rss'] * 2**30 / 1e9 / gb['qwen3-30b-a3b-12L']:.2f}× "
        "the checkpoint's bytes |",
        f"| routes collect --stream on, 4-layer cut ({gb['qwen3-30b-a3b-4L']:.1f} GB) | {on['wall']:.0f} | "
        f"{t_on.num_tokens / on['wall']:.0f} | {on['rss']:.2f} | ids equal to --stream off: "
        f"{bool(np.array_equal(t_on.ids, t_off.ids))} |",
        f"| routes collect --stream off, 4-layer cut | {off['wall']:.0f} | {t_off.num_tokens / off['wall']:.0f} | "
        f"{off['rss']:.2f} | streamed / in-memory tokens/s: {off['wall'] / on['wall']:.2f} |",
        f"| select rise --target sw --budget {WIDTH['num_experts']} (12 layers) | {results['select_rise']['wall']:.1f} "
        "| | – | reads the trace only |",
        f"| select reap --top {TOP} (12 layers) | {results['select_reap']['wall']:.1f} | | – | reads the trace only |",
        f"| prune --keep to {TOP} experts (12 layers) | {prune['wall']:.0f} | | {prune['rss']:.2f} | "
        f"{prune['wall'] / io['seconds']:.2f}× the I/O limit ({io['seconds']:.0f} s to read the kept "
        f"{io['bytes'] / 1e9:.1f} GB and write as many bytes) |",
        f"| the pruned checkpoint in transformers (bfloat16, one forward) | {results['load_pruned']['wall']:.0f} | | "
        f"{results['load_pruned']['rss']:.2f} | {results['load_pruned']['class']}, "
        f"{results['load_pruned']['experts']} experts, finite logits: {results['load_pruned']['finite']} |",
        f"| REAP's procedure (every expert on every token), 4-layer cut, en only, in memory | {ref['wall']:.0f} | | "
        f"{ref['rss']:.2f} | kept sets equal to moekit's select reap: {same} |",
        f"| moekit's routes collect (routed tokens only) of the same, in memory | {results['collect_4L_en']['wall']:.0f} "
        f"| | {results['collect_4L_en']['rss']:.2f} | |",
    ]
    per_layer = c12["wall"] / 12
    return "\n".join([
        MARK[0], "## Bigger than memory: Qwen3-30B-A3B's width from the checkpoint", "",
        f"`.venv/bin/python bench/big_moe.py --out {out} --write BENCHMARKS.md` — {date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, beside other jobs (so the pairs compared, streamed vs in-memory "
        f"and prune vs its I/O limit, ran interleaved {REPEATS} times each, the faster reported). Random bfloat16 "
        f"weights of Qwen3-30B-A3B's width (hidden {WIDTH['hidden_size']}, {WIDTH['num_experts']} experts of "
        f"{WIDTH['moe_intermediate_size']}, top-8, 32/4 heads of 128, vocab 151936), 12 of its 48 layers, the Hub's "
        f"per-expert layout; {t12.num_tokens} tokens (3 languages x {VERSES} Bible verses, SmolLM2's tokenizer). Each step is "
        "its own process; peak RSS is its VmHWM.", "", *rows, "",
        f"Extrapolation, not a measurement: capture time is linear in layers, so 48 layers would take about "
        f"{per_layer * 48 / 60:.0f} min at {per_layer:.0f} s per layer, with the same peak memory (one layer resident; "
        "test_streamed checks that 2 and 6 layers of one width peak within 10 %).", MARK[1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/big_moe"))
    ap.add_argument("--write", type=Path, help="BENCHMARKS.md to update")
    ap.add_argument("--small", action="store_true", help="a tiny width and 4 verses per language (smoke test)")
    args = ap.parse_args()
    if args.small:
        global VERSES, TOP
        WIDTH.update(SMALL)
        VERSES, TOP = 4, 8
    results = run(args.out)
    text = section(results, args.out)
    print(text)
    if args.write:
        write_section(args.write, text, MARK)


if __name__ == "__main__":
    main()
