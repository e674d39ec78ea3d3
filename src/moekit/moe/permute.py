"""Routing metadata and the token permutation around grouped experts, with no host sync and no atomics.

Every op here stays on the device (no `.tolist()`, `.item()`, boolean indexing or CUDA `bincount`, each of
which reads back to the host) and is deterministic: the k slots of a token are summed by a reshape and a
sum in float32, never by `index_add` (float atomics on CUDA, summed in the tensor's dtype), the way
transformers' `grouped_mm_experts_forward` combines them.
"""
from __future__ import annotations

import torch
from torch import Tensor


def expert_counts(ids: Tensor, num_experts: int) -> Tensor:
    """ids (...) int expert ids -> (E,) int64 counts. Ids outside [0, E) are not counted (a sentinel E drops a
    slot). CUDA's bincount reads the ids' min and max back to the host; histc with fixed bounds does not."""
    flat = ids.reshape(-1)  # (S,)
    if flat.device.type == "cpu":
        return torch.bincount(flat.clamp(0, num_experts), minlength=num_experts + 1)[:num_experts]
    if num_experts == 1:  # histc's range would be empty
        return (flat == 0).sum().reshape(1)
    # histc wants an integer input on CUDA under deterministic algorithms (transformers does the same)
    return torch.histc(flat.int(), bins=num_experts, min=0, max=num_experts - 1).long()  # (E,)


def layer_counts(ids: Tensor, keep: Tensor | None, num_experts: int) -> Tensor:
    """ids (L, T, c) expert ids of L layers, keep (T,) 0/1 or bool (None: every token) -> (L, E) int64 slots per
    layer and expert over the kept tokens, in one histogram (layer l's experts are bins l·E ... l·E + E − 1; a
    dropped token's slots go to no bin)."""
    L, E = ids.shape[0], num_experts
    binned = ids + torch.arange(L, device=ids.device).view(L, 1, 1) * E  # (L, T, c)
    if keep is not None:
        binned = torch.where(keep.to(ids.device).reshape(1, -1, 1) > 0, binned, L * E)
    return expert_counts(binned, L * E).view(L, E)


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """topk ids (T, k) -> order (S,) the slots sorted by expert (stable, so deterministic), counts (E,)."""
    flat = ids.reshape(-1)  # (S,) slot s belongs to token s // k
    return torch.argsort(flat, stable=True), expert_counts(flat, num_experts)


def combine(y: Tensor, order: Tensor, k: int) -> Tensor:
    """y (S, H) rows in expert order -> (T, H): each token's k rows summed in float32 (no atomics)."""
    slots = y.new_empty(y.shape).index_copy_(0, order, y)  # (S, H) back in slot order: a permutation
    return slots.view(-1, k, y.shape[-1]).sum(1, dtype=torch.float32).to(y.dtype)  # (T, H)


class Gather(torch.autograd.Function):
    """x (T, H) -> x[order // k] (S, H), its rows in expert order. Backward: `combine` (each token's k
    gradients summed in float32), where index_select's own backward adds them with atomics."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)  # (S, H)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return combine(grad, order, ctx.k), None, None


class Combine(torch.autograd.Function):
    """`combine` with its adjoint as backward: each slot's gradient is its token's (a gather, no atomics)."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return combine(y, order, k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order // ctx.k), None, None  # (S, H)
