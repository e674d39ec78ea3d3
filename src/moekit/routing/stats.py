"""Routing statistics: pure functions of a RoutingTrace (numpy in, numpy out).

Papers: RISE = Zheng et al. 2026, "Unveiling Language Routing Isolation in Multilingual MoE Models for
Interpretable Subnetwork Adaptation" (arXiv 2604.03592); Omni-router = Gu et al. 2025.
"""
from __future__ import annotations

import numpy as np

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
