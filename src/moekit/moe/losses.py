"""Router auxiliary losses: pure functions of RoutingInfo, padding-mask aware.

`mask` is a (T,) bool/0-1 tensor over the flattened tokens (e.g. attention_mask.reshape(-1));
masked-out tokens count neither in expert loads nor in router probabilities.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from moekit.moe.permute import layer_counts
from moekit.moe.router import RoutingInfo


def _keep(T: int, mask: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """(T,) float32 weights of the kept tokens (1 or 0) and their number (at least 1, so an all-padding batch
    gives 0, not NaN). A mask weights the tokens instead of indexing them: boolean indexing reads the count
    back to the host, a sync in every training step on a GPU."""
    if mask is None:
        keep = torch.ones(T, device=device)
    else:
        keep = mask.reshape(-1).to(device=device, dtype=torch.float32)  # (T,)
    return keep, keep.sum().clamp_min(1.0)


def _balance(logits: Tensor, ids: Tensor, keep: Tensor, n: Tensor, variant: str) -> Tensor:
    """(L,) load-balance losses of L layers: logits (L, T, E) float32, ids (L, T, k); see load_balance."""
    E = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)  # (L, T, E)
    top = probs.argmax(dim=-1, keepdim=True)  # (L, T, 1)
    chosen = ids if variant == "topk" else top  # (L, T, k) or (L, T, 1)
    f = layer_counts(chosen, keep, E).float() / (n * chosen.shape[-1])  # (L, E)
    if variant == "omni":  # eq. 3.4: only each token's argmax probability counts, toward its argmax expert
        probs = probs * torch.zeros_like(probs).scatter_(-1, top, 1.0)  # (L, T, E): p_tj where j is t's argmax
    rho = (probs * keep.view(1, -1, 1)).sum(dim=1) / n  # (L, E)
    return E * (f * rho).sum(dim=-1)


def _z(logits: Tensor, keep: Tensor, n: Tensor) -> Tensor:
    """(L,) z-losses of L layers: logits (L, T, E) float32."""
    return (torch.logsumexp(logits, dim=-1).pow(2) * keep).sum(dim=-1) / n


def load_balance(info: RoutingInfo, mask: Tensor | None = None,
                 variant: Literal["topk", "argmax", "omni"] = "topk") -> Tensor:
    """Load-balance loss E · Σ_j f_j · ρ_j of one layer.

    f_j = fraction of routed assignments to expert j: over all T·k top-k slots (variant="topk"), or over
    each token's argmax expert as in Switch (Fedus et al. 2022, eqs. 4-6) and UME eq. 2 (variant="argmax"
    and "omni"). ρ_j = mean router probability of expert j over all tokens (topk, argmax: Switch's P_j), or,
    Omni-router eq. 3.4 (variant="omni"), (1/T) Σ over the tokens whose argmax is j of their probability of j.
    The Switch forms equal 1 for perfectly uniform routing.
    """
    logits = info.logits.float()  # (T, E)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    keep, n = _keep(logits.shape[0], mask, logits.device)
    return _balance(logits[None], info.topk_ids[None], keep, n, variant)[0]


def z_loss(info: RoutingInfo, mask: Tensor | None = None) -> Tensor:
    """Router z-loss mean_t (logsumexp_i logits_ti)² (Zoph et al. 2022, ST-MoE eq. 5)."""
    logits = info.logits.float()  # (T, E)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    keep, n = _keep(logits.shape[0], mask, logits.device)
    return _z(logits[None], keep, n)[0]


def _usage(counts: Tensor) -> tuple[Tensor, Tensor]:
    """(L, E) slot counts -> (L,) expert-usage entropy (nats) and (L,) max load fraction."""
    frac = counts.float() / counts.sum(dim=-1, keepdim=True).clamp_min(1)  # (L, E)
    return -(frac * frac.clamp_min(1e-12).log()).sum(dim=-1), frac.amax(dim=-1)


def layer_stats(infos: Sequence[RoutingInfo], mask: Tensor | None = None,
                variant: Literal["topk", "argmax", "omni"] = "topk") -> dict[str, Tensor]:
    """Per layer of `infos`, each (L,): "lb" (load_balance), "z" (z_loss), "usage_entropy" (nats) and "max_load"
    (the busiest expert's fraction of the slots), padding excluded. Layers with the same routing shape are
    computed together, so a training step spends a fixed number of device ops on them, not a number per layer.
    `mask` (T,) applies to the layers that route T tokens (a decoder's); layers routing another number (an
    encoder's frames) keep all theirs."""
    groups: dict[tuple, list[int]] = {}
    for i, info in enumerate(infos):
        key = (tuple(info.logits.shape), info.logits.dtype, info.logits.device, tuple(info.topk_ids.shape))
        groups.setdefault(key, []).append(i)
    parts = []
    for idx in groups.values():
        logits = torch.stack([infos[i].logits for i in idx]).float()  # (l, T, E)
        ids = torch.stack([infos[i].topk_ids for i in idx])  # (l, T, k)
        T, E = logits.shape[1:]
        keep, n = _keep(T, mask if mask is not None and mask.numel() == T else None, logits.device)
        zeros = logits.new_zeros(len(idx))
        lb, z = (zeros, zeros) if T == 0 else (_balance(logits, ids, keep, n, variant), _z(logits, keep, n))
        parts.append((lb, z, *_usage(layer_counts(ids, keep, E))))
    names = ("lb", "z", "usage_entropy", "max_load")
    if len(parts) == 1:
        return dict(zip(names, parts[0]))
    order = torch.tensor([i for idx in groups.values() for i in idx]).argsort().tolist()  # back to layer order
    return {name: torch.cat([p[j] for p in parts])[order] for j, name in enumerate(names)}

