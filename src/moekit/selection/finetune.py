"""Selective fine-tuning: only the selected experts train, inside fused 3-D expert tensors.

All experts of a layer are one Parameter (E, ...) in moekit and transformers v5, so requires_grad
cannot freeze one expert. `attach` parametrizes every expert tensor whose dim 0 is the expert dim
(torch.nn.utils.parametrize, unsafe): the trainable `original` holds only the K selected rows,
the full tensor is a frozen buffer, and the forward sees base.index_copy(0, ids, rows). Everything
else (routers, attention, embeddings, norms, shared experts, other layers) gets requires_grad=False.
So gradients and AdamW state scale with K, and weight decay can never reach a frozen row: the update
is confined to the selected subnetwork (the premise of RISE Theorem 1). `merge` puts the trained
rows back into plain parameters for saving and export.
"""
from __future__ import annotations

import math
import random
import tempfile
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..errors import ConfigError
from ..routing.sites import RouterSite, SplitExperts, expert_rows, routed_ids, zero_experts
from .common import experts_of, resolve
from .selection import Selection


class ExpertRows(nn.Module):
    """Parametrization of a stacked expert tensor (E, ...) whose trainable part is K rows (K, ...).

    The full tensor is computed once per forward of the experts module (a forward pre-hook turns
    caching on), not once per attribute access: transformers' eager experts index it per expert.
    `take`/`initial`/`shared` (expert parallelism): the parameter holds all K selected rows of the layer, `initial`,
    while this process's tensor is its share of the experts; rows `take` of the parameter go to its experts `ids`,
    and `shared(rows)` (identity forward) sums the rows' gradients over the ranks that share them.
    """

    def __init__(self, base: Tensor, ids: Tensor, take: Tensor | None = None, initial: Tensor | None = None,
                 shared=None):
        super().__init__()
        self.register_buffer("base", base.detach(), persistent=False)  # (E, ...) frozen, shares storage
        self.register_buffer("ids", ids, persistent=False)  # (K,)
        self.register_buffer("take", take, persistent=False)  # (K_local,) rows of the parameter, or None: all
        self.initial = initial  # (K, ...), read once by right_inverse
        self.shared = shared
        self.caching = False
        self._full: Tensor | None = None

    def forward(self, rows: Tensor) -> Tensor:
        if self._full is not None:
            return self._full
        if self.take is not None:
            rows = self.shared(rows).index_select(0, self.take)  # (K_local, ...)
        full = self.base.index_copy(0, self.ids, rows)  # (E, ...): rows in place, gradient to rows only
        if self.caching:
            self._full = full
        return full

    def right_inverse(self, full: Tensor) -> Tensor:
        if self.initial is not None:
            initial, self.initial = self.initial, None
            return initial
        return full.index_select(0, self.ids)  # (K, ...)

    def set_caching(self, on: bool) -> None:
        self.caching, self._full = on, None


@dataclass
class SelectiveHandle:
    """What `attach` did: the trainable row parameters, and how to undo it (`merge`)."""

    model: nn.Module
    trainable: list[nn.Parameter]
    per_expert: dict[str, int]  # layer -> elements of one expert (all its stacked tensors)
    experts: dict[str, list[int]]
    _flags: list[tuple[nn.Parameter, bool]] = field(default_factory=list, repr=False)
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def merge(self) -> nn.Module:
        """Plain parameters with the trained rows in place; requires_grad restored to what it was."""
        for h in self._hooks:
            h.remove()
        merge(self.model)
        for p, flag in self._flags:
            p.requires_grad_(flag)
        return self.model


def _expert_tensors(site: RouterSite) -> list[str]:
    """Names of the experts module's parameters stacked along the expert dim (dim 0): its own (E, ...) ones (LongCat-
    Flash's down_proj: its routed experts' rows alone; JetMoE's: its two children's), or DBRX's (E·n, ...) rows of
    every expert in its child (`mlp.w1`, ...)."""
    if expert_rows(site.experts, site.num_experts):
        return [n for n, _ in site.experts.named_parameters()]
    return [n for n, p in site.experts.named_parameters(recurse=isinstance(site.experts, SplitExperts))
            if p.dim() >= 1 and p.shape[0] in (site.num_experts, site.num_experts - zero_experts(site))]


def _per_expert(site: RouterSite) -> int:
    """Elements of one expert across its stacked tensors."""
    if expert_rows(site.experts, site.num_experts):
        return sum(p.numel() for p in site.experts.parameters()) // site.num_experts
    return sum((p := site.experts.get_parameter(n)).numel() // p.shape[0] for n in _expert_tensors(site))


def expert_row_ids(site: RouterSite, ids: list[int]) -> list[int]:
    """The rows of the layer's stacked expert tensors that experts `ids` hold: one each, or DBRX's I each (its
    (E·I, H) tensors)."""
    n = site.experts.get_parameter(_expert_tensors(site)[0]).shape[0] // site.num_experts
    return [e * n + j for e in ids for j in range(n)]


def _attach_layer(site: RouterSite, ids: list[int]) -> tuple[list[nn.Parameter], list]:
    return attach_rows(site.experts, _expert_tensors(site), expert_row_ids(site, ids))


def owner(experts: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding stacked tensor `name` of an experts module (a dotted name: of its child, JetMoE's
    input_linear.weight) and the tensor's name there."""
    path, _, leaf = name.rpartition(".")
    return experts.get_submodule(path), leaf


def attach_rows(experts: nn.Module, names: list[str], ids: list[int], take: list[int] | None = None,
                initial: dict[str, Tensor] | None = None, shared=None) -> tuple[list[nn.Parameter], list]:
    """Parametrize the stacked tensors `names` of an experts module (a dotted name: of its child) so that only rows
    `ids` train; (the trainable row parameters, the caching hooks, on the experts module). Expert parallelism: the
    module holds this rank's share, `ids` index it, and each parameter holds `initial[name]`, every selected row of
    the layer, of which rows `take` are this share's; `shared` sums their gradients over the ranks (ExpertRows)."""
    trainable, rows = [], []
    for name in names:
        module, leaf = owner(experts, name)
        full = getattr(module, leaf)
        idx = torch.tensor(ids, dtype=torch.long, device=full.device)  # (K,) or (K_local,)
        if initial is None:
            rows.append(ExpertRows(full, idx))
        else:
            rows.append(ExpertRows(full, idx, torch.tensor(take, dtype=torch.long, device=full.device), initial[name],
                                   shared))
        parametrize.register_parametrization(module, leaf, rows[-1], unsafe=True)
        p = module.parametrizations[leaf].original  # the same Parameter object, now (K, ...)
        p.requires_grad_(True)
        trainable.append(p)

    hooks = [experts.register_forward_pre_hook(_caching(rows, True)),
             experts.register_forward_hook(_caching(rows, False), always_call=True)]
    return trainable, hooks


def _caching(rows: list[ExpertRows], on: bool):
    def hook(*args) -> None:
        for r in rows:
            r.set_caching(on)
    return hook


def attach(model: nn.Module, selection: Selection | dict[str, list[int]]) -> SelectiveHandle:
    """Make only the selected experts of `model` trainable (in place); see the module docstring."""
    if any(isinstance(m, ExpertRows) for m in model.modules()):
        raise ConfigError("the model already has selective-training parametrizations; merge them first")
    layers = [(site, ids) for site, selected in resolve(model, selection) if (ids := routed_ids(site, selected))]
    if not layers:
        raise ConfigError("the selection names no experts with weights (zero-computation experts hold none): nothing "
                          "would train")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    trainable, hooks, per_expert = [], [], {}
    for site, ids in layers:
        per_expert[site.name] = _per_expert(site)
        params, h = _attach_layer(site, ids)
        trainable += params
        hooks += h
    return SelectiveHandle(model, trainable, per_expert, {s.name: ids for s, ids in layers}, flags, hooks)


def merge(model: nn.Module) -> int:
    """Remove every ExpertRows parametrization, leaving plain (E, ...) parameters with the trained
    rows in place (the same Parameter objects). Returns how many tensors were merged.
    SelectiveHandle.merge also removes the caching hooks and restores every requires_grad flag."""
    n = 0
    for module in list(model.modules()):
        plist = getattr(module, "parametrizations", None)
        if not parametrize.is_parametrized(module) or plist is None:
            continue
        for name in [k for k, v in plist.items() if len(v) == 1 and isinstance(v[0], ExpertRows)]:
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            getattr(module, name).grad = None  # a (K, ...) gradient no longer fits the (E, ...) tensor
            n += 1
    return n
