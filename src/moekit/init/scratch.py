from __future__ import annotations

import math
from typing import Literal

import torch

from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext


def _linear_init(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """torch.nn.Linear's default weight/bias init: U(-1/√fan_in, 1/√fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def fresh_ffn(like: FFNWeights, gen: torch.Generator) -> FFNWeights:
    """An FFN of `like`'s shapes, biases and activation, drawn anew with nn.Linear's init."""
    H, I, dt = like.hidden_size, like.intermediate_size, like.up.dtype

    def draw(t: torch.Tensor | None, fan_in: int) -> torch.Tensor | None:
        return None if t is None else _linear_init(tuple(t.shape), fan_in, gen, dt)

    return like.clone(up=draw(like.up, H), down=draw(like.down, I), gate=draw(like.gate, H),
                      up_bias=draw(like.up_bias, H), gate_bias=draw(like.gate_bias, H),
                      down_bias=draw(like.down_bias, I))


@EXPERT_INITS.register("scratch")
class ScratchInit(ExpertInitConfig):
    """Experts for an MoE trained from scratch (Switch / Omni-router, Gu et al. 2025 §5): each routed
    expert is drawn independently with torch.nn.Linear's default init (Kaiming-uniform, bound
    1/√fan_in); only the shapes, biases and activation of the dense FFN are kept, never its values.
    A shared expert, if any, copies the dense FFN (itself freshly initialized in a from-scratch model).
    Switch routing by default: softmax, then top-k of the probabilities (Fedus et al. 2022, eq. 2)."""

    method: Literal["scratch"] = "scratch"
    default_scoring = "softmax_topk"

    def expert(self, ctx: InitContext, state, i: int) -> FFNWeights:
        return fresh_ffn(ctx.dense, ctx.generator)
