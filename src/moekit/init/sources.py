from __future__ import annotations

import os
from dataclasses import replace
from typing import ClassVar, Literal

import torch
from pydantic import Field

from moekit.config import Config
from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


class SourceScaling(Config):
    """mergekit-moe's per-expert options: `noise_scale` adds N(0, noise_scale²) to every entry of gate, up and down;
    `residual_scale` then multiplies the down projection."""

    noise_scale: float = Field(0.0, ge=0.0)
    residual_scale: float = 1.0


@EXPERT_INITS.register("sources")
class SourcesInit(ExpertInitConfig):
    """Experts from separately trained models of one architecture (mergekit-moe's "MoErges": Goddard et al.
    2024, "Arcee's MergeKit", arXiv:2403.13257, and mergekit's docs/moe.md): routed expert i is the FFN of the i-th
    model of `branches`, the shared expert (spec.shared_expert) the FFN of `shared_source` (None: the base model's), and
    every other weight the base model's, not averaged (btx averages them). `scaling` holds mergekit's noise_scale /
    residual_scale per source (routed experts, then the shared one), the noise drawn from the layer's generator.
    Experts that all come from one model are refused unless `allow_same` (mergekit's
    --i-understand-this-is-not-useful-without-training): they compute what that model computes."""

    method: Literal["sources"] = "sources"
    branches: list[str] = Field(min_length=1)
    shared_source: str | None = None
    scaling: list[SourceScaling] = []
    allow_same: bool = False
    needs_branches: ClassVar[bool] = True

    def source_models(self) -> list[str]:
        return [*self.branches, *([self.shared_source] if self.shared_source is not None else [])]

    def with_source_models(self, paths: list[str]) -> SourcesInit:
        n = len(self.branches)
        shared = paths[n] if self.shared_source is not None else None
        return self.model_copy(update={"branches": list(paths[:n]), "shared_source": shared})

    def check(self, spec) -> None:
        if len(self.branches) != spec.num_experts:
            raise ValueError(f"sources needs one model per expert: num_experts={spec.num_experts} but "
                             f"{len(self.branches)} branches were given")
        if self.shared_source is not None and not spec.shared_expert:
            raise ValueError("init.shared_source names the shared expert's model, but shared_expert is false")
        if self.scaling and len(self.scaling) != len(self.source_models()):
            raise ValueError(f"init.scaling needs one entry per source model ({len(self.source_models())}), "
                             f"got {len(self.scaling)}")
        if len(self.branches) > 1 and len({os.path.normpath(b) for b in self.branches}) == 1 and not self.allow_same:
            raise ValueError(f"every expert comes from the same model ({self.branches[0]}): the MoE would compute what "
                             "that model computes at a higher cost; set init.allow_same=true to build it anyway (e.g. "
                             "to train it)")

    def prepare(self, ctx: InitContext) -> None:
        if len(ctx.branches) != len(self.source_models()):
            raise ValueError(f"sources: {len(ctx.branches)} source FFNs for {len(self.source_models())} models at "
                             f"{ctx.path}")

    def _scaled(self, w: FFNWeights, i: int, gen: torch.Generator) -> FFNWeights:
        if not self.scaling:
            return w
        s = self.scaling[i]

        def noisy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or s.noise_scale == 0:
                return t
            return t + (torch.randn(t.shape, generator=gen) * s.noise_scale).to(t.dtype).to(t.device)  # CPU draws

        w = replace(w, gate=noisy(w.gate), up=noisy(w.up), down=noisy(w.down))
        return w if s.residual_scale == 1 else replace(w, down=w.down * s.residual_scale)

    def expert(self, ctx: InitContext, state, i: int) -> FFNWeights:
        return self._scaled(ctx.branches[i], i, ctx.generator)

    def shared(self, ctx: InitContext) -> FFNWeights | None:
        if not ctx.spec.shared_expert:
            return None
        return self._scaled(ctx.branches[-1] if self.shared_source is not None else ctx.dense, len(self.branches),
                            ctx.generator)
