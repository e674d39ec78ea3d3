"""Baseline selections at a given budget: random experts, and the target language's most activated ones."""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from moekit.routing.stats import activation_frequency
from moekit.routing.trace import RoutingTrace
from moekit.selection.registry import SELECTORS, Selector, check_budget, check_target, expert_mask, to_selection, top
from moekit.selection.selection import Selection


@SELECTORS.register("random")
class RandomSelector(Selector):
    """K experts drawn uniformly at random without repeats from all (layer, expert) pairs, seeded.

    Each expert gets an independent U(0, 1) key from numpy's PCG64 seeded with `seed` and the K largest
    keys win, so every K-subset is equally likely and layers get however many experts the draw gives.
    The keys are the Selection's scores. The target is checked and recorded but not used.
    """

    method: Literal["random"] = "random"
    seed: int = Field(0, description="seed of the random draw")

    def select(self, trace: RoutingTrace, target: str, budget: int | None = None) -> Selection:
        check_target(trace, target)
        budget = check_budget(trace, budget)
        valid = expert_mask(trace)  # (L, E)
        keys = np.random.default_rng(self.seed).random(valid.shape)  # (L, E)
        return to_selection(trace, self, target, top(keys, valid, budget), np.where(valid, keys, 0.0))


@SELECTORS.register("topk")
class TopKSelector(Selector):
    """The K experts, over all layers together, that the target language activates most often.

    Score: activation frequency a^(l)_{λ*,i} (RISE eq. 5), the fraction of the target's tokens whose
    top-k at layer l contains expert i. Ties go to the lower layer, then the lower expert id.
    """

    method: Literal["topk"] = "topk"

    def select(self, trace: RoutingTrace, target: str, budget: int | None = None) -> Selection:
        check_target(trace, target)
        budget = check_budget(trace, budget)
        a = activation_frequency(trace, [target])[0]  # (L, E)
        return to_selection(trace, self, target, top(a, expert_mask(trace), budget), a)
