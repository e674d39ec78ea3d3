from __future__ import annotations

from typing import ClassVar, Literal

from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


@EXPERT_INITS.register("btx")
class BTXInit(ExpertInitConfig):
    """Branch-Train-MiX (Sukhbaatar et al. 2024, §2.2): N branch models trained from the same seed
    model; expert i of every MoE layer is branch i's FFN, and with `include_seed` (as Sukhbaatar et al. do,
    and SIMoE's BTX baseline, B.1) the seed model's FFN is one more expert, the last (E = N + 1). All other
    parameters are the average of the branches (and the seed), done by `moekit.upcycle`, which loads the
    branches; router random."""

    method: Literal["btx"] = "btx"
    branches: list[str]  # paths (or asset names) of the branch checkpoints, one per expert
    include_seed: bool = True
    needs_branches: ClassVar[bool] = True
    averages_non_ffn: ClassVar[bool] = True

    def source_models(self) -> list[str]:
        return list(self.branches)

    def with_source_models(self, paths: list[str]) -> BTXInit:
        return self.model_copy(update={"branches": list(paths)})

    def check(self, spec) -> None:
        if len(self.branches) + self.include_seed != spec.num_experts:
            raise ValueError(f"btx needs one branch per expert{' besides the seed' * self.include_seed}: "
                             f"num_experts={spec.num_experts} but {len(self.branches)} branches were given")

    def prepare(self, ctx: InitContext) -> None:
        if len(ctx.branches) + self.include_seed != ctx.spec.num_experts:
            raise ValueError(f"btx: {len(ctx.branches)} branch FFNs for {ctx.spec.num_experts} experts at {ctx.path}")

    def expert(self, ctx: InitContext, state, i: int) -> FFNWeights:
        return ctx.branches[i] if i < len(ctx.branches) else ctx.dense
