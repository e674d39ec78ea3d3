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
                 variant: Literal["topk", "argmax"] = "topk") -> Tensor:
    """Switch load-balance loss E · Σ_i f_i · P_i (Fedus et al. 2022, eqs. 4-6).

    P_i = mean router probability of expert i. f_i = fraction of routed assignments to expert i:
    over all T·k top-k slots (variant="topk"), or over each token's argmax expert as in Switch
    and UME eq. 3 (variant="argmax"). Equals 1 for perfectly uniform routing.
    """
    logits, ids = _select(info, mask)
    E = logits.shape[-1]
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    chosen = ids if variant == "topk" else probs.argmax(dim=-1, keepdim=True)  # (T, k) or (T, 1)
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()  # (E,)
    P = probs.mean(dim=0)  # (E,)
    return E * torch.sum(f * P)


def z_loss(info: RoutingInfo, mask: Tensor | None = None) -> Tensor:
    """Router z-loss mean_t (logsumexp_i logits_ti)² (Zoph et al. 2022, ST-MoE eq. 5)."""
    logits, _ = _select(info, mask)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def mean_over_layers(fn, infos: Sequence[RoutingInfo], mask: Tensor | None = None, **kw) -> Tensor:
    """A per-layer loss averaged over MoE layers (how the recipes weight LB and z-loss)."""
    if not infos:
        raise ValueError("no routing information: run a forward pass through an MoE model first")
    return torch.stack([fn(i, mask, **kw) for i in infos]).mean()
