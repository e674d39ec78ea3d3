"""PNG plots of a run: loss curves, KL(dense ‖ model) over steps, expert-usage heatmap.

Figures are drawn on matplotlib's Agg canvas (`matplotlib.figure.Figure`, no pyplot): nothing is
shown, no window or global backend is touched, and it works without a display.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from moekit.errors import ConfigError


def _series(log_history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[key]) for h in log_history if key in h and "step" in h]
    return [s for s, _ in points], [v for _, v in points]


def _line_plot(log_history: list[dict], keys: list[str], ylabel: str, path: Path) -> Path:
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for key in keys:
        steps, values = _series(log_history, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set(xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    return path


def plot_curves(log_history: list[dict], folder: str | Path) -> list[Path]:
    """From HF Trainer `state.log_history`-style dicts ('step' with 'loss', 'eval_loss', 'eval_*_loss',
    'eval_kl', ...): loss.png (training and eval losses) and kl.png (eval_kl), each only if it has data."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for h in log_history for k in h})
    losses = [k for k in keys if k == "loss" or (k.startswith("eval_") and k.endswith("loss"))]
    written = []
    if losses:
        written.append(_line_plot(log_history, losses, "loss (nats / target token)", folder / "loss.png"))
    if "eval_kl" in keys:
        written.append(_line_plot(log_history, ["eval_kl"], "KL(dense ‖ model) / token", folder / "kl.png"))
    return written


def plot_usage(usage: dict[str, list[float]], path: str | Path, title: str = "expert usage") -> Path:
    """Heatmap of `expert_usage` (rows: MoE layers, columns: experts; share of routed assignments)."""
    if not usage:
        raise ConfigError("no expert usage to plot (the model has no MoE layers)")
    width = max(len(v) for v in usage.values())
    grid = np.full((len(usage), width), np.nan)  # (layers, experts); NaN where a layer has fewer experts
    for i, v in enumerate(usage.values()):
        grid[i, :len(v)] = v
    fig = Figure(figsize=(1.5 + 0.45 * width, 1.2 + 0.35 * len(usage)), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0)
    ax.set(xlabel="expert", xticks=range(width), yticks=range(len(usage)), yticklabels=list(usage), title=title)
    fig.colorbar(im, ax=ax, label="share of (token, slot) assignments")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
