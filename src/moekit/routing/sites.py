"""Where a model routes: one RouterSite per MoE layer, for moekit models and transformers v5 MoE families.

transformers v5 MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3, ...) hold a
router child (an int `top_k` and either a weight with one row per expert or a `num_experts` equal to the
experts') whose forward returns `(logits, weights, indices, ...)` (some families add a fourth output: Inkling's
shared-expert gammas, Zaya's router state) and a fused `experts` child with 3-D parameters (expert dimension
first). Llama 4's router returns `(scores, logits)` instead, with scores (T, E) zero outside each token's top-k;
its decision is the top-k of the scores, and its experts take the score-scaled input of every expert rather than
(x, ids, weights). DBRX's router returns its logits alone and its block turns them into (weights, ids) with its
own `route_tokens_to_experts`; its experts hold every expert's rows in 2-D (E·I, H) parameters of a child module.
JetMoE's FFN block holds its experts as two children (`input_linear` (E, 2I, H), `output_linear` (E, H, I)) beside a
router whose output is the decision already sorted by expert (sorted slot order, token of each, weights, per-expert
counts, logits); moekit reads (ids, weights) back from it and sees the two children as one experts module
(`SplitExperts`). Its mixture-of-attention blocks (query projections routed per token) are not read. Sites are found by
that structure, not by class name, and the decision is read from the router's output (DBRX: the block's own function of
it), never recomputed by moekit.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..errors import ConfigError, UnsupportedModelError
from ..moe.layer import MoELayer, moe_layers
from ..moe.router import RoutingInfo
from moekit.moe.state import model_state

# fn(ids (T, k), weights (T, k)) after each decision
DecisionFn = Callable[[Tensor, Tensor], None]
# fn(logits (T, E), ids (T, k), weights (T, k)) -> (ids, weights): replaces the decision
RerouteFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


class _Reset:
    """Handle for a reroute that is not a hook: remove() puts the layer's own decision back."""

    def __init__(self, remove: Callable[[], None]):
        self.remove = remove


@dataclass
class RouterSite:
    name: str  # module path of the MoE block
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int

    @property
    def params_per_expert(self) -> int:
        """Parameters of one routed expert (every parameter of the fused experts has the expert dimension; LongCat's
        down_proj has its routed experts' alone: `zero_experts`)."""
        if zero_experts(self):
            return sum(p.numel() // p.shape[0] for p in self.experts.parameters())
        return sum(p.numel() for p in self.experts.parameters()) // self.num_experts

    @property
    def is_moekit(self) -> bool:
        return isinstance(self.block, MoELayer)

    def decision(self, out) -> tuple[Tensor, Tensor, Tensor]:
        """(logits (T, E), ids (T, k), weights (T, k)) from a transformers router's output."""
        if isinstance(out, tuple) and len(out) == 5 and isinstance(out[3], list):  # JetMoE: sorted by expert
            return out[4], *_unsorted(out, self.top_k)
        if isinstance(out, tuple) and len(out) >= 3 and not out[2].is_floating_point():  # (logits, weights, ids, ...)
            return out[0], out[2], out[1]
        if isinstance(out, Tensor) and _routes_logits(self.block):  # DBRX: the block's own function of its logits
            _, ids, weights = _routed_by_block(self.block, out)
            return out, ids, weights
        if isinstance(out, tuple) and len(out) == 2:  # Llama 4: (scores (T, E), logits (T, E))
            weights, ids = out[0].topk(self.top_k, dim=-1)  # (T, k)
            return out[1], ids, weights
        raise UnsupportedModelError(f"the router of {self.name} ({type(self.router).__name__}) returns "
                                    f"{type(out).__name__}; moekit reads (logits, weights, indices, ...) or (scores, logits)")

    def logits_of(self, out) -> Tensor:
        """(T, E) logits from this layer's router output (moekit's RoutingInfo, or a transformers router's tuple)."""
        return out.logits if self.is_moekit else self.decision(out)[0]

    def on_decision(self, fn: DecisionFn) -> RemovableHandle:
        """Call fn with this layer's decision after every forward (a shared router still reports per layer)."""
        if self.is_moekit:
            return self.block.register_forward_hook(
                lambda m, args, out: fn(m.last_routing.topk_ids, m.last_routing.topk_weights))

        def hook(m, args, out):
            _, ids, weights = self.decision(out)
            fn(ids, weights)

        return self.router.register_forward_hook(hook)

    def reroute(self, fn: RerouteFn) -> RemovableHandle | _Reset:
        """Replace this layer's decision by fn(logits, ids, weights) until the handle is removed."""
        block = self.block
        if self.is_moekit:
            def apply(info: RoutingInfo) -> RoutingInfo:
                ids, weights = fn(info.logits, info.topk_ids, info.topk_weights)
                return RoutingInfo(info.logits, ids, weights)

            block.reroute = apply
            return _Reset(lambda: setattr(block, "reroute", None))
        if _routes_logits(block):  # DBRX: its route_tokens_to_experts, replaced on the instance
            def route(logits: Tensor) -> tuple[Tensor, ...]:
                routed, ids, weights = _routed_by_block(block, logits)
                new_ids, new_weights = fn(logits, ids, weights)
                return tuple(new_ids.to(t.dtype) if t is ids else new_weights.to(t.dtype) for t in routed)

            block.route_tokens_to_experts = route
            return _Reset(lambda: block.__dict__.pop("route_tokens_to_experts", None))

        def hook(m, args, out):
            logits, ids, weights = self.decision(out)
            new_ids, new_weights = fn(logits, ids, weights)
            if len(out) == 5:  # JetMoE
                return _sorted(new_ids, new_weights.to(out[2].dtype), logits)
            if len(out) == 2:  # Llama 4: scores (T, E), zero outside the top-k
                scores = torch.zeros_like(out[0]).scatter(-1, new_ids, new_weights.to(out[0].dtype))
                return scores, out[1]
            return (out[0], new_weights.to(out[1].dtype), new_ids.to(out[2].dtype), *out[3:])

        return self.router.register_forward_hook(hook)

    @property
    def experts_take_routing(self) -> bool:
        """Whether the experts module is called as experts(x, ids, weights) (moekit, transformers v5 blocks), not
        on the score-scaled input of every expert (Llama 4)."""
        return self.is_moekit or len(inspect.signature(self.experts.forward).parameters) >= 3

    def expert_norms(self, x: Tensor, ids: Tensor) -> Tensor:
        """‖f_j(x_t)‖₂ (T, k) of each token's routed experts j = ids[t, s], unweighted, computed by the layer's own
        experts module: one call per slot, or for Llama 4's experts one call on every expert's copy of x."""
        if self.experts_take_routing:
            ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)  # (T, 1)
            return torch.stack([one_slot(self.experts, x, ids[:, s:s + 1], ones).float().norm(dim=-1)
                                for s in range(ids.shape[1])], dim=1)  # (T, k)
        out = self.experts(x.repeat(self.num_experts, 1))  # (E·T, H): expert e on rows e·T .. e·T + T - 1
        norms = out.float().view(self.num_experts, x.shape[0], -1).norm(dim=-1)  # (E, T)
        return norms.t().gather(1, ids)  # (T, k)


def _unsorted(out: tuple, k: int) -> tuple[Tensor, Tensor]:
    """JetMoE's decision (sorted slots s·k + j (S,), their tokens, weights (S,), per-expert counts, logits) back in
    token order: ids (T, k), weights (T, k)."""
    order, _, gates, counts, _ = out
    experts = torch.repeat_interleave(torch.arange(len(counts), device=order.device),
                                      torch.tensor(counts, device=order.device))  # (S,) the expert of each sorted slot
    ids = torch.empty_like(order).index_put_((order,), experts)  # (S,)
    weights = torch.empty_like(gates).index_put_((order,), gates)  # (S,)
    return ids.view(-1, k), weights.view(-1, k)


def _sorted(ids: Tensor, weights: Tensor, logits: Tensor) -> tuple:
    """ids (T, k), weights (T, k) sorted by expert as JetMoE's router returns them (`_unsorted`'s inverse)."""
    flat = ids.reshape(-1)  # (S,)
    order = flat.argsort(stable=True)  # (S,) slots by expert
    counts = torch.bincount(flat, minlength=logits.shape[-1]).tolist()
    return order, order.div(ids.shape[1], rounding_mode="trunc"), weights.reshape(-1)[order], counts, logits


class SplitExperts(nn.Module):
    """JetMoE's experts, held by its FFN block as two children, seen as one module (not in the model's tree: the
    parameters are the block's): forward(x) (E·T, H) -> (E·T, H) runs expert e on rows e·T .. e·T + T - 1,
    unweighted and without the block's output bias (what Llama 4's experts take, for `expert_norms`)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.input_linear, self.output_linear, self.act = block.input_linear, block.output_linear, block.activation
        self.num_experts = block.input_linear.num_experts

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0] // self.num_experts
        h = self.input_linear(x, [rows] * self.num_experts)  # (E·T, 2I)
        gate, up = h.chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up, [rows] * self.num_experts)  # (E·T, H)


def _split_site(name: str, block: nn.Module) -> RouterSite | None:
    """JetMoE's FFN block (module docstring): a router with `top_k` and an E-row `layer`, the experts' two children
    with (E, ...) weights, and an activation (its mixture-of-attention blocks have none)."""
    router, first, second = (getattr(block, n, None) for n in ("router", "input_linear", "output_linear"))
    num = getattr(first, "num_experts", None)
    if (isinstance(num, int) and getattr(second, "num_experts", None) == num
            and callable(getattr(block, "activation", None)) and isinstance(getattr(router, "top_k", None), int)
            and getattr(getattr(router, "layer", None), "out_features", None) == num):
        return RouterSite(name, block, router, SplitExperts(block), num, router.top_k)
    return None


def one_slot(experts: nn.Module, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """experts(x (T, H), ids (T, 1), weights (T, 1)) -> (T, H) of experts taking (x, ids, weights): each token
    through one expert. DBRX's experts return (T, 1, H); LongCat-Flash's drop the slot axis of a k = 1 call
    (transformers 5.23), so there each slot goes twice, weighted as given and 0 (adding an exact zero)."""
    if hasattr(experts, "zero_expert_num"):
        ids, weights = ids.expand(-1, 2), torch.cat([weights, torch.zeros_like(weights)], dim=1)  # (T, 2)
    return experts(x, ids, weights).reshape(x.shape)


def zero_experts(site: RouterSite) -> int:
    """How many of the layer's experts compute nothing (LongCat-Flash's zero-computation experts: identity experts
    numbered after the routed ones, which the trace records like the others); 0 for every other family."""
    return 0 if site.is_moekit else getattr(site.experts, "zero_expert_num", 0) or 0


def routed_ids(site: RouterSite, ids: list[int]) -> list[int]:
    """The experts of `ids` that hold weights: all but LongCat-Flash's zero-computation experts (ids E .. E+Z-1 after
    its E routed ones), which a selection made from routing may name."""
    return [i for i in ids if i < site.num_experts - zero_experts(site)]


def hash_routed(site: RouterSite) -> bool:
    """Whether the layer picks experts by token id (DeepSeek-V4's hash layers: a table of expert ids), not by logits."""
    return not site.is_moekit and "input_ids" in inspect.signature(site.router.forward).parameters


def expert_groups(site: RouterSite) -> int | None:
    """The number of expert groups of group-limited routing (DeepSeek's n_group: `num_group` or `n_group` on the
    router), None where the router has none or one."""
    groups = getattr(site.router, "num_group", None) or getattr(site.router, "n_group", None)
    return groups if isinstance(groups, int) and groups > 1 else None


def _top_k(router: nn.Module) -> int | None:
    """The router's k: its own `top_k`, or (Gemma 4) its config's."""
    for obj, keys in ((router, ("top_k",)), (getattr(router, "config", None), ("top_k_experts", "num_experts_per_tok"))):
        for key in keys:
            value = getattr(obj, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _routes_logits(block: nn.Module) -> bool:
    """Whether the block turns its router's logits into (weights, ids) itself (DBRX's route_tokens_to_experts)."""
    return callable(getattr(type(block), "route_tokens_to_experts", None))


def _routed_by_block(block: nn.Module, logits: Tensor) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
    """(what the block's own route_tokens_to_experts returns for `logits`: DBRX's (weights, ids), its ids (T, k), its
    weights (T, k)); the class's function, so a reroute replacing it on the instance still reads the original."""
    routed = type(block).route_tokens_to_experts(block, logits)
    ids = next(t for t in routed if not t.is_floating_point())
    return routed, ids, next(t for t in routed if t.is_floating_point())


def expert_rows(experts: nn.Module, num: int) -> bool:
    """Whether `experts` holds every expert's rows in 2-D (E·n, ...) parameters (DBRX's, in its `mlp` child) rather
    than transformers 5's 3-D (E, ...) ones."""
    params = list(stacked_tensors(experts).values())
    return bool(params) and all(p.dim() == 2 and p.shape[0] > num and p.shape[0] % num == 0 for p in params)


def stacked_tensors(experts: nn.Module) -> dict[str, Tensor]:
    """An experts module's parameters by name (its children's too), each one that selective fine-tuning parametrized
    (moekit.selection.finetune.ExpertRows: K trainable rows) by its whole frozen tensor: the shapes its forward sees."""
    out = {}
    for path, module in experts.named_modules():
        if "parametrizations" in path.split("."):
            continue
        prefix = f"{path}." if path else ""
        out.update({prefix + n: t for n, t in module.named_parameters(recurse=False)})
        for n, plist in getattr(module, "parametrizations", {}).items():
            out[prefix + n] = getattr(plist[0], "base", plist.original)
    return out


def expert_count(experts: nn.Module | None) -> int | None:
    """A transformers experts module's number of experts: its `num_experts`, or LongCat-Flash's `total_experts`
    (routed and zero-computation experts); None where it declares neither."""
    return getattr(experts, "num_experts", getattr(experts, "total_experts", None))


def _hf_site(name: str, block: nn.Module) -> RouterSite | None:
    split = _split_site(name, block)
    if split is not None:
        return split
    experts = getattr(block, "experts", None)
    num = expert_count(experts)
    if not isinstance(experts, nn.Module) or not isinstance(num, int):
        return None
    own = [t for n, t in stacked_tensors(experts).items() if "." not in n]  # parametrized ones whole
    if not any(p.dim() == 3 and p.shape[0] == num for p in own) and not (
            expert_rows(experts, num) and _routes_logits(block)
            and len(inspect.signature(experts.forward).parameters) >= 3):
        return None  # not fused experts (e.g. transformers 4.x ModuleList experts)
    for child in block.children():
        w = getattr(child, "weight", None)
        rows = isinstance(w, Tensor) and w.dim() == 2 and w.shape[0] == num
        named = "router" in type(child).__name__.lower() and any(  # a router whose row weight sits one level down
            p.dim() == 2 and p.shape[0] == num for p in child.parameters())
        k = _top_k(child) if child is not experts else None
        if k is None and child is not experts and _routes_logits(block):  # DBRX: the block's top_k
            k = _top_k(block)
        if k is not None and (rows or getattr(child, "num_experts", None) == num or named):
            return RouterSite(name, block, child, experts, num, k)
    return None


def moe_sites(model: nn.Module) -> list[RouterSite]:
    """Every MoE layer of `model` in module order: moekit's, else transformers v5 MoE blocks (none if dense)."""
    ours = moe_layers(model)
    if ours:
        return [RouterSite(n, m, m.router, m.experts, m.router.num_experts, m.router.top_k) for n, m in ours]
    return [s for n, m in model.named_modules() if (s := _hf_site(n, m)) is not None]


def find_sites(model: nn.Module, layers: str | None = None) -> list[RouterSite]:
    """Every MoE layer of `model` in module order; `layers` is an optional regex on the block path."""
    sites = moe_sites(model)
    if not sites:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no MoE layer moekit can read: expected moekit MoE layers or a "
            "transformers v5 MoE block (router child returning (logits, weights, indices) + fused 3-D experts), "
            "as in Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3, Llama 4")
    if layers is not None:
        try:
            pattern = re.compile(layers)
        except re.error as e:
            raise ConfigError(f"layers {layers!r} is not a valid regular expression: {e}") from None
        sites = [s for s in sites if pattern.search(s.name)]
        if not sites:
            raise UnsupportedModelError(f"no MoE layer path matches {layers!r}")
    return sites


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(total, active) parameters; active counts k of E routed experts per MoE layer (shared tensors once) of a
    moekit or a transformers MoE model, or for a SIMoE model what one input uses (its state's own count)."""
    simoe = model_state(model).simoe
    if simoe is not None:
        return simoe.param_counts(model)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields shared tensors once
    inactive = sum(sum(p.numel() for p in s.experts.parameters()) - s.top_k * s.params_per_expert
                   for s in moe_sites(model))
    return total, total - inactive
