"""Where SIMoE upcycled and how its experts relate (Chen et al. 2025, Figs. 4, 5, 2).

* `nonzero_fractions`: fraction of non-zero expert parameters (median gates; each gate switches one δ
  column, so gates count by the parameters they control), per layer type and per depth (Fig. 4).
* `overlaps`: |z_i ∩ z_j| / |z_i ∪ z_j| between experts over all their parameters (Fig. 5, with and
  without the orthogonality penalty).
* `task_routing` + `task_dendrogram`: mean routing weights per task and their hierarchical clustering
  (scipy, average linkage on Euclidean distances) (Fig. 2)."""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn

from moekit._fs import output
from moekit.simoe.layer import SILinear
from moekit.simoe.model import SIMoE, si_modules

_DEPTH = re.compile(r"\.(\d+)\.")


def _masks(model: nn.Module):
    """(path, layer type, depth or None, (M, gates) bool non-zero gates, parameters per gate): gates are the
    input neurons (a gate switches a δ column), or every weight entry with full-granular masks (C.1)."""
    for path, m in si_modules(model):
        z = (m.full_gates() if isinstance(m, SILinear) else m.gate_values()) != 0
        depth = _DEPTH.search(path)
        rows = m.delta.shape[0] if isinstance(m, SILinear) and not m.per_param else 1
        yield path, path.rsplit(".", 1)[-1], int(depth.group(1)) if depth else None, z.flatten(1), rows


def nonzero_fractions(model: nn.Module) -> dict:
    """{"by_type": {type: fraction}, "by_depth": {depth: fraction}, "overall": fraction}, where a fraction
    is non-zero expert parameters / all expert parameters (M experts × δ's size)."""
    num: dict = {"by_type": defaultdict(float), "by_depth": defaultdict(float)}
    den: dict = {"by_type": defaultdict(float), "by_depth": defaultdict(float)}
    for _, kind, depth, z, rows in _masks(model):
        for group, key in (("by_type", kind), ("by_depth", depth)):
            if key is not None:
                num[group][key] += rows * float(z.sum())
                den[group][key] += rows * z.numel()
    out = {g: {k: num[g][k] / den[g][k] for k in sorted(den[g], key=str)} for g in num}
    out["overall"] = sum(num["by_type"].values()) / sum(den["by_type"].values())
    return out


def overlaps(model: nn.Module) -> np.ndarray:
    """(M, M) parameter-weighted Jaccard overlap of the experts' masks; 1 on the diagonal (0 if empty)."""
    inter = union = 0
    for _, _, _, z, rows in _masks(model):
        zf = z.double()  # (M, d_in)
        both = zf @ zf.T  # (M, M)
        size = zf.sum(1)
        inter = inter + rows * both
        union = union + rows * (size[:, None] + size[None, :] - both)
    return (inter / union.clamp_min(1)).numpy()


@torch.no_grad()
def task_routing(model: nn.Module, tokenizer, prompts: dict[str, list[str]], batch_size: int = 8) -> dict[str, list[float]]:
    """Mean instance-routing weights (M,) of each task's prompts (left-padded, last token = prompt end)."""
    s: SIMoE = model.simoe
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = {}
    for task, texts in prompts.items():
        rows = []
        for i in range(0, len(texts), batch_size):
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[i:i + batch_size]]
            n = max(map(len, ids))
            x = torch.tensor([[pad] * (n - len(r)) + r for r in ids])
            mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in ids])
            w = s.route(model, x, mask, None)  # (B, M) or (B, T, M)
            rows.append(w if w.dim() == 2 else w[:, -1])
        out[task] = torch.cat(rows).mean(0).tolist()
    return out


def _save(fig: Figure, path: Path) -> str:
    fig.savefig(path, dpi=120)
    return path.name


def _bars(values: dict, title: str, xlabel: str, path: Path) -> str:
    fig = Figure(figsize=(max(4.0, 0.4 * len(values) + 1.5), 3.2), layout="constrained")
    ax = fig.subplots()
    ax.bar([str(k) for k in values], list(values.values()))
    ax.set(title=title, xlabel=xlabel, ylabel="non-zero expert parameters", ylim=(0, 1))
    ax.tick_params(axis="x", labelrotation=60 if len(values) > 8 else 0)
    return _save(fig, path)


def _overlap_map(ov: np.ndarray, path: Path) -> str:
    fig = Figure(figsize=(4.2, 3.6), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(ov, vmin=0, vmax=1, cmap="viridis")
    ax.set(title="expert overlap |z_i ∩ z_j| / |z_i ∪ z_j|", xlabel="expert", ylabel="expert",
           xticks=range(len(ov)), yticks=range(len(ov)))
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def task_dendrogram(routing: dict[str, list[float]], path: Path) -> str:
    """Hierarchical clustering of tasks by their mean routing (scipy average linkage)."""
    from scipy.cluster.hierarchy import dendrogram, linkage

    fig = Figure(figsize=(6, 0.35 * len(routing) + 1.5), layout="constrained")
    ax = fig.subplots()
    dendrogram(linkage(np.array(list(routing.values())), method="average"), labels=list(routing),
               orientation="right", ax=ax)
    ax.set(title="tasks clustered by mean expert routing", xlabel="distance")
    return _save(fig, path)


def write_report(model: nn.Module, out: str | Path, routing: dict[str, list[float]] | None = None,
                 overwrite: bool = False) -> Path:
    """report.json and nonzero_by_type.png, nonzero_by_depth.png, overlap.png (and task_dendrogram.png
    with ≥ 2 tasks' mean routing) into `out`, atomically."""
    from moekit.simoe.model import param_counts

    with output(out, overwrite=overwrite) as tmp:
        fr, ov = nonzero_fractions(model), overlaps(model)
        figures = [_bars(fr["by_type"], "where SIMoE upcycled: layer type", "layer type", tmp / "nonzero_by_type.png"),
                   _bars(fr["by_depth"], "where SIMoE upcycled: depth", "block", tmp / "nonzero_by_depth.png"),
                   _overlap_map(ov, tmp / "overlap.png")]
        if routing and len(routing) >= 2:
            figures.append(task_dendrogram(routing, tmp / "task_dendrogram.png"))
        report = {"nonzero": fr, "overlap": ov.tolist(), "task_routing": routing, "params": param_counts(model),
                  "figures": figures}
        (tmp / "report.json").write_text(json.dumps(report, indent=1))
    return Path(out)
