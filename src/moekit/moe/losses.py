"""Router auxiliary losses: pure functions of RoutingInfo, padding-mask aware.

`mask` is a (T,) bool/0-1 tensor over the flattened tokens (e.g. attention_mask.reshape(-1));
masked-out tokens count neither in expert loads nor in router probabilities.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from moekit.moe.permute import expert_counts
from moekit.moe.router import RoutingInfo


def _keep(logits: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(T,) float32 weights of the kept tokens (1 or 0) and their number (at least 1, so an all-padding batch
    gives 0, not NaN). A mask weights the tokens instead of indexing them: boolean indexing reads the count
    back to the host, a sync in every training step on a GPU."""
    if mask is None:
        keep = logits.new_ones(logits.shape[0], dtype=torch.float32)
    else:
        keep = mask.reshape(-1).to(device=logits.device, dtype=torch.float32)  # (T,)
    return keep, keep.sum().clamp_min(1.0)


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
    E = logits.shape[-1]
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    keep, n = _keep(logits, mask)  # (T,), ()
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    top = probs.argmax(dim=-1, keepdim=True)  # (T, 1)
    chosen = info.topk_ids if variant == "topk" else top  # (T, k) or (T, 1)
    dropped = torch.where(keep[:, None] > 0, chosen, E)  # (T, c): padding's slots go to a bin that is not counted
    f = expert_counts(dropped, E).float() / (n * chosen.shape[1])  # (E,)
    if variant == "omni":  # eq. 3.4: only each token's argmax probability counts, toward its argmax expert
        probs = probs * torch.zeros_like(probs).scatter_(1, top, 1.0)  # (T, E): p_tj where j is t's argmax
    rho = (probs * keep[:, None]).sum(dim=0) / n  # (E,)
    return E * torch.sum(f * rho)


def z_loss(info: RoutingInfo, mask: Tensor | None = None) -> Tensor:
    """Router z-loss mean_t (logsumexp_i logits_ti)² (Zoph et al. 2022, ST-MoE eq. 5)."""
    logits = info.logits.float()  # (T, E)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    keep, n = _keep(logits, mask)
    return (torch.logsumexp(logits, dim=-1).pow(2) * keep).sum() / n


def over_layers(fn, infos: Sequence[RoutingInfo], mask: Tensor | None = None,
                reduction: Literal["sum", "mean"] = "sum", **kw) -> Tensor:
    """A per-layer loss summed (UME §III-C-2, Omni-router L_load) or averaged over MoE layers."""
    if not infos:
        raise ValueError("no routing information: run a forward pass through an MoE model first")
    per_layer = torch.stack([fn(i, mask, **kw) for i in infos])
    return per_layer.sum() if reduction == "sum" else per_layer.mean()
