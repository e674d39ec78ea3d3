"""Top-k router and the RoutingInfo it returns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moekit.moe import triton_experts
from moekit.moe.permute import layer_counts

Scoring = Literal["softmax_topk", "topk_softmax"]


@dataclass
class RoutingInfo:
    """What a router decided for T tokens."""

    logits: Tensor  # (T, E) raw router logits
    topk_ids: Tensor  # (T, k) int64 expert ids
    topk_weights: Tensor  # (T, k) combine weights

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    def tokens_per_expert(self, mask: Tensor | None = None) -> Tensor:
        """(E,) how many (token, slot) assignments each expert got; `mask` (T,) drops padding (without a host
        sync: the padding's slots go to a bin that is not counted)."""
        return layer_counts(self.topk_ids[None], mask, self.num_experts)[0]  # (E,)


def route(logits: Tensor, top_k: int, scoring: Scoring) -> tuple[Tensor, Tensor]:
    """logits (T, E) -> fp32 weights (T, k), ids (T, k) under `scoring` (see Router)."""
    if scoring == "topk_softmax":  # softmax is monotone: the top-k logits pick the same experts
        top, ids = torch.topk(logits, top_k, dim=-1)  # (T, k), (T, k)
        return torch.softmax(top, dim=-1, dtype=torch.float32), ids  # rows sum to 1
    return torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)


class Router(nn.Module):
    """Linear router, weight (E, H).

    scoring="softmax_topk": p = softmax(logits); weights = top-k of p (they sum to < 1), as in
    Switch / Qwen2-MoE with norm_topk_prob=False. scoring="topk_softmax": the top-k probabilities
    renormalized to sum to 1, computed as the softmax over the top-k logits (the same
    numbers, two fewer (T, E) passes), as in Mixtral and UME.
    `jitter` multiplies the input by U(1-j, 1+j) in training (Switch / Mixtral).

    `dispatch`: "auto" runs the router in one Triton kernel (`triton_experts.route_tokens`: linear, top-k and the
    weights) where the experts' decode kernels run (CUDA, no autograd, T·k ≤ E, x in the weight's dtype, no
    autocast) and the weight is small enough for one program per token (`triton_experts.routes`), else three torch
    ops; "triton" also on CPU tensors under Triton's interpreter (tests); "eager" never.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: Scoring, jitter: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.scoring, self.jitter = num_experts, top_k, scoring, jitter
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.dispatch: Literal["auto", "eager", "triton"] = "auto"

    def forward(self, x: Tensor) -> RoutingInfo:
        """x (T, H) -> RoutingInfo over the T tokens."""
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        if self._fused(x):
            logits, weights, ids = triton_experts.route_tokens(x, self.weight, self.top_k,
                                                               self.scoring == "softmax_topk")  # (T, E), (T, k) x2
            return RoutingInfo(logits=logits, topk_ids=ids, topk_weights=weights)
        logits = F.linear(x, self.weight)  # (T, E)
        weights, ids = route(logits, self.top_k, self.scoring)  # (T, k), (T, k)
        weights = weights if weights.dtype == x.dtype else weights.to(x.dtype)  # a no-op .to() costs ~4 µs cold
        return RoutingInfo(logits=logits, topk_ids=ids, topk_weights=weights)

    def _fused(self, x: Tensor) -> bool:
        if self.dispatch == "eager" or (self.dispatch == "auto" and x.device.type != "cuda"):
            return False  # first: every forward of every router asks
        if (x.dtype != self.weight.dtype or not triton_experts.available(x.device)
                or torch.is_autocast_enabled(x.device.type)):  # autocast: F.linear's dtype, as eager computes it
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return False
        return triton_experts.routes(x.shape[0] * self.top_k, self.num_experts, x.shape[1])

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, jitter={self.jitter}"
