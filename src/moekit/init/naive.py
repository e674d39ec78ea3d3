from __future__ import annotations

from typing import Literal

from moekit.ffn import ExpertWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext, copies


@EXPERT_INITS.register("naive")
class NaiveInit(ExpertInitConfig):
    """Sparse upcycling (Komatsuzaki et al. 2022, §3): every expert is an exact copy of the dense FFN."""

    method: Literal["naive"] = "naive"

    def init_experts(self, ctx: InitContext) -> ExpertWeights:
        return copies(ctx)
