"""The expert-initialization interface: one config class per method, registered by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from moekit.config import Config
from moekit.ffn import ExpertWeights, FFNWeights
from moekit.registry import Registry

if TYPE_CHECKING:
    from moekit.moe.spec import MoESpec


@dataclass
class InitContext:
    """Everything an init method may look at for one layer."""

    dense: FFNWeights  # the dense FFN being replaced
    spec: MoESpec
    generator: torch.Generator  # seeded per layer from spec.seed and the layer path
    branches: list[FFNWeights] = field(default_factory=list)  # same FFN in each branch (BTX only)
    path: str = ""  # module path, for messages


class ExpertInitConfig(Config):
    """Base class. Subclasses set `method: Literal[...]` and implement `init_experts`."""

    method: str
    default_scoring: ClassVar[str] = "topk_softmax"
    default_router_init: ClassVar[str] = "normal"
    needs_branches: ClassVar[bool] = False

    def check(self, spec: MoESpec) -> None:
        """Raise ValueError if this method cannot work with `spec` (called during spec validation)."""

    def init_experts(self, ctx: InitContext) -> ExpertWeights:
        raise NotImplementedError


EXPERT_INITS: Registry[type[ExpertInitConfig]] = Registry("expert init method")


def copies(ctx: InitContext, experts: list[FFNWeights] | None = None, **extra) -> ExpertWeights:
    """Stack `experts` (default: E copies of the dense FFN) and add the dense-copied shared expert."""
    spec = ctx.spec
    experts = experts if experts is not None else [ctx.dense] * spec.num_experts
    shared = ctx.dense.clone() if spec.shared_expert else None
    return ExpertWeights.stack(experts, shared=shared, **extra)


def require_equal_to_dense(spec: MoESpec, method: str, scoring: str) -> None:
    """Methods whose MoE equals the dense model at init need this router scoring and no shared expert."""
    if spec.scoring != scoring:
        raise ValueError(f"{method} keeps the MoE equal to the dense model only with router.scoring={scoring!r}")
    if spec.shared_expert:
        raise ValueError(f"{method} keeps the MoE equal to the dense model; a shared expert would add a second "
                         "copy of the FFN output. Use shared_expert=false")
