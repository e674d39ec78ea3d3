"""Routing statistics: pure functions of a RoutingTrace (numpy in, numpy out).

Papers: RISE = Zheng et al. 2026, "Unveiling Language Routing Isolation in Multilingual MoE Models for
Interpretable Subnetwork Adaptation" (arXiv 2604.03592); Omni-router = Gu et al. 2025, "Omni-Router: Sharing
Routing Decisions in Sparse Mixture-of-Experts for Speech Recognition" (arXiv 2507.05724).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .trace import RoutingTrace

REGIONS = ("shallow", "middle", "deep")


def activation_frequency(trace: RoutingTrace, languages: list[str] | None = None) -> np.ndarray:
    """RISE eq. 5: a^(l)_{λ,i} = fraction of language λ's tokens whose top-k at layer l contains expert i.

    Returns (Λ, L, E) for `languages` (default: all of the trace's, in trace order); the routing
    profile matrix A^(l) of RISE is `result[:, l, :]` (Λ × E). Rows sum to k over experts.
    """
    languages = trace.languages if languages is None else languages
    E = int(trace.num_experts.max())
    out = np.zeros((len(languages), trace.num_layers, E))  # (Λ, L, E)
    for li, lang in enumerate(languages):
        ids = trace.ids[:, trace.language_mask(lang)]  # (L, N_λ, k)
        n = max(ids.shape[1], 1)
        for layer in range(trace.num_layers):
            valid = ids[layer][ids[layer] >= 0]
            out[li, layer] = np.bincount(valid, minlength=E)[:E] / n
    return out


def layer_regions(num_layers: int, fractions: tuple[float, float, float] = (0.375, 0.25, 0.375)) -> list[str]:
    """RISE §3 depth split: the first 37.5 % of MoE layers are shallow, the next 25 % middle, the rest deep.

    Returns one region name per layer. Boundaries are round(cumulative fraction · L), and every region
    keeps at least one layer when L ≥ 3.
    """
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"region fractions must be 3 non-negative numbers summing to 1, got {fractions}")
    a = int(round(fractions[0] * num_layers))
    b = int(round((fractions[0] + fractions[1]) * num_layers))
    if num_layers >= 3:
        a = min(max(a, 1), num_layers - 2)
        b = min(max(b, a + 1), num_layers - 1)
    return [REGIONS[0] if i < a else REGIONS[1] if i < b else REGIONS[2] for i in range(num_layers)]


# --- RISE §3: language routing isolation ------------------------------------------------------------

def _top_sets(scores: np.ndarray, k: int) -> np.ndarray:
    """Bool mask of the k highest positive entries along the last axis (ties: lower index first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]  # (..., k)
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask & (scores > 0)


def global_expert_sets(a: np.ndarray, k: int) -> np.ndarray:
    """RISE eq. 1: E_λ, the K (layer, expert) pairs with the highest activation frequency a^(l)_{λ,i}
    over the whole depth. `a` (Λ, L, E) from `activation_frequency`; returns a (Λ, L, E) bool mask.
    Experts a language never activates are left out, so a set can be smaller than K."""
    flat = a.reshape(a.shape[0], -1)  # (Λ, L*E)
    return _top_sets(flat, k).reshape(a.shape)


def layer_expert_sets(a: np.ndarray, k: int) -> np.ndarray:
    """RISE eq. 3's per-layer sets E^(l)_λ: the k most activated experts of each layer, (Λ, L, E) bool."""
    return _top_sets(a, k)


def jaccard(sets: np.ndarray) -> np.ndarray:
    """RISE eq. 2: J(λ, μ) = |E_λ ∩ E_μ| / |E_λ ∪ E_μ| for every pair of languages.

    `sets` (Λ, ..., E) bool; the Jaccard index is taken over all trailing axes but the leading one
    when given (Λ, L, E) from `global_expert_sets`. Returns (Λ, Λ); two empty sets count as equal (1)."""
    flat = sets.reshape(sets.shape[0], -1).astype(np.int64)  # (Λ, M)
    inter = flat @ flat.T  # (Λ, Λ)
    sizes = flat.sum(1)  # (Λ,)
    union = sizes[:, None] + sizes[None, :] - inter  # (Λ, Λ)
    return np.divide(inter, union, out=np.ones(inter.shape), where=union > 0)


def layerwise_jaccard(a: np.ndarray, reference: int, k: int) -> np.ndarray:
    """RISE eq. 3: J^(l)(λ, λ_ref) = |E^(l)_λ ∩ E^(l)_ref| / |E^(l)_λ ∪ E^(l)_ref| with E^(l) the top-k
    experts of layer l. `a` (Λ, L, E), `reference` the reference language's row. Returns (Λ, L)."""
    sets = layer_expert_sets(a, k)  # (Λ, L, E)
    inter = (sets & sets[reference]).sum(-1)  # (Λ, L)
    union = (sets | sets[reference]).sum(-1)  # (Λ, L)
    return np.divide(inter, union, out=np.ones(inter.shape), where=union > 0)


def region_means(values: np.ndarray, regions: list[str]) -> dict[str, np.ndarray]:
    """RISE eq. 4: the mean of per-layer values (…, L) over each depth region's layers (`layer_regions`),
    e.g. J̄_shallow(λ) = 1/|L_s| Σ_{l ∈ L_s} J^(l)(λ, λ_ref). Regions without layers are left out."""
    names = np.array(regions)
    return {r: values[..., names == r].mean(-1) for r in REGIONS if (names == r).any()}


def overlap_mass(a: np.ndarray, layers: list[str], selection: dict[str, list[int]]) -> np.ndarray:
    """RISE eq. 12: routing overlap mass Ω_λ(S) = Σ_l Σ_{i ∈ S_l} p^(l)_{λ,i}, p = a the activation frequency
    (eq. 5): a raw sum, up to k per layer (the full expert set gives L·k). Ω = 0 means λ never reaches S
    (RISE Theorem 1). `a` (Λ, L, E); `selection` {layer path: [expert ids]} with paths from
    RoutingTrace.layers. Returns (Λ,). See `overlap_share` for the normalized form."""
    return (a * _selection_mask(a, layers, selection)).sum((1, 2))


def overlap_share(a: np.ndarray, layers: list[str], selection: dict[str, list[int]]) -> np.ndarray:
    """Ω_λ(S) / Σ_{l,i} a^(l)_{λ,i}: the share of λ's routed (token, slot) assignments that land on S
    (moekit's normalization of eq. 12; the full expert set gives 1). Returns (Λ,)."""
    total = a.sum((1, 2))  # (Λ,)
    return np.divide(overlap_mass(a, layers, selection), total, out=np.zeros(total.shape), where=total > 0)


def _selection_mask(a: np.ndarray, layers: list[str], selection: dict[str, list[int]]) -> np.ndarray:
    """(L, E) True on the selected experts; unknown layers or ids are errors."""
    mask = np.zeros(a.shape[1:], dtype=bool)  # (L, E)
    for name, experts in selection.items():
        if name not in layers:
            raise ConfigError(f"selection layer {name!r} is not an MoE layer of the trace")
        bad = [e for e in experts if not 0 <= e < a.shape[2]]
        if bad:
            raise ConfigError(f"selection layer {name!r}: expert ids {bad} out of range 0..{a.shape[2] - 1}")
        mask[layers.index(name), experts] = True
    return mask


# --- Omni-router: cross-layer association and routing entropy --------------------------------------

def top1(trace: RoutingTrace) -> np.ndarray:
    """(L, N) the expert with the largest combine weight of every token at every layer; padding slots (id -1)
    never win, and a token with no expert at a layer gets -1."""
    weights = np.where(trace.ids >= 0, trace.weights, -np.inf)  # (L, N, k)
    best = weights.argmax(-1)[..., None]  # (L, N, 1)
    return np.take_along_axis(trace.ids, best, -1)[..., 0].astype(np.int64)  # (L, N)


def contingency(x: np.ndarray, y: np.ndarray, ex: int, ey: int) -> np.ndarray:
    """(ex, ey) counts of tokens routed to expert x at one layer and y at another; x, y (N,)."""
    table = np.zeros((ex, ey), dtype=np.int64)
    both = (x >= 0) & (y >= 0)  # (N,) tokens routed at both layers
    np.add.at(table, (x[both], y[both]), 1)
    return table


def cramers_v(table: np.ndarray) -> float:
    """Cramér's V = sqrt(χ² / (n · (min(r, c) − 1))) of a contingency table over its non-empty rows
    and columns: 0 for independent choices, 1 when one determines the other (Omni-router Fig. 4).
    NaN when either side uses a single expert (no variation to associate)."""
    table = table[table.sum(1) > 0][:, table.sum(0) > 0].astype(float)  # (r, c)
    n, m = table.sum(), min(table.shape) - 1
    if m < 1:
        return float("nan")
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / n  # (r, c)
    chi2 = ((table - expected) ** 2 / expected).sum()
    return float(np.sqrt(chi2 / (n * m)))


def align_experts(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder the columns of a contingency table so that the diagonal holds the largest total count
    (optimal assignment, scipy's linear_sum_assignment), as in Omni-router Fig. 3.

    Returns (aligned table, column order): aligned = table[:, order]; unmatched columns go last."""
    from scipy.optimize import linear_sum_assignment

    _, cols = linear_sum_assignment(table, maximize=True)  # rows come back sorted
    order = np.concatenate([cols, np.setdiff1d(np.arange(table.shape[1]), cols)])
    return table[:, order], order


def adjacent_association(trace: RoutingTrace) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cramér's V between the top-1 choices of MoE layers l and l+1 (Omni-router Fig. 4), and the
    contingency tables with expert ids aligned by optimal assignment (Fig. 3).
    Returns ((L-1,) V, L-1 aligned tables)."""
    choice = top1(trace)  # (L, N)
    values, tables = [], []
    for layer in range(trace.num_layers - 1):
        table = contingency(choice[layer], choice[layer + 1], int(trace.num_experts[layer]),
                            int(trace.num_experts[layer + 1]))
        values.append(cramers_v(table))
        tables.append(align_experts(table)[0])
    return np.array(values), tables


def entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats along the last axis of (unnormalized) counts or probabilities."""
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return -(p * np.log(np.where(p > 0, p, 1))).sum(-1)


def expert_usage(trace: RoutingTrace) -> np.ndarray:
    """(L, E) share of each layer's routed (token, slot) assignments that each expert received."""
    E = int(trace.num_experts.max())
    counts = np.stack([np.bincount(ids[ids >= 0], minlength=E)[:E] for ids in trace.ids])  # (L, E)
    return counts / np.maximum(counts.sum(1, keepdims=True), 1)


def usage_entropy(trace: RoutingTrace) -> np.ndarray:
    """(L,) entropy of expert usage per layer: log E when all experts share the load, 0 for one expert."""
    return entropy(expert_usage(trace))


def token_routing_entropy(trace: RoutingTrace, num_tokens: int = 100,
                          exclude: tuple[int, ...] = (-1,)) -> tuple[np.ndarray, np.ndarray]:
    """Omni-router Fig. 5: for each of the `num_tokens` most frequent token ids (the paper: 100), the entropy
    of its top-1 expert over its occurrences, per layer. Low values mean a token goes to the same expert
    every time. Ids in `exclude` are left out (-1: positions without a token id; a CTC blank, say).
    Returns (tokens (n,), entropies (L, n))."""
    keep = ~np.isin(trace.token, exclude)  # (N,)
    values, counts = np.unique(trace.token[keep], return_counts=True)
    tokens = values[np.argsort(-counts, kind="stable")[:num_tokens]]  # (n,)
    choice = top1(trace)  # (L, N)
    E = int(trace.num_experts.max())
    out = np.zeros((trace.num_layers, len(tokens)))  # (L, n)
    for j, tok in enumerate(tokens):
        hits = choice[:, trace.token == tok]  # (L, N_tok)
        out[:, j] = entropy(np.stack([np.bincount(h[h >= 0], minlength=E)[:E] for h in hits]))
    return tokens, out
