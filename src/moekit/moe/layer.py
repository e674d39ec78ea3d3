"""The MoE layer: a drop-in replacement for a dense FFN module (same input and output shape)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from moekit.moe.ffn import FFNWeights
from moekit.moe.experts import Experts
from moekit.moe.router import Router, RoutingInfo


class SharedExpert(nn.Module):
    """An always-on dense FFN added to the routed output without a gate (SPRI eq. 3)."""

    def __init__(self, w: FFNWeights):
        super().__init__()
        H, I = w.hidden_size, w.intermediate_size
        self.act = w.act
        self.act_fn = ACT2FN[w.act]
        self.gate_proj = nn.Linear(H, I, bias=w.gate_bias is not None) if w.gated else None
        self.up_proj = nn.Linear(H, I, bias=w.up_bias is not None)
        self.down_proj = nn.Linear(I, H, bias=w.down_bias is not None)
        with torch.no_grad():
            for lin, wt, b in ((self.gate_proj, w.gate, w.gate_bias), (self.up_proj, w.up, w.up_bias),
                               (self.down_proj, w.down, w.down_bias)):
                if lin is not None:
                    lin.weight.copy_(wt)
                    if b is not None:
                        lin.bias.copy_(b)

    def to_weights(self) -> FFNWeights:
        def b(lin):
            return None if lin is None or lin.bias is None else lin.bias.detach()

        g = self.gate_proj
        return FFNWeights(up=self.up_proj.weight.detach(), down=self.down_proj.weight.detach(), act=self.act,
                          gate=None if g is None else g.weight.detach(), up_bias=b(self.up_proj),
                          gate_bias=b(g), down_bias=b(self.down_proj))

    def decode_weights(self, gate: nn.Linear | None, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
        """(gate (I, H), up (I, H), down (H, I), the gate row (H,) or None) for the experts' decode kernels
        (triton_experts.decode_experts), where they compute what `forward` (and the layer's sigmoid gate) would:
        gated SiLU without biases, in x's dtype, no autocast, nothing to record for autograd; else None."""
        lins = [lin for lin in (self.gate_proj, self.up_proj, self.down_proj, gate) if lin is not None]
        if (self.gate_proj is None or self.act != "silu" or any(lin.bias is not None for lin in lins)
                or any(lin.weight.dtype != x.dtype for lin in lins) or torch.is_autocast_enabled(x.device.type)
                or (torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in lins))):
            return None
        return (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                None if gate is None else gate.weight.reshape(-1))

    def forward(self, x: Tensor) -> Tensor:
        u = self.up_proj(x)
        h = self.act_fn(self.gate_proj(x)) * u if self.gate_proj is not None else self.act_fn(u)
        return self.down_proj(h)


class MoELayer(nn.Module):
    """y = Σ_{i∈topk(x)} g_i(x) E_i(x) [+ S(x)], applied token-wise; with `shared_gate` (Qwen2-MoE's
    shared_expert_gate, a Linear(H, 1)) the shared term is sigmoid(shared_gate(x))·S(x).

    `router` may be the same module object in several layers (Omni-router); each layer feeds it
    its own hidden state. After each forward, `last_routing` holds this layer's RoutingInfo
    (read by aux losses and routing capture; not a global list).
    """

    def __init__(self, router: Router, experts: Experts, shared: SharedExpert | None = None, dropout: float = 0.0,
                 shared_gate: nn.Linear | None = None):
        super().__init__()
        self.router, self.experts, self.shared, self.shared_gate = router, experts, shared, shared_gate
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.last_routing: RoutingInfo | None = None
        # optional RoutingInfo -> RoutingInfo applied after the router: routing analysis uses it to
        # permute decisions (moekit.routing.permutation) and to disable experts (moekit.selection.prune)
        self.reroute: Callable[[RoutingInfo], RoutingInfo] | None = None
        self.init_diversity: float | None = None  # the experts' diversity when upcycled (SPRI A.1; moekit.json)

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None) -> Tensor:
        """`residual`: added to the output, for the FFNs it replaces that add it themselves (BLOOM's and MPT's MLPs,
        called as `mlp(x, residual)`)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (T, H)
        info = self.router(x)
        if self.reroute is not None:
            info = self.reroute(info)
        fused = self._decode_shared(x, info)  # the shared expert inside the decode kernels, or None
        y = self.experts(x, info.topk_ids, info.topk_weights, *([fused] if fused else []))  # (T, H)
        if self.shared is not None and fused is None:
            s = self.shared(x)  # (T, H)
            y = y + (s if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * s)  # gate (T, 1)
        if self.dropout is not None:
            y = self.dropout(y)
        self.last_routing = info
        return y.reshape(shape) if residual is None else residual + y.reshape(shape)

    def _decode_shared(self, x: Tensor, info: RoutingInfo) -> tuple | None:
        """The shared expert's weights where the experts' decode kernels add it: not where something replaced the
        experts' forward (transformers' expert parallelism dispatches exactly 3 arguments across ranks)."""
        if (self.shared is None or getattr(self.experts.forward, "__func__", None) is not Experts.forward
                or not self.experts.decoding(x, info.topk_ids, info.topk_weights)):
            return None
        return self.shared.decode_weights(self.shared_gate, x)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """All MoE layers of a model, in module order, with their paths."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
