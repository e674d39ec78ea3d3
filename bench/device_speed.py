"""Upcycling and routing capture on a GPU against the CPU, in one run (issue 38, item 5).

Generates (never downloads) a random bfloat16 Llama checkpoint (bench/upcycle_scale.py's make_dense; the 0.66B
shape by default), then times, each command in a fresh process under /usr/bin/time -v (wall, peak RSS), the
devices interleaved, median of --repeats:

- `moekit upcycle` SPRI (E=8, top-2, every 4th block, shared expert, `--format auto`: the SVD blocks are the
  arithmetic) with `--device` each of --devices;
- `moekit routes collect --stream on --dtype bfloat16` on that upcycled model, --texts random texts of
  --length characters, with `--device` each of --devices.

Checks before the table is written: the upcycled checkpoints of every device hold the same tensors (max |Δ|
relative to the largest |weight| ≤ 1e-2: the SVD runs in another order on the GPU), and the traces agree on
≥ 99 % of the top-k ids (near-ties may flip).

    python bench/device_speed.py --work /tmp/device_speed --write BENCHMARKS.md          # on a GPU
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from datetime import date
from pathlib import Path

from report import device_name, write_section  # bench/report.py
from upcycle_scale import SHAPES, SPRI, make_dense, timed

MARK = ("<!-- device_speed -->", "<!-- /device_speed -->")
MOEKIT = [sys.executable, "-m", "moekit"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=512, num_attention_heads=4,
            num_key_value_heads=2)


def tag(device: str) -> str:
    return device.replace(":", "")


def texts(path: Path, n: int, length: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["the", "light", "water", "day", "house", "walk", "good", "night", "river", "stone", "we", "is"]
    lines = []
    for _ in range(n):
        line = ""
        while len(line) < length:
            line += rng.choice(words) + " "
        lines.append(line[:length].strip())
    path.write_text("\n".join(lines) + "\n")
    return path


def run_all(work: Path, shape: dict, devices: list[str], repeats: int, n_texts: int, length: int) -> dict:
    """{(step, device): [runs]}: upcycle, then routes collect on the first device's checkpoint."""
    dense = make_dense(work / "dense", shape)
    corpus = texts(work / "en.txt", n_texts, length)
    runs: dict = {}
    for r in range(repeats):
        for device in devices[r % len(devices):] + devices[:r % len(devices)]:
            out = work / f"moe-{tag(device)}"
            cmd = [*MOEKIT, "upcycle", "--model", dense, "--out", out, *SPRI, "--device", device, "--overwrite"]
            runs.setdefault(("upcycle", device), []).append(timed(cmd))
    moe = work / f"moe-{tag(devices[0])}"
    for r in range(repeats):
        for device in devices[r % len(devices):] + devices[:r % len(devices)]:
            trace = work / f"trace-{tag(device)}.npz"
            cmd = [*MOEKIT, "routes", "collect", "--model", moe, "--texts", f"en={corpus}", "--out", trace,
                   "--stream", "on", "--dtype", "bfloat16", "--device", device, "--overwrite",
                   "--max-length", str(length)]
            runs.setdefault(("routes collect", device), []).append(timed(cmd))
    return runs


def checks(work: Path, devices: list[str]) -> list[str]:
    """One line per device after the first: how its checkpoint and trace compare with the first device's."""
    import numpy as np
    from safetensors.torch import load_file

    from moekit.routing.trace import RoutingTrace

    def tensors(device):
        out = {}
        for f in sorted((work / f"moe-{tag(device)}").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    def trace(device):
        return RoutingTrace.load(work / f"trace-{tag(device)}.npz")

    ref, ref_trace, lines = tensors(devices[0]), trace(devices[0]), []
    for device in devices[1:]:
        other, t = tensors(device), trace(device)
        if set(other) != set(ref):
            raise AssertionError(f"{device}: other tensor names than {devices[0]}'s")
        rel = max(float((other[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max().clamp_min(1e-30))
                  for k in ref)
        same_ids = float(np.mean(t.ids == ref_trace.ids))
        if rel > 1e-2 or same_ids < 0.99:
            raise AssertionError(f"{device} vs {devices[0]}: weights rel. Δ {rel:.2g}, same top-k ids {same_ids:.4f}")
        lines.append(f"{device} vs {devices[0]}: {len(ref)} tensors, max |Δ| / max |w| {rel:.1e}; trace "
                     f"{t.ids.shape[1]} tokens × {t.ids.shape[0]} layers, same top-k ids {100 * same_ids:.2f} %")
    return lines


def render(runs: dict, devices: list[str], cmd: str, shape_name: str, repeats: int, notes: list[str]) -> str:
    import torch

    named = [f"{d} ({device_name(torch.device(d))})" for d in devices]
    out = [MARK[0], "## Upcycling and routing capture on a GPU vs the CPU (bench/device_speed.py)", "",
           f"`{cmd}` — {date.today()}, {', '.join(named)}, torch {torch.__version__}; random bf16 Llama "
           f"({shape_name}); each command a fresh process, median of {repeats} interleaved repeats; peak RSS from "
           "/usr/bin/time -v.", "",
           "| step | " + " | ".join(f"{d}: wall (s)" for d in devices)
           + f" | {devices[-1]} / {devices[0]} | " + " | ".join(f"{d}: peak RSS (GB)" for d in devices) + " |",
           "|---" * (2 * len(devices) + 2) + "|"]
    for step in ("upcycle", "routes collect"):
        wall = {d: statistics.median(r["wall"] for r in runs[(step, d)]) for d in devices}
        rss = {d: [r["rss"] for r in runs[(step, d)] if r["rss"] is not None] for d in devices}
        out.append(f"| {step} | " + " | ".join(f"{wall[d]:.1f}" for d in devices)
                   + f" | {wall[devices[-1]] / wall[devices[0]]:.2f}× | "
                   + " | ".join(f"{statistics.median(rss[d]) / 1e9:.2f}" if rss[d] else "—" for d in devices) + " |")
    return "\n".join(out + ["", *notes, MARK[1]])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch folder (the dense model is kept for reruns)")
    ap.add_argument("--shape", default="0.66B", choices=[*SHAPES, "tiny"])
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--texts", type=int, default=64, help="texts for routes collect")
    ap.add_argument("--length", type=int, default=256, help="characters per text (and --max-length)")
    ap.add_argument("--write", type=Path, help="update this markdown file's device_speed section")
    args = ap.parse_args()
    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    args.work.mkdir(parents=True, exist_ok=True)
    runs = run_all(args.work, shape, args.devices, args.repeats, args.texts, args.length)
    cmd = (f"python bench/device_speed.py --work {args.work} --shape {args.shape} --devices {' '.join(args.devices)} "
           f"--repeats {args.repeats} --texts {args.texts} --length {args.length}"
           + (f" --write {args.write}" if args.write else ""))
    section = render(runs, args.devices, cmd, args.shape, args.repeats, checks(args.work, args.devices))
    print(section)
    if args.write:
        write_section(args.write, section, MARK)


if __name__ == "__main__":
    main()
