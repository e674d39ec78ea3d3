"""ESFT expert selection: Wang et al. 2024, "Let the Expert Stick to His Last: Expert-Specialized
Fine-Tuning for Sparse Architectural Large Language Models" (arXiv 2407.01906), §3, eqs. 6–8.

Relevance is computed from the target language's tokens as the paper defines it: a mean over the N_s
samples of each sample's mean over its L_j tokens. (The authors' released script instead sums over
all tokens and divides each expert's column by its sum over layers; we follow the paper.)
"""
from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from moekit.errors import ConfigError
from moekit.routing.trace import RoutingTrace
from moekit.selection.registry import SELECTORS, Selector, check_budget, check_target, expert_mask, to_selection
from moekit.selection.selection import Selection

DEFAULT_TOP_P = {"gate": 0.1, "token": 0.2}  # the paper's thresholds (§4: p = 0.1 ESFT-Gate, 0.2 ESFT-Token)
TOLERANCE = 1e-9  # a running sum within this of top_p has reached it (0.7 + 0.1 < 0.8 in floating point)


def relevance(trace: RoutingTrace, mask: np.ndarray, score: Literal["gate", "token"]) -> np.ndarray:
    """Per-layer expert relevance over the tokens where `mask` (N,) is true; returns (L, E).

    gate (ESFT eq. 6): g^l_i = 1/N_s Σ_j 1/L_j Σ_k g^l_{i,k}, g the routing weight token k gave expert
    i (0 if not in its top-k). token (eq. 7): r^l_i = 1/N_s Σ_j 1/L_j Σ_k 1(g^l_{i,k} > 0) / K, K the
    layer's top-k, so each layer's r sums to 1.
    """
    _, inverse, lengths = np.unique(trace.sample[mask], return_inverse=True, return_counts=True)
    w = 1.0 / (len(lengths) * lengths[inverse])  # (N_t,) 1 / (N_s L_j) per token
    E = int(trace.num_experts.max())
    out = np.zeros((trace.num_layers, E))  # (L, E)
    for layer in range(trace.num_layers):
        ids = trace.ids[layer][mask]  # (N_t, k)
        used = ids >= 0  # (N_t, k), -1 pads layers with a smaller k
        if score == "gate":
            value = trace.weights[layer][mask].astype(np.float64)  # (N_t, k)
        else:
            value = np.full(ids.shape, 1.0 / max(int(used.sum(axis=1).max()), 1))  # (N_t, k) 1/K
        contrib = w[:, None] * value  # (N_t, k)
        out[layer] = np.bincount(ids[used], weights=contrib[used], minlength=E)[:E]
    return out


def entry_threshold(scores: np.ndarray) -> np.ndarray:
    """(L, E): the running sum of the scores ranked above each expert in its layer (descending score,
    ties to the lower id). ESFT eq. 8 with threshold p adds experts in that order until the sum reaches
    p, the one crossing it included: exactly the experts whose entry threshold is below p."""
    order = np.argsort(-scores, axis=1, kind="stable")  # (L, E)
    ranked = np.take_along_axis(scores, order, axis=1)  # (L, E)
    before = np.concatenate([np.zeros((len(scores), 1)), np.cumsum(ranked, axis=1)[:, :-1]], axis=1)  # (L, E)
    out = np.empty_like(scores)
    np.put_along_axis(out, order, before, axis=1)
    return out


def first_entries(entry: np.ndarray, scores: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """(L, E) bool: the k valid experts that enter first as the threshold p rises (lowest entry
    threshold; then higher score, lower layer, lower id)."""
    flat = np.flatnonzero(valid)  # (M,)
    order = flat[np.lexsort((flat, -scores.ravel()[flat], entry.ravel()[flat]))]  # (M,) first key last
    out = np.zeros(scores.size, dtype=bool)
    out[order[:k]] = True
    return out.reshape(scores.shape)


@SELECTORS.register("esft")
class ESFTSelector(Selector):
    """ESFT (Wang et al. 2024): per layer, experts in descending relevance (average gate score, eq. 6, or
    token selection ratio, eq. 7) until their sum reaches top_p, the crossing one included (eq. 8).

    The number of experts is ESFT's outcome (Selection.budget reports it); a layer whose total relevance
    stays below top_p keeps all experts with positive relevance. Given a budget K instead of top_p, it
    returns the K experts that enter first as p rises — ESFT's own selection whenever some p yields K
    experts, with ties at the boundary broken by score, then layer, then id — so ESFT can be compared
    at equal budget. Giving both is an error.
    """

    method: Literal["esft"] = "esft"
    score: Literal["gate", "token"] = Field("token", description="relevance: average gate score (gate, eq. 6) "
                                                                  "or token selection ratio (token, eq. 7)")
    top_p: float | None = Field(None, gt=0, le=1, description="cumulative relevance threshold of eq. 8 (default: "
                                                              "the paper's 0.1 for gate, 0.2 for token)")
    needs_budget: ClassVar[bool] = False

    def select(self, trace: RoutingTrace, target: str, budget: int | None = None) -> Selection:
        mask = check_target(trace, target)
        if budget is not None and self.top_p is not None:
            raise ConfigError("ESFT takes either a threshold top_p or a budget, not both")
        scores = relevance(trace, mask, self.score)  # (L, E)
        valid = expert_mask(trace)  # (L, E)
        entry = entry_threshold(scores)  # (L, E)
        if budget is not None:
            chosen = first_entries(entry, scores, valid, check_budget(trace, budget))
            return to_selection(trace, self, target, chosen, scores, mode="budget")
        top_p = self.top_p if self.top_p is not None else DEFAULT_TOP_P[self.score]
        chosen = valid & (scores > 0) & (entry < top_p - TOLERANCE)  # (L, E)
        return to_selection(trace, self, target, chosen, scores, mode="threshold", top_p=top_p)
