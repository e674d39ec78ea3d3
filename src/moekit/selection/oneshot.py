"""One-shot expert pruning criteria: keep the `top` highest-scoring experts of every MoE layer (ties broken by the
lower expert id), from the saliency sums a trace records over the routed tokens only (moekit.routing.capture):

  usage  frequency: the (token, slot) pairs routed to expert j;
  reap   REAP's saliency (Lasby et al. 2025, "REAP the Experts: Why Pruning Prevails for One-Shot MoE
         Compression", arXiv 2510.13999): S_j = mean over the tokens routed to j of g_j(x)·‖f_j(x)‖₂, g_j the
         weight the model applies to j's output (gate "applied", the default: renormalized over the top-k where the
         family renormalizes, as Qwen3-MoE and Mixtral do) or the plain softmax of the router's logits (gate
         "softmax": the default of REAP's reference code, renormalize_router_weights=False, for comparison with its
         published numbers), f_j the expert's output before it (0 for an expert nothing reached);
  ean    EAN, REAP's baseline: Σ ‖f_j(x)‖₂ over the tokens routed to j.

The selection lists the kept experts; `moekit prune --keep` removes the others from a checkpoint. Every token of
the trace counts, or only the `target` language's. With `groups` G, each of the G groups of E/G consecutive experts
keeps its best top/G (group-limited routing, DeepSeek-V3's n_group, needs as many kept per group); REAP's paper
ranks every expert of a layer together, which such a model's removal refuses unless the ranking happens to be even.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from moekit.errors import ConfigError
from moekit.routing.trace import SALIENCY, RoutingTrace
from moekit.selection.registry import SELECTORS, Selector, expert_mask, to_selection
from moekit.selection.selection import Selection


class OneShot(Selector):
    """Base of the per-layer criteria (module docstring)."""

    per_layer: ClassVar[bool] = True
    needs_budget: ClassVar[bool] = False
    top: int = Field(..., ge=1, description="experts to keep in every MoE layer (required)")
    groups: int = Field(1, ge=1, description="keep top / groups in each of this many groups of consecutive "
                                             "experts: group-limited routing (DeepSeek-V3's n_group 8) needs as "
                                             "many kept in each for `prune --keep`")

    def scores(self, sums: np.ndarray) -> np.ndarray:
        """(L, E) scores from the (L, E, 6) saliency sums (SALIENCY)."""
        raise NotImplementedError

    def select(self, trace: RoutingTrace, target: str | None = None, budget: int | None = None) -> Selection:
        sums = self.sums(trace, target)  # (L, E, 6)
        valid = expert_mask(trace)  # (L, E)
        k = trace.top_k
        small = [f"{name} ({int(e)})" for name, e in zip(trace.layers, trace.num_experts) if e < self.top]
        if small:
            raise ConfigError(f"top {self.top} is more than the experts of {', '.join(small[:3])}")
        if self.top < k:
            raise ConfigError(f"keeping {self.top} experts per layer leaves fewer than the {k} each token is routed "
                              f"to (top-k); keep at least {k}")
        uneven = [f"{name} ({int(e)})" for name, e in zip(trace.layers, trace.num_experts) if e % self.groups]
        if self.top % self.groups or uneven:
            raise ConfigError(f"groups {self.groups} must divide top {self.top} and every layer's experts"
                              + (f" (not those of {', '.join(uneven[:3])})" if uneven else ""))
        scores = np.where(valid, self.scores(sums), -np.inf)  # (L, E)
        chosen = np.zeros_like(valid)
        for li, e in enumerate(trace.num_experts):
            size = int(e) // self.groups
            for g in range(0, int(e), size):  # each group's best, ties: lower id
                best = np.argsort(-scores[li, g:g + size], kind="stable")[: self.top // self.groups]
                chosen[li, g + best] = True
        return to_selection(trace, self, target, chosen, np.where(valid, scores, 0.0), top=self.top)

    def sums(self, trace: RoutingTrace, target: str | None) -> np.ndarray:
        if trace.saliency is None:
            raise ConfigError(f"the trace has no saliency sums, which {self.method} needs: record it with "
                              "`moekit routes collect` (this version records them)")
        if target is None:
            return trace.saliency.sum(0)
        if target not in trace.languages:
            raise ConfigError(f"target language {target!r} is not in the trace (it has: {', '.join(trace.languages)})")
        return trace.saliency[trace.languages.index(target)]


def _column(sums: np.ndarray, name: str) -> np.ndarray:
    return sums[..., SALIENCY.index(name)]


@SELECTORS.register("usage")
class Usage(OneShot):
    """Keep the `top` experts of every layer that the most (token, slot) pairs were routed to (frequency)."""

    method: Literal["usage"] = "usage"

    def scores(self, sums: np.ndarray) -> np.ndarray:
        return _column(sums, "count")


@SELECTORS.register("reap")
class Reap(OneShot):
    """Keep the `top` experts of every layer with the highest REAP saliency: the mean over the tokens routed to an
    expert of its gate weight times the norm of its output (Lasby et al. 2025, arXiv 2510.13999)."""

    method: Literal["reap"] = "reap"
    gate: Literal["applied", "softmax"] = Field(
        "applied", description="the gate weight g: the one the model applies to the expert's output, or the plain "
                               "softmax over all experts (REAP's reference code's default)")

    def scores(self, sums: np.ndarray) -> np.ndarray:
        count = _column(sums, "count")
        if sums.shape[-1] <= SALIENCY.index("softmax_norm") and self.gate == "softmax":
            raise ConfigError("the trace's saliency sums hold no plain softmax gate (recorded by an older moekit): "
                              "record the trace again to rank by it")
        weighted = _column(sums, "gate_norm" if self.gate == "applied" else "softmax_norm")
        return np.divide(weighted, count, out=np.zeros_like(count), where=count > 0)


@SELECTORS.register("ean")
class Ean(OneShot):
    """Keep the `top` experts of every layer with the highest EAN: the sum over the tokens routed to an expert of
    the norm of its output (REAP's EAN baseline)."""

    method: Literal["ean"] = "ean"

    def scores(self, sums: np.ndarray) -> np.ndarray:
        return _column(sums, "norm")
