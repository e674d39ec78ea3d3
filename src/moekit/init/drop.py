from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


def drop_indices(intermediate: int, ratio: float, gen: torch.Generator) -> torch.Tensor:
    """round(ratio·I) distinct intermediate indices, sorted."""
    n = round(ratio * intermediate)
    return torch.randperm(intermediate, generator=gen)[:n].sort().values


def _resample(w: torch.Tensor, idx: torch.Tensor, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Copy of w whose slices `idx` along `dim` are redrawn from N(mean(w), std(w)) of the whole matrix."""
    out = w.clone()
    shape = list(w.shape)
    shape[dim] = len(idx)
    mean, std = w.float().mean().cpu(), w.float().std().cpu()
    fresh = torch.randn(shape, generator=gen) * std + mean  # drawn on the CPU: the same numbers on any device
    out.index_copy_(dim, idx.to(w.device), fresh.to(w.dtype).to(w.device))
    return out


@EXPERT_INITS.register("drop")
class DropInit(ExpertInitConfig):
    """Drop-Upcycling (Nakamura et al. 2025, §3; SPRI eq. 6). Per expert, draw one index set S of
    round(r·I) intermediate neurons; re-initialize rows S of gate and up and columns S of down
    from N(μ, σ²) with μ, σ the mean and std of the original matrix; keep the rest. The same S is
    used for gate, up and down of that expert (and for its biases, which are zeroed on S). `placement:
    down` re-draws only the columns S of the down projection (gate and up stay copies): the down-only
    variant of SPRI's Table 3 ablation."""

    method: Literal["drop"] = "drop"
    ratio: float = Field(0.5, ge=0.0, le=1.0)
    placement: Literal["all", "down"] = "all"

    def expert(self, ctx: InitContext, state, i: int) -> FFNWeights:
        d, gen = ctx.dense, ctx.generator
        idx = drop_indices(d.intermediate_size, self.ratio, gen)
        if self.placement == "down":
            return replace(d, down=_resample(d.down, idx, 1, gen))

        def bias(b):
            return None if b is None else b.clone().index_fill_(0, idx.to(b.device), 0.0)

        return replace(d, up=_resample(d.up, idx, 0, gen), down=_resample(d.down, idx, 1, gen),
                       gate=None if d.gate is None else _resample(d.gate, idx, 0, gen),
                       up_bias=bias(d.up_bias), gate_bias=bias(d.gate_bias))

