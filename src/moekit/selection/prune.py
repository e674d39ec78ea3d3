"""Disable experts: the router never picks them and the top-k is taken over the rest (RISE Table 5).

Each layer's own scoring rule is re-applied to its logits with the disabled experts' logits at -inf
(RouterSite.reroute), so the weights are renormalized over the remaining experts exactly as the
family does it:
  moekit Router                      its own rule (moekit.moe.router.route)
  Mixtral                            softmax -> top-k -> renormalize
  Qwen2-MoE, Qwen3-MoE, OLMoE        softmax -> top-k (-> renormalize if norm_topk_prob)
  PhiMoE                             its own sparsemixer on the masked logits
  DeepSeek-V3                        e_score_correction_bias = -inf for disabled experts (a persistent
                                     buffer: the pruning is in the saved weights too)
A routing hook is not saved with the weights, so `save_pruned` writes pruned_experts.json beside
them (its state codec, moekit.checkpoint.codecs) and moekit's loaders disable the same experts again when they
find it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import ConfigError, UnsupportedModelError
from ..moe.router import Router, route
from ..routing.sites import RerouteFn, RouterSite
from ..checkpoint.codecs import StateCodec
from .common import PRUNED_FILE, check_source, resolve, save_model, write_pruned
from .selection import Selection
from moekit.moe.state import model_state


def _softmax_rule(top_k: int, renormalize: bool, mask: Tensor) -> RerouteFn:
    """Mixtral / Qwen-MoE / OLMoE routers with disabled experts' logits at -inf."""
    def fn(logits: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float)  # (T, E)
        w, i = torch.topk(probs, top_k, dim=-1)  # (T, k)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)  # (T, k)
        return i, w.to(weights.dtype)
    return fn


def _moekit_rule(router: Router, mask: Tensor) -> RerouteFn:
    def fn(logits: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        w, i = route(logits.masked_fill(mask, float("-inf")), router.top_k, router.scoring)  # (T, k)
        return i, w.to(weights.dtype)
    return fn


def _phimoe_rule(router: nn.Module, mask: Tensor) -> RerouteFn:
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    def fn(logits: Tensor, ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        masked = logits.masked_fill(mask, float("-inf"))  # (T, E)
        w, i = sparsemixer(masked, jitter_eps=router.router_jitter_noise, training=router.training,
                           top_k=router.top_k)  # (T, 2), (T, 2)
        return i, w
    return fn


def _hf_rules() -> dict[type, Callable[[nn.Module, Tensor], RerouteFn]]:
    """Router class -> rule, checked against each family's modeling_*.py (transformers v5)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    norm = lambda r, mask: _softmax_rule(r.top_k, bool(r.norm_topk_prob), mask)  # noqa: E731
    return {MixtralTopKRouter: lambda r, mask: _softmax_rule(r.top_k, True, mask),
            Qwen2MoeTopKRouter: norm, Qwen3MoeTopKRouter: norm, OlmoeTopKRouter: norm,
            PhimoeTopKRouter: _phimoe_rule}


def _is_deepseek_v3(router: nn.Module) -> bool:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return type(router) is DeepseekV3TopkRouter


def _deepseek_check(site: RouterSite, mask: Tensor) -> None:
    """Group-limited routing: a group scores the sum of its top-2 choices (-inf with < 2 experts left)
    and only topk_group groups are searched, so even the worst admissible choice of groups must
    leave top_k experts."""
    r = site.router
    left = (~mask).view(r.num_group, -1).sum(-1).tolist()  # (G,) experts left per group
    finite = sorted(c for c in left if c >= 2)
    rest = sorted(c for c in left if c < 2)
    chosen = finite[:r.topk_group] if len(finite) >= r.topk_group else finite + rest[:r.topk_group - len(finite)]
    if sum(chosen) < r.top_k:
        raise ConfigError(f"{site.name}: with these experts disabled, {r.topk_group} of {r.num_group} groups "
                          f"can hold only {sum(chosen)} experts, fewer than top_k={r.top_k}")


class PruneHandle:
    """remove() re-enables the experts (restores DeepSeek-V3 biases, removes routing hooks)."""

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


def _plan(site: RouterSite, ids: list[int], rules) -> tuple[Tensor, Callable | None]:
    """The layer's disabled mask (E,) and rule factory (None for DeepSeek-V3's bias); raises if it cannot be pruned."""
    mask = torch.zeros(site.num_experts, dtype=torch.bool, device=site.router.weight.device)  # (E,)
    mask[ids] = True
    if int((~mask).sum()) < site.top_k:
        raise ConfigError(f"{site.name}: disabling {len(ids)} of {site.num_experts} experts leaves fewer "
                          f"than top_k={site.top_k}")
    if site.is_moekit:
        return mask, _moekit_rule
    if _is_deepseek_v3(site.router):
        _deepseek_check(site, mask)
        return mask, None
    if type(site.router) not in rules:
        raise UnsupportedModelError(f"{site.name}: no pruning rule for router class {type(site.router).__name__} "
                                    f"(supported: moekit Router, DeepseekV3TopkRouter, "
                                    f"{', '.join(c.__name__ for c in rules)})")
    return mask, rules[type(site.router)]


def prune(model: nn.Module, selection: Selection | dict[str, list[int]]) -> PruneHandle:
    """Disable the selected experts of `model` (in place). Every layer is checked before any changes.
    Layers named with an empty list get the rule too (then it decides as the model does).
    The disabled experts are recorded in moekit.moe.state.model_state(model).pruned (saved by moekit.selection.common.save_model)."""
    layers = resolve(model, selection)
    again = [s.name for s, _ in layers if s.name in model_state(model).pruned]
    if again:
        raise ConfigError(f"already pruned: {again[:5]}; remove() the earlier PruneHandle and prune once with all ids")
    rules = _hf_rules()
    plans = [(site, ids, *_plan(site, ids, rules)) for site, ids in layers]
    handles, biases = [], []
    for site, ids, mask, rule in plans:
        if rule is not None:
            handles.append(site.reroute(rule(site.router, mask)))
            continue
        bias = site.router.e_score_correction_bias  # (E,)
        biases.append((bias, bias.detach().clone()))
        with torch.no_grad():
            bias.masked_fill_(mask, float("-inf"))  # scores + bias: never chosen; weights use the plain scores
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
                 trust_remote_code: bool = False, log=None) -> dict[int, list[int]]:
    """{decoder layer index: expert ids to keep} of a native checkpoint for `selection`: its experts (mode "keep")
    or every other expert of each MoE layer it names (mode "drop"); for moekit.checkpoint.remove. A selection made
    for another model is refused unless `allow_other_model` (moekit.selection.common.check_source, with `log`)."""
    import json

    from moekit.checkpoint.dense import meta_model
    from moekit.checkpoint.files import read_text
    from moekit.checkpoint.remove import MOE_BLOCK, expert_count, native_config

    if (Path(model_dir) / "moekit.json").is_file():
        raise ConfigError(f"{model_dir} is a moekit checkpoint: removing experts needs a native transformers "
                          "checkpoint (`moekit export` writes one), or disable them (moekit prune without keep or "
                          "drop)")
    experts = expert_count(native_config(json.loads(read_text(model_dir, "config.json", "config"))))[1]
    check_source(selection, meta_model(model_dir, trust_remote_code), allow_other_model, log)
    out, named = {}, {}
    for name, ids in selection.experts.items():
        m = re.fullmatch(MOE_BLOCK, name)
        if m is None:
            raise ConfigError(f"the selection's layer {name!r} is not a decoder layer's MoE block "
                              "(model.layers.N.mlp, .block_sparse_moe or .feed_forward)")
        layer = int(m.group(2))
        if layer in named:
            raise ConfigError(f"the selection names decoder layer {layer} twice ({named[layer]!r} and {name!r})")
        bad = [e for e in ids if not 0 <= e < experts]
        if bad:
            raise ConfigError(f"the selection's layer {name!r} names expert {bad[0]}, outside [0, {experts}) of "
                              f"{model_dir}")
        named[layer] = name
        out[layer] = sorted(ids) if mode == "keep" else [e for e in range(experts) if e not in ids]
    return out


# ModelState.pruned rides along moekit's and transformers' formats (entry point in pyproject.toml)
CODEC = StateCodec(field="pruned", file=PRUNED_FILE, write=write_pruned, read=reapply)


def load_pruned(folder: str | Path) -> nn.Module:
    """Load a model saved by save_pruned (or `moekit prune`) with the same experts disabled."""
    from ..checkpoint.format import load_model

    if not (Path(folder) / PRUNED_FILE).is_file():
        raise ConfigError(f"{folder} has no {PRUNED_FILE}: not a pruned model")
    return load_model(folder)  # re-applies the pruning
