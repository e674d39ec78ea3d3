"""SPRI's SVD blocks of an 8B-model down projection (4096 x 14336): time and exactness.

Compares moekit.init.spri.SVDBlocks (float32 Gram + multi-threaded eigh, per-block Cholesky QR, the last
block as W minus the others) with the float64 Gram/eigh version it replaced (kept below as the reference),
interleaved, median of --repeats; reports Σ_g R_g = W (relative Frobenius error) and max |⟨R_g, R_h⟩| / ‖W‖².

    .venv/bin/python bench/spri_blocks.py --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from report import write_section  # bench/report.py

MARK = ("<!-- spri_blocks -->", "<!-- /spri_blocks -->")


def float64_blocks(w: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """The previous svd_blocks: float64 Gram, single-threaded eigh, float64 projections."""
    w64 = w.double()
    gram = w64 @ w64.T
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, vecs = torch.linalg.eigh(gram)
    finally:
        torch.set_num_threads(n)
    vecs = vecs.flip(-1)
    return [b @ (b.T @ w64) for b in torch.tensor_split(vecs, groups, dim=1)]


def moekit_blocks(w: torch.Tensor, groups: int) -> list[torch.Tensor]:
    from moekit.init.spri import SVDBlocks

    parts = SVDBlocks(w, groups)
    return [parts.block(g) for g in range(groups)]


def quality(w: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[float, float]:
    w64, b64 = w.double(), [b.double() for b in blocks]
    recon = float((torch.stack(b64).sum(0) - w64).norm() / w64.norm())
    sq = float((w64 ** 2).sum())
    orth = max(abs(float((a * b).sum())) / sq for a, b in itertools.combinations(b64, 2))
    return recon, orth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)  # E=8, top-2
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    w = torch.randn(4096, 14336, generator=torch.Generator().manual_seed(0)) * 0.02
    times: dict[str, list[float]] = {"float64 (previous)": [], "moekit": []}
    quals = {}
    for _ in range(args.repeats):
        for name, fn in (("float64 (previous)", float64_blocks), ("moekit", moekit_blocks)):
            t0 = time.perf_counter()
            blocks = fn(w, args.groups)
            times[name].append(time.perf_counter() - t0)
            quals[name] = quality(w, blocks)
            del blocks
    lines = [MARK[0], "## SPRI SVD blocks at 8B scale (bench/spri_blocks.py)", "",
             f"`{' '.join(sys.argv)}` — {date.today()}, {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}; W 4096 x 14336 (an 8B down projection), G = {args.groups}; median of "
             f"{args.repeats} interleaved repeats.", "",
             "| implementation | time (s) | runs (s) | ‖Σ R_g − W‖ / ‖W‖ | max \\|⟨R_g, R_h⟩\\| / ‖W‖² |",
             "|---|---|---|---|---|"]
    for name, ts in times.items():
        recon, orth = quals[name]
        lines.append(f"| {name} | {statistics.median(ts):.1f} | {', '.join(f'{t:.1f}' for t in ts)} | {recon:.1e} | "
                     f"{orth:.1e} |")
    lines.append(MARK[1])
    print("\n".join(lines))
    if args.write:
        write_section(args.write, "\n".join(lines), MARK)


if __name__ == "__main__":
    main()
