"""Streaming upcycle at real sizes, side by side with mergekit-moe, in one run.

Generates (never downloads) bfloat16 Llama checkpoints with random weights, tensor by tensor, then:

A. 0.66B (TinyLlama-like: hidden 2048, intermediate 5632, 12 layers, 32k vocab), 4 experts per FFN, every
   layer, naive copies, to Mixtral: `moekit upcycle --format mixtral` vs mergekit-moe 0.1.5 (pip-installed into
   its own venv under --work; `gate_mode: random`, `dtype: bfloat16`, the base model as every expert,
   --lazy-unpickle) vs the I/O limit (a fresh process reading the input and writing as many bytes as the
   output, fsynced); each a fresh process under /usr/bin/time -v (wall, peak RSS), interleaved, median of
   --repeats; both outputs' logits (plain transformers, float32) against the dense model's.
B. The same model, SPRI E=8, top-2, every 4th block, shared expert, `--format auto` (-> qwen2_moe): wall,
   peak RSS, and its logits against the in-memory path (moekit.upcycle on the float32 model, cast to bf16).
C. Once, an 8B shape (hidden 4096, intermediate 14336, 32 layers, 128k vocab), same SPRI spec, where the
   in-memory path cannot run on this machine: wall and peak RSS.

    .venv/bin/python bench/upcycle_scale.py --work /tmp/upcycle_scale --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from datetime import date
from pathlib import Path

from report import write_section  # bench/report.py

MARK = ("<!-- upcycle_scale -->", "<!-- /upcycle_scale -->")
SHAPES = {"0.66B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, vocab_size=32000,
                        num_attention_heads=32, num_key_value_heads=4),
          "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=128256,
                     num_attention_heads=32, num_key_value_heads=8)}
SPRI = ["--method", "spri", "--experts", "8", "--top-k", "2", "--every", "4", "--shared-expert", "--format", "auto"]
PY = sys.executable


def make_dense(folder: Path, shape: dict, seed: int = 0) -> Path:
    """A bf16 LlamaForCausalLM checkpoint with N(0, 0.02) weights (norms 1), written one tensor at a time, and
    a small character tokenizer."""
    import torch
    import transformers as tf

    from moekit.checkpoint.writer import Planned, ShardWriter
    from moekit.checkpoint.format import unique_tensors
    from moekit.testing import tiny_tokenizer

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = tf.LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16",
                            architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    kept, _ = unique_tensors(model)
    writer = ShardWriter(tmp, [Planned(k, tuple(v.shape), torch.bfloat16) for k, v in kept.items()])
    gen = torch.Generator().manual_seed(seed)
    for k, v in kept.items():
        t = torch.ones(v.shape) if k.endswith("norm.weight") else torch.randn(v.shape, generator=gen) * 0.02
        writer.write(k, t)
    writer.close()
    config.save_pretrained(tmp)
    tiny_tokenizer().save_pretrained(tmp)  # mergekit-moe copies the base model's tokenizer
    tmp.rename(folder)
    return folder


TIME = Path("/usr/bin/time")  # GNU time, for the peak RSS; a bare GPU image may not have it


def timed(cmd: list[str]) -> dict:
    """Run `cmd` under /usr/bin/time -v in a fresh process: wall seconds, peak RSS bytes (None on a machine without
    GNU time), output."""
    t0 = time.perf_counter()
    res = subprocess.run([*([TIME, "-v"] if TIME.exists() else []), *map(str, cmd)], capture_output=True, text=True,
                         env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{res.stderr[-3000:]}")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr)
    return {"wall": wall, "rss": int(found.group(1)) * 1024 if found else None, "stdout": res.stdout}


def size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


IO_LIMIT = textwrap.dedent('''
    import os, sys
    src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    chunk = 64 << 20
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb", buffering=0) as f:
                while f.read(chunk):
                    pass
    block = bytes(chunk)
    with open(dst, "wb", buffering=0) as f:
        while n > 0:
            n -= f.write(block[:min(n, chunk)])
        os.fsync(f.fileno())
''')

LOGITS = textwrap.dedent('''
    import json, sys, torch, transformers as tf
    import moekit  # registers the moekit format with the Auto classes
    dense, others = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 16))
    def run(m):
        with torch.inference_mode():
            return m(input_ids=ids).logits.float()
    ref = run(tf.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32))
    out = {}
    for d in others:
        m = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        out[d] = [type(m).__name__, float((run(m) - ref).abs().max())]
        del m
    print(json.dumps(out))
''')

SPRI_REF = textwrap.dedent('''
    import json, sys, torch, transformers as tf
    from moekit.checkpoint.dense import load_dense
    from moekit.moe.spec import MoESpec
    from moekit.checkpoint.upcycle_model import upcycle
    dense, native = sys.argv[1], sys.argv[2]
    spec = MoESpec(num_experts=8, top_k=2, every=4, shared_expert=True, init="spri")
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 16))
    ref = upcycle(load_dense(dense), spec)  # the in-memory path, its weights rounded as stored (buffers such as
    with torch.no_grad():                    # RoPE's inv_freq stay float32, as in a model loaded from disk)
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    with torch.inference_mode():
        a = ref(input_ids=ids).logits
    del ref
    m = tf.AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32)
    with torch.inference_mode():
        b = m(input_ids=ids).logits
    print(json.dumps([type(m).__name__, float((a - b).abs().max())]))
''')


def mergekit(work: Path) -> Path:
    """mergekit-moe 0.1.5 in its own venv (torch pinned to the local CPU wheel first)."""
    venv = work / "mergekit-venv"
    exe = venv / "bin" / "mergekit-moe"
    if not exe.is_file():
        subprocess.run([PY, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "mergekit==0.1.5"], check=True)
    return exe


def run_a(work: Path, dense: Path, repeats: int) -> dict:
    exe = mergekit(work)
    cfg = work / "mergekit.yml"
    cfg.write_text(json.dumps({"base_model": str(dense), "gate_mode": "random", "dtype": "bfloat16",
                               "experts_per_token": 2, "experts": [{"source_model": str(dense)}] * 4}))
    jobs = {
        "moekit": lambda out: [PY, "-m", "moekit", "upcycle", "--model", dense, "--method", "naive", "--experts", 4,
                               "--top-k", 2, "--format", "mixtral", "--out", out],
        "mergekit-moe": lambda out: [exe, cfg, out, "--lazy-unpickle", "--quiet",
                                     "--i-understand-this-is-not-useful-without-training"],
    }
    runs: dict[str, list] = {name: [] for name in [*jobs, "io limit"]}
    for r in range(repeats):
        for name, cmd in jobs.items():
            out = work / f"a_{name}"
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(timed(cmd(out)))
        nbytes = size(work / "a_moekit")
        runs["io limit"].append(timed([PY, "-c", IO_LIMIT, dense, work / "io.bin", nbytes]))
        (work / "io.bin").unlink()
    check = json.loads(timed([PY, "-c", LOGITS, dense, work / "a_moekit", work / "a_mergekit-moe"])["stdout"])
    nbytes = {"moekit": size(work / "a_moekit"), "mergekit-moe": size(work / "a_mergekit-moe")}
    for name in jobs:
        shutil.rmtree(work / f"a_{name}")  # the 8B run needs the disk
    return {name: {"wall": statistics.median(x["wall"] for x in rs), "rss": statistics.median(x["rss"] for x in rs),
                   "walls": [x["wall"] for x in rs]} for name, rs in runs.items()} | {
        "bytes": nbytes, "logits": {("moekit" if k.endswith("a_moekit") else "mergekit-moe"): v
                                    for k, v in check.items()}}


def run_spri(work: Path, dense: Path, name: str, check: bool) -> dict:
    out = work / f"spri_{name}"
    shutil.rmtree(out, ignore_errors=True)
    r = timed([PY, "-m", "moekit", "upcycle", "--model", dense, *SPRI, "--out", out])
    fmt = re.search(r"format (\w+):", r["stdout"]).group(1)
    result = {"wall": r["wall"], "rss": r["rss"], "bytes": size(out), "format": fmt}
    if check:
        result["logits"] = json.loads(timed([PY, "-c", SPRI_REF, dense, out])["stdout"])
    shutil.rmtree(out)
    return result


def table(a: dict, b: dict, c: dict | None) -> list[str]:
    io = a["io limit"]["wall"]
    mk, me = a["mergekit-moe"], a["moekit"]
    lines = ["| run | wall (s) | × I/O limit | × mergekit | peak RSS (GB) | × mergekit | output (GB) | check |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("moekit", "mergekit-moe"):
        x, cls_diff = a[name], a["logits"][name]
        lines.append(f"| A: {name} → Mixtral | {x['wall']:.1f} | {x['wall'] / io:.2f} | {x['wall'] / mk['wall']:.2f} | "
                     f"{x['rss'] / 1e9:.2f} | {x['rss'] / mk['rss']:.2f} | {a['bytes'][name] / 1e9:.3f} | "
                     f"{cls_diff[0]}: max abs Δlogits vs dense {cls_diff[1]:.1e} |")
    lines.append(f"| A: I/O limit (read input, write {a['bytes']['moekit'] / 1e9:.2f} GB, fsync) | {io:.1f} | 1.00 | "
                 f"{io / mk['wall']:.2f} | {a['io limit']['rss'] / 1e9:.2f} | | | |")
    lines.append(f"| B: moekit SPRI E=8 every 4 shared, auto → {b['format']} | {b['wall']:.1f} | {b['wall'] / io:.2f} | | "
                 f"{b['rss'] / 1e9:.2f} | | {b['bytes'] / 1e9:.3f} | {b['logits'][0]}: max abs Δlogits vs in-memory "
                 f"{b['logits'][1]:.1e} |")
    if c is not None:
        lines.append(f"| C: moekit 8B shape, same SPRI spec → {c['format']} | {c['wall']:.1f} | | | {c['rss'] / 1e9:.2f} | | "
                     f"{c['bytes'] / 1e9:.2f} | |")
    lines.append("")
    lines.append(f"Walls per repeat (A): moekit {', '.join(f'{w:.1f}' for w in me['walls'])}; mergekit-moe "
                 f"{', '.join(f'{w:.1f}' for w in mk['walls'])}; I/O limit "
                 f"{', '.join(f'{w:.1f}' for w in a['io limit']['walls'])}.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/upcycle_scale"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    small = make_dense(args.work / "dense-0.66B", SHAPES["0.66B"])
    a = run_a(args.work, small, args.repeats)
    b = run_spri(args.work, small, "0.66B", check=True)
    c = None
    if not args.skip_8b:
        big = make_dense(args.work / "dense-8B", SHAPES["8B"])
        c = run_spri(args.work, big, "8B", check=False)
    (args.work / "results.json").write_text(json.dumps({"a": a, "b": b, "c": c}, indent=1))
    import torch
    import transformers

    lines = [MARK[0], "## Upcycling at real sizes, beside mergekit-moe (bench/upcycle_scale.py)", "",
             f"`{' '.join(sys.argv)}` — {date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, transformers {transformers.__version__}, mergekit-moe 0.1.5; random bf16 "
             f"Llama checkpoints; median of {args.repeats} interleaved repeats for A; peak RSS from /usr/bin/time -v.",
             "", *table(a, b, c), MARK[1]]
    print("\n".join(lines))
    if args.write:
        write_section(args.write, "\n".join(lines), MARK)


if __name__ == "__main__":
    main()
