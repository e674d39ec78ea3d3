"""Router auxiliary losses: pure functions of RoutingInfo, padding-mask aware.

`mask` is a (T,) bool/0-1 tensor over the flattened tokens (e.g. attention_mask.reshape(-1));
masked-out tokens count neither in expert loads nor in router probabilities.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from moekit.moe.router import RoutingInfo


def _select(info: RoutingInfo, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    logits, ids = info.logits.float(), info.topk_ids  # (T, E), (T, k)
    if mask is not None:
        keep = mask.reshape(-1).bool()  # (T,)
        logits, ids = logits[keep], ids[keep]
    return logits, ids


def load_balance(info: RoutingInfo, mask: Tensor | None = None,
                 variant: Literal["topk", "argmax", "omni"] = "topk") -> Tensor:
    """Load-balance loss E · Σ_j f_j · ρ_j of one layer.

    f_j = fraction of routed assignments to expert j: over all T·k top-k slots (variant="topk"), or over
    each token's argmax expert as in Switch (Fedus et al. 2022, eqs. 4-6) and UME eq. 2 (variant="argmax"
    and "omni"). ρ_j = mean router probability of expert j over all tokens (topk, argmax: Switch's P_j), or,
    Omni-router eq. 3.4 (variant="omni"), (1/T) Σ over the tokens whose argmax is j of their probability of j.
    The Switch forms equal 1 for perfectly uniform routing.
    """
    logits, ids = _select(info, mask)
    E = logits.shape[-1]
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    top = probs.argmax(dim=-1, keepdim=True)  # (T, 1)
    chosen = ids if variant == "topk" else top  # (T, k) or (T, 1)
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()  # (E,)
    if variant == "omni":  # eq. 3.4: only each token's argmax probability counts, toward its argmax expert
        rho = torch.zeros(E, device=probs.device).index_add(0, top[:, 0], probs.gather(1, top)[:, 0])  # (E,)
        rho = rho / probs.shape[0]
    else:
        rho = probs.mean(dim=0)  # (E,)
    return E * torch.sum(f * rho)


def z_loss(info: RoutingInfo, mask: Tensor | None = None) -> Tensor:
    """Router z-loss mean_t (logsumexp_i logits_ti)² (Zoph et al. 2022, ST-MoE eq. 5)."""
    logits, _ = _select(info, mask)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def over_layers(fn, infos: Sequence[RoutingInfo], mask: Tensor | None = None,
                reduction: Literal["sum", "mean"] = "sum", **kw) -> Tensor:
    """A per-layer loss summed (UME eq. 3, Omni-router L_load) or averaged over MoE layers."""
    if not infos:
        raise ValueError("no routing information: run a forward pass through an MoE model first")
    per_layer = torch.stack([fn(i, mask, **kw) for i in infos])
    return per_layer.sum() if reduction == "sum" else per_layer.mean()
