"""The expert-initialization interface: one config class per method, registered by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from moekit.config import Config
from moekit.moe.ffn import ExpertWeights, FFNWeights
from moekit.moe.spec import EXPERT_INITS, MoESpec  # noqa: F401  (EXPERT_INITS: the methods register here)


@dataclass
class InitContext:
    """Everything an init method may look at for one layer."""

    dense: FFNWeights  # the dense FFN being replaced
    spec: MoESpec
    generator: torch.Generator  # seeded per layer from spec.seed and the layer path
    branches: list[FFNWeights] = field(default_factory=list)  # same FFN in each of init.source_models()
    path: str = ""  # module path, for messages


class ExpertInitConfig(Config):
    """Base class. Subclasses set `method: Literal[...]` and override `expert` (and `prepare` for work done
    once per layer). Experts are produced one at a time, in order, so that a streaming upcycle holds one
    expert at a time; `init_experts` stacks the very same calls for the in-memory path (bit-identical).
    The dense FFN arrives in float32 (or wider); the caller casts the results to the output dtype."""

    method: str
    default_scoring: ClassVar[str] = "topk_softmax"
    default_router_init: ClassVar[str] = "normal"
    needs_branches: ClassVar[bool] = False  # reads FFNs from source_models() (upcycle's `branches` models)
    averages_non_ffn: ClassVar[bool] = False  # non-FFN weights = the mean over the branches (btx), else the base's
    granular: ClassVar[bool] = False  # accepts MoESpec.granularity > 1 (experts i = 0 .. E·G-1 are then shards)

    def source_models(self) -> list[str]:
        """The checkpoints besides the base model whose FFNs this method reads, in the order of
        InitContext.branches."""
        return []

    def with_source_models(self, paths: list[str]) -> ExpertInitConfig:
        """This config reading `paths` (e.g. resolved locations) in place of source_models()."""
        return self

    def scoring_default(self, spec: MoESpec) -> str:
        """The router scoring when the spec names none."""
        return self.default_scoring

    def router_init_default(self, spec: MoESpec) -> str:
        """The router init when the spec names none."""
        return self.default_router_init

    def check(self, spec: MoESpec) -> None:
        """Raise ValueError if this method cannot work with `spec` (called during spec validation)."""

    def prepare(self, ctx: InitContext) -> Any:
        """Per-layer state shared by the experts (e.g. SPRI's SVD basis); called once, before `expert`."""
        return None

    def expert(self, ctx: InitContext, state: Any, i: int) -> FFNWeights:
        """Routed expert i (called for i = 0 .. spec.routed_experts - 1, in order: random draws follow that
        order). Default: a copy of the dense FFN."""
        return ctx.dense

    def shared(self, ctx: InitContext) -> FFNWeights | None:
        """The always-on shared expert if the spec has one: the dense FFN (SPRI eq. 8)."""
        return ctx.dense if ctx.spec.shared_expert else None

    def init_experts(self, ctx: InitContext) -> ExpertWeights:
        """All routed experts stacked, plus the shared expert (the in-memory path)."""
        state = self.prepare(ctx)
        experts = [self.expert(ctx, state, i) for i in range(ctx.spec.routed_experts)]
        shared = self.shared(ctx)
        return ExpertWeights.stack(experts, shared=None if shared is None else shared.clone())


def require_equal_to_dense(spec: MoESpec, method: str, scoring: str) -> None:
    """Methods whose MoE equals the dense model at init need this router scoring and no shared expert."""
    if spec.scoring != scoring:
        raise ValueError(f"{method} keeps the MoE equal to the dense model only with router.scoring={scoring!r}")
    if spec.shared_expert:
        raise ValueError(f"{method} keeps the MoE equal to the dense model; a shared expert would add a second "
                         "copy of the FFN output. Use shared_expert=false")
