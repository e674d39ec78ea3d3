"""RISE layer-aware expert selection: Zheng et al. 2026, "Unveiling Language Routing Isolation in
Multilingual MoE Models for Interpretable Subnetwork Adaptation" (arXiv 2604.03592), §4.2, Algorithm 1.

Shallow and deep layers take the experts most specific to the target language, middle layers the
experts most shared across languages (the paper's convergence–divergence pattern).
"""
from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from moekit.errors import ConfigError
from moekit.routing.stats import REGIONS, activation_frequency, layer_regions
from moekit.routing.trace import RoutingTrace
from moekit.selection.registry import (SELECTORS, Selector, check_budget, check_target, expert_mask, to_selection,
                                    top)
from moekit.selection.selection import Selection

Triple = tuple[float, float, float]
Region = Literal["shallow", "middle", "deep"]


def specificity(a: np.ndarray, t: int) -> np.ndarray:
    """RISE specificity (unnumbered, §4; eq. 6 is the layer regions): S^(l)_{λ*,i} = a^(l)_{λ*,i} / ā^(l)_i,
    ā the mean over languages.

    `a` (Λ, L, E) activation frequencies (eq. 5), `t` the target's row. Returns (L, E); 0 where no
    language uses the expert.
    """
    mean = a.mean(axis=0)  # (L, E)
    return np.divide(a[t], mean, out=np.zeros_like(mean), where=mean > 0)  # (L, E)


def overlap(a: np.ndarray) -> np.ndarray:
    """RISE eq. 7: O^(l)_i = 1 / (1 + CV^(l)_i), CV = σ/μ of a^(l)_{·,i} over languages (population σ).

    Returns (L, E). Where no language uses the expert CV is 0/0; we set O = 0 there (an expert nobody
    uses is not shared), where the authors' code would give it O = 1.
    """
    mean, std = a.mean(axis=0), a.std(axis=0)  # (L, E) each
    cv = np.divide(std, mean, out=np.zeros_like(mean), where=mean > 0)  # (L, E)
    return np.where(mean > 0, 1.0 / (1.0 + cv), 0.0)  # (L, E)


def composite_scores(a: np.ndarray, t: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """RISE eq. 8: Spec = S · (1 + α a^(l)_{λ*,i}) and Ovlp = O · (1 + α ā^(l)_i), each (L, E).

    The factors weight the ratios by how much the expert is used, so rare experts cannot win on noise.
    """
    spec = specificity(a, t) * (1.0 + alpha * a[t])  # (L, E)
    ovlp = overlap(a) * (1.0 + alpha * a.mean(axis=0))  # (L, E)
    return spec, ovlp


def region_budgets(budget: int, ratios: Triple, capacity: dict[str, int]) -> dict[str, int]:
    """Algorithm 1's split of K: K_s = ⌊ρ_s K⌋, K_m = ⌊ρ_m K⌋, K_d = K − K_s − K_m (the authors' rounding).

    A region with fewer experts than its share keeps all of them and the rest goes to the region with
    the most room left (first in shallow, middle, deep order on ties), so exactly K are chosen.
    """
    s, m = (math.floor(budget * r + 1e-9) for r in ratios[:2])
    want = dict(zip(REGIONS, (s, m, budget - s - m)))
    out = {r: min(want[r], capacity[r]) for r in REGIONS}
    spill = budget - sum(out.values())
    while spill > 0:
        r = max(REGIONS, key=lambda z: capacity[z] - out[z])  # max keeps the first of equal rooms
        take = min(spill, capacity[r] - out[r])
        out[r] += take
        spill -= take
    return out


@SELECTORS.register("rise")
class RISESelector(Selector):
    """RISE Algorithm 1 (Zheng et al. 2026): specificity in shallow/deep layers, cross-lingual overlap in
    middle layers, composite scores with α (eqs. 6–8), budget K split over regions by ratios ρ.

    Languages are all those with tokens in the trace (the paper needs the target and at least one other).
    Within a region the candidates of all its layers compete together; ties go to the lower layer, then
    the lower expert id. Regions are disjoint, so no expert is chosen twice.
    """

    method: Literal["rise"] = "rise"
    alpha: float = Field(10.0, ge=0, description="activation-magnitude weight α of eq. 8")
    ratios: Triple = Field((0.35, 0.25, 0.40), description="budget shares ρ_s, ρ_m, ρ_d of the shallow, middle "
                                                            "and deep regions; defaults from the authors' code")
    regions: Triple = Field((0.375, 0.25, 0.375), description="shares of the MoE layers in the shallow, middle "
                                                               "and deep regions (RISE §3)")
    groups: tuple[Region, ...] = Field(REGIONS, min_length=1, description="the layer groups whose selected experts "
                                       "are kept (Fig. 3: w/o one group, or only one; the others' shares of K are "
                                       "dropped, not moved)")

    @field_validator("ratios", "regions")
    @classmethod
    def _simplex(cls, v: Triple) -> Triple:
        if min(v) < 0 or abs(sum(v) - 1) > 1e-6:
            raise ValueError(f"must be 3 non-negative numbers summing to 1, got {v}")
        return v

    def select(self, trace: RoutingTrace, target: str, budget: int | None = None) -> Selection:
        check_target(trace, target)
        budget = check_budget(trace, budget)
        present = [lang for i, lang in enumerate(trace.languages) if (trace.lang == i).any()]
        if len(present) < 2:
            raise ConfigError(f"RISE compares the target with other languages; the trace has tokens of "
                              f"{', '.join(present)} only")
        a = activation_frequency(trace, present)  # (Λ, L, E)
        spec, ovlp = composite_scores(a, present.index(target), self.alpha)  # (L, E) each
        region = np.array(layer_regions(trace.num_layers, self.regions))  # (L,)
        score = np.where((region == "middle")[:, None], ovlp, spec)  # (L, E)
        valid = expert_mask(trace)  # (L, E)
        budgets = region_budgets(budget, self.ratios,
                                 {r: int(np.asarray(trace.num_experts)[region == r].sum()) for r in REGIONS})
        chosen = np.zeros_like(valid)  # (L, E)
        for r in REGIONS:
            if r in self.groups:
                chosen |= top(score, valid & (region == r)[:, None], budgets[r])
        return to_selection(trace, self, target, chosen, score, region_budgets=budgets,
                            layer_regions=region.tolist(), languages=present)
