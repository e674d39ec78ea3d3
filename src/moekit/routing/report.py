"""Routing report of a trace: PNG figures, report.md and metrics.json (written atomically).

Figures are drawn on matplotlib's Agg canvas (`matplotlib.figure.Figure`, no pyplot), like moekit.eval.plots.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ..errors import ConfigError
from .._fs import output
from moekit.eval.plots import plot_usage
from . import stats
from .trace import RoutingTrace

FRACTIONS = (0.375, 0.25, 0.375)  # RISE §3 shallow / middle / deep split


def _json_ready(x):
    """Nested numpy values as JSON types; NaN becomes null."""
    if isinstance(x, dict):
        return {str(k): _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_json_ready(v) for v in x]
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(x) else float(x)
    return x


def routing_metrics(trace: RoutingTrace, reference: str | None = None, top_k_set: int | None = None,
                    layer_k: int | None = None, fractions: tuple[float, float, float] = FRACTIONS,
                    selection: dict[str, list[int]] | None = None, num_tokens: int = 100) -> dict:
    """Every statistic of the report as a JSON-ready dict.

    reference: language of the layer-wise similarity (RISE eq. 3), default the one with the most tokens;
    top_k_set: K of the global expert sets (RISE eq. 1), default L·k (as many (layer, expert) pairs as a
    token activates); layer_k: size of the per-layer sets, default the model's top-k."""
    counts = {lang: int(trace.language_mask(lang).sum()) for lang in trace.languages}
    reference = max(counts, key=counts.get) if reference is None else reference
    trace.language_mask(reference)  # raises for an unknown language
    top_k_set = trace.num_layers * trace.top_k if top_k_set is None else top_k_set
    layer_k = trace.top_k if layer_k is None else layer_k
    if top_k_set < 1 or layer_k < 1:
        raise ConfigError(f"expert set sizes must be ≥ 1, got top_k_set={top_k_set}, layer_k={layer_k}")
    a = stats.activation_frequency(trace)  # (Λ, L, E)
    regions = stats.layer_regions(trace.num_layers, fractions)
    layerwise = stats.layerwise_jaccard(a, trace.languages.index(reference), layer_k)  # (Λ, L)
    region_j = stats.region_means(layerwise, regions)
    V, _ = stats.adjacent_association(trace)
    tokens, token_h = stats.token_routing_entropy(trace, num_tokens)
    out = dict(
        tokens_per_language=counts, layers=trace.layers, num_experts=trace.num_experts, top_k=trace.top_k,
        reference=reference, top_k_set=top_k_set, layer_k=layer_k, region_fractions=fractions, regions=regions,
        jaccard=stats.jaccard(stats.global_expert_sets(a, top_k_set)),
        layerwise_jaccard=dict(zip(trace.languages, layerwise)),
        region_jaccard={lang: {r: v[i] for r, v in region_j.items()} for i, lang in enumerate(trace.languages)},
        expert_usage=stats.expert_usage(trace), usage_entropy=stats.usage_entropy(trace),
        max_usage_entropy=np.log(trace.num_experts), cramers_v=V,
        token_routing_entropy=dict(tokens=tokens, per_token=token_h.T, mean=token_h.mean(1)))
    if selection is not None:
        mass, share = stats.overlap_mass(a, trace.layers, selection), stats.overlap_share(a, trace.layers, selection)
        out["selection"] = dict(experts=selection, count=sum(len(v) for v in selection.values()),
                                overlap_mass=dict(zip(trace.languages, mass)),
                                overlap_share=dict(zip(trace.languages, share)))
    return _json_ready(out)


def _save(fig: Figure, path: Path) -> str:
    fig.savefig(path, dpi=120)
    return path.name


def _heatmap_jaccard(m: dict, path: Path) -> str:
    langs, J = list(m["tokens_per_language"]), np.array(m["jaccard"])
    size = 2.5 + 0.5 * len(langs)
    fig = Figure(figsize=(size, size * 0.85), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(J, cmap="viridis", vmin=0, vmax=1)
    for (i, j), v in np.ndenumerate(J):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="w" if v < 0.6 else "k")
    ax.set(xticks=range(len(langs)), xticklabels=langs, yticks=range(len(langs)), yticklabels=langs,
           title=f"Jaccard of global top-{m['top_k_set']}\nexpert sets (RISE eq. 2)")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def _shade_regions(ax, regions: list[str]) -> None:
    colors = {"shallow": "tab:blue", "middle": "tab:green", "deep": "tab:red"}
    for r in stats.REGIONS:
        idx = [i for i, name in enumerate(regions) if name == r]
        if idx:
            ax.axvspan(idx[0] - 0.5, idx[-1] + 0.5, color=colors[r], alpha=0.07, label=r)


def _curves_layerwise(m: dict, path: Path) -> str:
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    _shade_regions(ax, m["regions"])
    for lang, values in m["layerwise_jaccard"].items():
        if lang != m["reference"]:
            ax.plot(values, marker="o", markersize=3, label=lang)
    ax.set(xlabel="MoE layer", ylabel=f"Jaccard vs {m['reference']}", ylim=(-0.05, 1.05),
           title=f"layer-wise similarity of top-{m['layer_k']} experts (RISE eq. 3)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    return _save(fig, path)


def _bars_cramers_v(m: dict, path: Path) -> str:
    V = [np.nan if v is None else v for v in m["cramers_v"]]
    fig = Figure(figsize=(1.5 + 0.4 * max(len(V), 1), 3.5), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(len(V)), V)
    ax.set(xticks=range(len(V)), xticklabels=[f"{i}→{i + 1}" for i in range(len(V))], ylim=(0, 1),
           xlabel="adjacent MoE layers", ylabel="Cramér's V", title="top-1 association (Omni-router Fig. 4)")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def _heatmap_selection(m: dict, background: np.ndarray, label: str, path: Path) -> str:
    """RISE Fig. 6: selected experts (squares) over a layer × expert map of activation frequency."""
    L, E = background.shape
    fig = Figure(figsize=(2 + 0.3 * E, 1.5 + 0.3 * L), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(background, aspect="auto", cmap="Blues", vmin=0)
    rows = [(m["layers"].index(name), e) for name, experts in m["selection"]["experts"].items() for e in experts]
    if rows:
        ys, xs = zip(*rows)
        ax.scatter(xs, ys, marker="s", s=40, facecolors="none", edgecolors="tab:red", label="selected")
        ax.legend(loc="upper right", fontsize=7)
    for i in range(1, L):
        if m["regions"][i] != m["regions"][i - 1]:
            ax.axhline(i - 0.5, color="tab:blue", lw=1)
    ax.set(xlabel="expert", ylabel="MoE layer", title=f"{m['selection']['count']} selected experts")
    fig.colorbar(im, ax=ax, label=label)
    return _save(fig, path)


def _table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(fmt(v) for v in row) + " |" for row in rows), ""]


def _markdown(m: dict, figures: dict[str, str]) -> str:
    langs = list(m["tokens_per_language"])
    lines = ["# Routing report", "",
             f"{sum(m['tokens_per_language'].values())} tokens, {len(m['layers'])} MoE layers, top-{m['top_k']} of "
             f"{max(m['num_experts'])} experts. Reference language: {m['reference']}.", ""]
    lines += _table(["language", "tokens"], [[lang, n] for lang, n in m["tokens_per_language"].items()])
    lines += [f"## Language routing isolation (RISE eqs. 1–2, K = {m['top_k_set']})", ""]
    lines += _table(["", *langs], [[a, *row] for a, row in zip(langs, m["jaccard"])])
    lines += [f"![Jaccard]({figures['jaccard']})", "",
              f"## Layer-wise similarity vs {m['reference']} (RISE eqs. 3–4, top-{m['layer_k']} per layer)", ""]
    regions = list(next(iter(m["region_jaccard"].values())))
    lines += _table(["language", *regions], [[lang, *m["region_jaccard"][lang].values()] for lang in langs])
    lines += [f"![layer-wise similarity]({figures['layerwise']})", "", "## Per layer", "",
              "Usage entropy in nats (max log E = {:.3f}); token entropy: mean over the {} most frequent tokens "
              "of the entropy of their top-1 expert (Omni-router Fig. 5); V: Cramér's V of top-1 choices with "
              "the next layer (Omni-router Fig. 4).".format(max(m["max_usage_entropy"]),
                                                           len(m["token_routing_entropy"]["tokens"])), ""]
    V = m["cramers_v"] + [None]
    lines += _table(["layer", "region", "usage entropy", "token entropy", "V (→ next)"],
                    [[name, r, h, t, v] for name, r, h, t, v in zip(m["layers"], m["regions"], m["usage_entropy"],
                                                                   m["token_routing_entropy"]["mean"], V)])
    lines += [f"![expert usage]({figures['usage']})", "", f"![Cramér's V]({figures['cramers_v']})", ""]
    if "selection" in m:
        sel = m["selection"]
        lines += [f"## Selection ({sel['count']} experts): routing overlap mass Ω (RISE eq. 12: the sum of the "
                  "selected experts' activation frequencies) and its share of the language's assignments", ""]
        lines += _table(["language", "Ω", "share"], [[lang, v, sel["overlap_share"][lang]]
                                                     for lang, v in sel["overlap_mass"].items()])
        lines += [f"![selected experts]({figures['selection']})", ""]
    return "\n".join(lines)


def write_report(trace: RoutingTrace, out_dir: str | Path, reference: str | None = None,
                 top_k_set: int | None = None, selection: dict[str, list[int]] | None = None,
                 target: str | None = None, layer_k: int | None = None,
                 fractions: tuple[float, float, float] = FRACTIONS, overwrite: bool = False) -> Path:
    """Write jaccard.png, layerwise_similarity.png, expert_usage.png, cramers_v.png (and selection.png
    when a selection {layer: [expert ids]} is given; its background is `target`'s activation frequency,
    or all tokens' when no target), report.md and metrics.json into `out_dir`, atomically.
    Arguments as in `routing_metrics`; an existing non-empty `out_dir` is refused unless `overwrite`."""
    with output(out_dir, overwrite=overwrite) as tmp:
        m = routing_metrics(trace, reference, top_k_set, layer_k, fractions, selection)
        if target is not None:
            background, label = stats.activation_frequency(trace, [target])[0], f"activation frequency ({target})"
        else:
            background, label = np.array(m["expert_usage"]), "expert usage (all tokens)"
        figures = dict(jaccard=_heatmap_jaccard(m, tmp / "jaccard.png"),
                       layerwise=_curves_layerwise(m, tmp / "layerwise_similarity.png"),
                       usage=plot_usage(dict(zip(trace.layers, m["expert_usage"])), tmp / "expert_usage.png",
                                        "expert usage per MoE layer").name,
                       cramers_v=_bars_cramers_v(m, tmp / "cramers_v.png"))
        if selection is not None:
            figures["selection"] = _heatmap_selection(m, background, label, tmp / "selection.png")
        (tmp / "report.md").write_text(_markdown(m, figures))
        (tmp / "metrics.json").write_text(json.dumps(m, indent=1, allow_nan=False))
    return Path(out_dir)
