"""Stacked routed experts with grouped (sort-by-expert) dispatch.

Weights are stored like transformers v5: gated `gate_up` (E, 2I, H) = [gate; up] along dim 1, or
non-gated `up` (E, I, H); `down` (E, H, I); optional biases (E, 2I | I) and (E, H).

Dispatch sorts the T*k (token, slot) pairs by expert and runs one grouped matmul per projection
(`torch.nn.functional.grouped_mm`), so the backward writes every expert's weight gradient into one
tensor instead of materializing a full-size zero gradient per expert (transformers' `eager` loop).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

from moekit.ffn import ExpertWeights


def _groupable(x: Tensor, weight: Tensor) -> bool:
    """grouped_mm needs 16-byte aligned rows and pointers (x (S, in), weight (E, out, in))."""
    n = 16 // x.element_size()
    return (x.shape[0] > 0 and x.shape[1] % n == 0 and weight.shape[1] % n == 0
            and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _contiguous_grad(t: Tensor) -> Tensor:
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())  # grouped_mm's backward rejects stride-0 grads
    return t


def grouped_linear(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """x (S, in) sorted by expert, weight (E, out, in), offs (E,) cumulative counts -> (S, out)."""
    w_t = weight.transpose(1, 2)  # (E, in, out) view
    if _groupable(x, weight):
        return _contiguous_grad(F.grouped_mm(x, w_t, offs=offs))
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    parts = [xi @ w_t[e] for e, xi in enumerate(x.split(counts)) if xi.shape[0] > 0]  # odd shapes only
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


class WeightedSwiGLU(torch.autograd.Function):
    """y = silu(g) ⊙ u ⊙ w for h = [g | u] (S, 2I) and routing weights w (S, 1) or None.

    Same math as autograd on `silu(g) * u * w`, but the backward writes dg and du straight into one
    (S, 2I) gradient buffer (no concatenation of the two halves) with fused silu_backward.
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor | None) -> Tensor:
        g, u = h.chunk(2, dim=-1)  # (S, I) each
        a = F.silu(g)  # (S, I)
        au = a * u  # (S, I)
        ctx.save_for_backward(h, a, au, w)
        return au if w is None else au * w

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, a, au, w = ctx.saved_tensors
        g, u = h.chunk(2, dim=-1)
        dyw = dy if w is None else dy * w  # (S, I)
        dh = torch.empty_like(h)  # (S, 2I)
        dg, du = dh.chunk(2, dim=-1)
        torch.mul(dyw, a, out=du)
        torch.ops.aten.silu_backward.grad_input(dyw * u, g, grad_input=dg)
        dw = None if w is None else torch.linalg.vecdot(dy, au).unsqueeze(-1)  # (S, 1)
        return dh, dw


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str,
                 gated: bool = True, bias: bool = False):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.act, self.gated = act, gated
        self.act_fn = ACT2FN[act]
        first = 2 * I if gated else I
        self.register_parameter("gate_up" if gated else "up", nn.Parameter(torch.zeros(E, first, H)))
        self.down = nn.Parameter(torch.zeros(E, H, I))
        self.first_bias = nn.Parameter(torch.zeros(E, first)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, H)) if bias else None

    @property
    def first(self) -> Tensor:
        """The input projection: gate_up (E, 2I, H) or up (E, I, H)."""
        return self.gate_up if self.gated else self.up

    @classmethod
    def from_weights(cls, w: ExpertWeights) -> Experts:
        """Experts holding a copy of `w`, in w's dtype; each parameter is written once (no zero fill,
        no temporary for the gate/up concatenation)."""
        E, I, H = w.up.shape
        has_bias = w.up_bias is not None or w.down_bias is not None
        with torch.device("meta"):
            m = cls(E, H, I, w.act, gated=w.gate is not None, bias=has_bias).to(w.up.dtype)
        m.to_empty(device=w.up.device)
        with torch.no_grad():
            if m.gated:
                torch.cat([w.gate, w.up], dim=1, out=m.first)
            else:
                m.first.copy_(w.up)
            m.down.copy_(w.down)
            if has_bias:
                zeros = w.up.new_zeros(E, I)
                up_b = w.up_bias if w.up_bias is not None else zeros
                gate_b = w.gate_bias if w.gate_bias is not None else zeros
                m.first_bias.copy_(torch.cat([gate_b, up_b], dim=1) if m.gated else up_b)
                m.down_bias.copy_(w.down_bias if w.down_bias is not None else w.up.new_zeros(E, H))
        return m

    def to_weights(self) -> ExpertWeights:
        I = self.intermediate_size
        first, fb = self.first.detach(), None if self.first_bias is None else self.first_bias.detach()
        return ExpertWeights(
            up=first[:, I:] if self.gated else first, down=self.down.detach(), act=self.act,
            gate=first[:, :I] if self.gated else None,
            up_bias=None if fb is None else (fb[:, I:] if self.gated else fb),
            gate_bias=None if fb is None or not self.gated else fb[:, :I],
            down_bias=None if self.down_bias is None else self.down_bias.detach(),
        )

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """x (T, H), topk_ids (T, k), topk_weights (T, k) -> (T, H)."""
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)  # (S,) S = T*k, slot s belongs to token s // k
        order = torch.argsort(flat, stable=True)  # (S,) slots sorted by expert
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,)
        token = order // k  # (S,)
        weight = topk_weights.reshape(-1)[order].unsqueeze(-1).to(x.dtype)  # (S, 1)
        h = grouped_linear(x.index_select(0, token), self.first, offs)  # (S, 2I | I)
        if self.first_bias is not None:
            h = h + self.first_bias.index_select(0, flat[order])  # (S, 2I | I)
        # scale by the routing weight on the narrower side: w·(D h) = D (w·h) when there is no down bias
        early = self.down_bias is None and self.intermediate_size <= self.hidden_size
        if self.gated and self.act == "silu":
            h = WeightedSwiGLU.apply(h, weight if early else None)  # (S, I)
        else:
            if self.gated:
                gate, up = h.chunk(2, dim=-1)  # (S, I) each
                h = self.act_fn(gate) * up  # (S, I)
            else:
                h = self.act_fn(h)
            if early:
                h = h * weight  # (S, I)
        y = grouped_linear(h, self.down, offs)  # (S, H)
        if self.down_bias is not None:
            y = y + self.down_bias.index_select(0, flat[order])  # (S, H)
        if not early:
            y = y * weight  # (S, H)
        return x.new_zeros(T, x.shape[-1]).index_add(0, token, y)  # (T, H)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"act={self.act}, gated={self.gated}, bias={self.first_bias is not None}")
