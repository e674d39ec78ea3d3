from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


def perturb(w: torch.Tensor, ratio: float, std: float, gen: torch.Generator) -> torch.Tensor:
    """w + m ⊙ N(0, (std·σ_w)²) with m ~ Bernoulli(ratio) per entry."""
    mask = torch.rand(w.shape, generator=gen) < ratio  # drawn on the CPU: the same numbers on any device
    noise = torch.randn(w.shape, generator=gen) * (std * w.float().std().cpu())
    return w + (mask * noise).to(w.dtype).to(w.device)


@EXPERT_INITS.register("noise")
class NoiseInit(ExpertInitConfig):
    """Copy + Gaussian perturbation (SPRI eq. 5; the noisy upcycling described for Qwen2-MoE and
    OLMoE): every expert copies the dense FFN, then a random fraction `ratio` of the entries of
    each of its matrices gets additive noise N(0, (std·σ_W)²), σ_W the std of that dense matrix.
    Independent masks and noise per expert and per matrix. `placement: down` perturbs only the down
    projection (gate and up stay copies): the down-only variant of SPRI's Table 3 ablation."""

    method: Literal["noise"] = "noise"
    ratio: float = Field(0.5, gt=0.0, le=1.0)
    std: float = Field(0.01, gt=0.0)
    placement: Literal["all", "down"] = "all"

    def expert(self, ctx: InitContext, state, i: int) -> FFNWeights:
        d, g = ctx.dense, ctx.generator
        if self.placement == "down":
            return replace(d, down=perturb(d.down, self.ratio, self.std, g))
        return replace(d, up=perturb(d.up, self.ratio, self.std, g), down=perturb(d.down, self.ratio, self.std, g),
                       gate=None if d.gate is None else perturb(d.gate, self.ratio, self.std, g))
