"""Disable experts: the router never picks them and the top-k is taken over the rest (RISE Table 5).

A disabled expert is made absent where the router computes, so each layer routes exactly as the same model without
those experts would (tested per family against the checkpoint with them removed, moekit.checkpoint.remove):
  moekit Router         its own rule re-applied to logits with the disabled experts at -inf (moekit.moe.router.route)
  transformers routers  every family of transformers 5 whose routing moekit reads (moekit.routing.sites): during the
                        router's forward, the product of its expert-row weight (F.linear, mm or matmul, also after
                        .float(), .to() or .t()) gets -inf in the disabled experts' columns, and each selection bias
                        of E entries (DeepSeek-V3's e_score_correction_bias, AFMoE's expert_bias, Zaya's
                        balancing_biases, GPT-OSS's router bias, ...) gets -inf there too. So whatever the family
                        computes from its logits (softmax, sigmoid, softcapping, sparsemixer, group scores, top-k,
                        renormalization) sees them as absent. The biases are weights: the pruning is in the saved
                        weights too.
Refused in one line before anything changes: fewer than top_k experts left (or, with group-limited routing, in the
groups it may search), a router whose choice does not come from its logits (DeepSeek-V4's hash routing by token id),
and a router without a weight of E rows. Checked at every forward: exactly one product of the expert-row weight;
at the first: no disabled expert picked with a non-zero weight.
A routing hook is not saved with the weights, so `save_pruned` writes pruned_experts.json beside them (its state
codec, moekit.checkpoint.codecs) and moekit's loaders disable the same experts again when they find it.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError, UnsupportedModelError
from ..moe.router import route
from ..routing.sites import RouterSite, expert_groups, hash_routed
from ..checkpoint.codecs import StateCodec
from .common import PRUNED_FILE, check_source, resolve, save_model, write_pruned
from .selection import Selection
from moekit.moe.state import model_state

# what a router may do to its expert-row weight before the product (the result is the same rows)
_SAME_ROWS = {Tensor.float, Tensor.to, Tensor.type, Tensor.half, Tensor.bfloat16, Tensor.contiguous, Tensor.detach,
              Tensor.t, Tensor.transpose, Tensor.T.__get__, Tensor.mT.__get__, torch.t, torch.transpose}
_PRODUCTS = {F.linear, torch.mm, torch.matmul, Tensor.mm, Tensor.matmul, Tensor.__matmul__}


class _AbsentExperts(TorchFunctionMode):
    """Active during one router forward: each product of the expert-row weight gets -inf in the columns of the
    disabled experts (the first E columns are the routed experts; Inkling's shared and Zaya's skip columns follow)."""

    def __init__(self, weight: Tensor, mask: Tensor):
        super().__init__()
        self.tracked, self.mask, self.products = {id(weight): weight}, mask, 0  # mask: (E,) True = disabled

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(isinstance(a, Tensor) and id(a) in self.tracked for a in (*args, *kwargs.values())):
            return out
        if func in _SAME_ROWS:
            self.tracked[id(out)] = out  # kept alive until the forward ends, so ids stay unique
        elif func in _PRODUCTS:
            self.products += 1
            cols = self.mask.new_zeros(out.shape[-1])  # (W,) W >= E
            cols[:self.mask.numel()] = self.mask
            out = out.masked_fill(cols, float("-inf"))
        return out


def _expert_rows(site: RouterSite) -> Tensor:
    """The router's weight whose rows are the experts (E rows, or E + Inkling's shared / Zaya's skip rows: the
    narrowest 2-D parameter with at least E rows)."""
    weights = [p for p in site.router.parameters() if p.dim() == 2 and p.shape[0] >= site.num_experts]
    if not weights:
        raise UnsupportedModelError(f"{site.name}: its router ({type(site.router).__name__}) has no weight with a row "
                                    f"per expert ({site.num_experts}); moekit cannot make an expert absent from it")
    return min(weights, key=lambda p: p.shape[0])


def _selection_biases(site: RouterSite, weight: Tensor) -> list[Tensor]:
    """The tensors of E (or the weight's row count) entries named *bias* that the router adds before it chooses: on the
    router and its children, or on the block itself (Hunyuan-V3 and MiniMax-M2 pass theirs to the router). A Linear's
    bias counts only for the expert-row weight's own Linear (GPT-OSS's router bias)."""
    widths = {site.num_experts, weight.shape[0]}
    owners = [site.block, *site.router.modules()]
    out = []
    for module in owners:
        if isinstance(module, nn.Linear) and module.weight is not weight:
            continue
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if (t is not None and "bias" in name and t.is_floating_point() and t.dim() <= 2
                    and t.shape[-1] in widths and t.numel() == t.shape[-1]):
                out.append(t)
    return out


def _check_groups(site: RouterSite, mask: Tensor) -> None:
    """Group-limited routing (DeepSeek-V2/V3 and their kin): a group scores by its best (the sum of its top 2; a group
    with fewer than 2 experts left scores -inf) and only topk_group groups are searched, so even the worst admissible
    choice of groups must leave top_k experts."""
    groups, searched = expert_groups(site), getattr(site.router, "topk_group", None)
    if groups is None or not isinstance(searched, int) or getattr(site.router, "topk_method", None) == "greedy":
        return
    left = (~mask).view(groups, -1).sum(-1).tolist()  # (G,) experts left per group
    finite = sorted(c for c in left if c >= 2)
    rest = sorted(c for c in left if c < 2)
    chosen = finite[:searched] if len(finite) >= searched else finite + rest[:searched - len(finite)]
    if sum(chosen) < site.top_k:
        raise ConfigError(f"{site.name}: with these experts disabled, {searched} of {groups} groups "
                          f"can hold only {sum(chosen)} experts, fewer than top_k={site.top_k}")


def _moekit_reroute(site: RouterSite, mask: Tensor):
    def fn(logits: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        w, i = route(logits.masked_fill(mask, float("-inf")), site.router.top_k, site.router.scoring)  # (T, k)
        return i, w.to(weights.dtype)
    return site.reroute(fn)


def _absent(site: RouterSite, mask: Tensor, weight: Tensor) -> list:
    """Hooks that run the router's forward under _AbsentExperts and check it: one product at every forward, and at
    the first one that no disabled expert was picked (reading the decision back would be a host sync per layer on
    an accelerator)."""
    modes, checked = [], []

    def enter(module, args):
        modes.append(_AbsentExperts(weight, mask))
        modes[-1].__enter__()

    def leave(module, args, out):
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if mode.products != 1:
            raise UnsupportedModelError(f"{site.name}: its router ({type(site.router).__name__}) computed "
                                        f"{mode.products} products of its expert-row weight, not one: moekit cannot "
                                        "tell which are the expert logits to prune")
        if checked:
            return
        checked.append(True)
        _, ids, w = site.decision(out)  # (T, k), (T, k)
        if bool((mask[ids] & (w != 0)).any()):
            raise UnsupportedModelError(f"{site.name}: its router ({type(site.router).__name__}) still picked a "
                                        "disabled expert: moekit cannot prune this family's routing")

    return [site.router.register_forward_pre_hook(enter),
            site.router.register_forward_hook(leave, always_call=True)]


class PruneHandle:
    """remove() re-enables the experts (restores the selection biases, removes routing hooks)."""

    def __init__(self, model: nn.Module, layers: list[str], handles: list, biases: list[tuple[Tensor, Tensor]]):
        self.model, self.layers, self.handles, self.biases = model, layers, handles, biases

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        with torch.no_grad():
            for buf, old in self.biases:
                buf.copy_(old)
        pruned = model_state(self.model).pruned
        for name in self.layers:
            pruned.pop(name, None)


def _plan(site: RouterSite, ids: list[int]) -> tuple[Tensor, Tensor | None]:
    """The layer's disabled mask (E,) and expert-row weight (None for moekit); raises if it cannot be pruned."""
    weight = None
    if not site.is_moekit:
        if hash_routed(site):
            raise UnsupportedModelError(f"{site.name}: its router ({type(site.router).__name__}) picks experts by "
                                        "token id (hash routing), not from logits: disabling an expert would change "
                                        "what the layer computes, not only where it routes")
        weight = _expert_rows(site)
    mask = torch.zeros(site.num_experts, dtype=torch.bool,
                       device=(site.router.weight if weight is None else weight).device)  # (E,)
    mask[ids] = True
    if int((~mask).sum()) < site.top_k:
        raise ConfigError(f"{site.name}: disabling {len(ids)} of {site.num_experts} experts leaves fewer "
                          f"than top_k={site.top_k}")
    if weight is not None:
        _check_groups(site, mask)
    return mask, weight


def prune(model: nn.Module, selection: Selection | dict[str, list[int]]) -> PruneHandle:
    """Disable the selected experts of `model` (in place). Every layer is checked before any changes.
    Layers named with an empty list get the rule too (then it decides as the model does).
    The disabled experts are recorded in moekit.moe.state.model_state(model).pruned (saved by moekit.selection.common.save_model)."""
    layers = resolve(model, selection)
    again = [s.name for s, _ in layers if s.name in model_state(model).pruned]
    if again:
        raise ConfigError(f"already pruned: {again[:5]}; remove() the earlier PruneHandle and prune once with all ids")
    plans = [(site, ids, *_plan(site, ids)) for site, ids in layers]
    handles, biases = [], []
    for site, ids, mask, weight in plans:
        if weight is None:
            handles.append(_moekit_reroute(site, mask))
            continue
        handles += _absent(site, mask, weight)
        for bias in _selection_biases(site, weight):
            biases.append((bias, bias.detach().clone()))
            with torch.no_grad():
                bias[..., :site.num_experts].masked_fill_(mask, float("-inf"))  # never chosen
    model_state(model).pruned.update({site.name: ids for site, ids in layers})
    return PruneHandle(model, [s.name for s, _ in layers], handles, biases)


def save_pruned(model: nn.Module, out: str | Path, overwrite: bool = False, tokenizer=None) -> Path:
    """Save a pruned model with its pruned_experts.json (moekit format or save_pretrained)."""
    if not model_state(model).pruned:
        raise ConfigError("the model has no pruned experts; call moekit.selection.prune.prune first")
    return save_model(model, out, overwrite, tokenizer)


def reapply(model: nn.Module, folder: str | Path) -> nn.Module:
    """Disable the experts listed in folder/pruned_experts.json, if there is one (the codec's `read`)."""
    f = Path(folder) / PRUNED_FILE
    if f.is_file():
        prune(model, Selection.load(f))
    return model


def kept_experts(model_dir: str | Path, selection: Selection, mode: str, allow_other_model: bool = False,
                 trust_remote_code: bool = False, log=None) -> dict[str, list[int]]:
    """{MoE block name: expert ids to keep} of a native checkpoint for `selection`: its experts (mode "keep") or every
    other expert of each MoE layer it names (mode "drop"), with LongCat-Flash's zero-computation experts in either
    (they hold no weights; dropping one is refused); for moekit.checkpoint.remove. A selection made for another
    model is refused unless `allow_other_model` (moekit.selection.common.check_source, with `log`)."""
    import json

    from moekit.checkpoint.dense import meta_model
    from moekit.checkpoint.files import read_text
    from moekit.checkpoint.remove import moe_blocks, native_config
    from moekit.routing.sites import zero_experts

    if (Path(model_dir) / "moekit.json").is_file():
        raise ConfigError(f"{model_dir} is a moekit checkpoint: removing experts needs a native transformers "
                          "checkpoint (`moekit export` writes one), or disable them (moekit prune without keep or "
                          "drop)")
    native_config(json.loads(read_text(model_dir, "config.json", "config")))
    model = meta_model(model_dir, trust_remote_code)
    check_source(selection, model, allow_other_model, log)
    sites = moe_blocks(model)
    out = {}
    for name, ids in selection.experts.items():
        if name not in sites:
            raise ConfigError(f"the selection's layer {name!r} is not an MoE layer of {model_dir} (its MoE layers: "
                              f"{list(sites)[:3]}{' ...' if len(sites) > 3 else ''})")
        experts = sites[name].num_experts
        bad = [e for e in ids if not 0 <= e < experts]
        if bad:
            raise ConfigError(f"the selection's layer {name!r} names expert {bad[0]}, outside [0, {experts}) of "
                              f"{model_dir}")
        routed = experts - zero_experts(sites[name])  # LongCat-Flash's zero-computation experts follow: always kept
        zero = [e for e in ids if e >= routed]
        if zero and mode == "drop":
            raise ConfigError(f"the selection drops expert {zero[0]} of {name!r}, a zero-computation expert "
                              "(LongCat-Flash's), which holds no weights to remove: disable it instead (moekit prune "
                              "without keep or drop)")
        out[name] = sorted({*ids, *range(routed, experts)}) if mode == "keep" else [
            e for e in range(experts) if e not in ids]
    return out


# ModelState.pruned rides along moekit's and transformers' formats (entry point in pyproject.toml)
CODEC = StateCodec(field="pruned", file=PRUNED_FILE, write=write_pruned, read=reapply)


def load_pruned(folder: str | Path) -> nn.Module:
    """Load a model saved by save_pruned (or `moekit prune`) with the same experts disabled."""
    from ..checkpoint.format import load_model

    if not (Path(folder) / PRUNED_FILE).is_file():
        raise ConfigError(f"{folder} has no {PRUNED_FILE}: not a pruned model")
    return load_model(folder)  # re-applies the pruning
