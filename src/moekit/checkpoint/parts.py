"""One MoE layer's weights, piece by piece, and how each checkpoint format names the pieces.

A `LayerParts` gives routed experts 0..E-1 in order (`expert`), then the shared expert, the router and the shared
expert's gate:
from an init method (upcycling), from a checkpoint's shards (export), from an in-memory MoELayer, or as
shapes only on the meta device (planning). A format turns parts into items `(name, tensor, index)`, index
being the slice of a stacked (E, ...) tensor or None for a whole tensor, so a writer holds one expert at a
time. moekit's own format is here; the native ones are moekit.checkpoint.export's NativeFormat.layer_items.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer

# (name relative to the MoE layer, tensor or tensors concatenated along dim 0, index along dim 0 of the stacked
# tensor or None for a whole tensor). A name holding "{}" is one tensor per expert (the classic per-expert layout of
# the Hub's MoE checkpoints): the index is the expert's, written as the whole tensor `name.format(index)`.
Item = tuple[str, Tensor | list[Tensor], int | None]


def per_expert(name: str) -> bool:
    """Whether an item's name stands for one tensor per expert ("experts.{}.w1.weight")."""
    return "{}" in name


class LayerParts:
    """The parts of an in-memory MoELayer (subclasses compute them instead)."""

    def __init__(self, moe: MoELayer):
        self.moe, self._stacked = moe, moe.experts.to_weights()
        self.num_experts, self.hidden_size = moe.experts.num_experts, moe.experts.hidden_size

    def expert(self, i: int) -> FFNWeights:
        return self._stacked.expert(i)

    def shared(self) -> FFNWeights | None:
        return None if self.moe.shared is None else self.moe.shared.to_weights()

    def router(self) -> Tensor:
        return self.moe.router.weight.detach()

    def shared_gate(self) -> Tensor | None:
        """The shared expert's gate row (1, H), or None (an ungated shared expert, or none)."""
        return None if self.moe.shared_gate is None else self.moe.shared_gate.weight.detach()


def item_shape(t: Tensor | list[Tensor]) -> tuple[int, ...]:
    """The shape of an item's tensor (of the concatenation along dim 0 for a list)."""
    if not isinstance(t, list):
        return tuple(t.shape)
    return (sum(x.shape[0] for x in t), *t[0].shape[1:])


def gated_first(e: FFNWeights) -> list[Tensor]:
    """The stored input projection of one expert: [gate; up] (2I, H), as moekit and transformers v5 keep it,
    or up (I, H), as parts to concatenate (writers write them one after the other, without a copy)."""
    return [e.gate, e.up] if e.gated else [e.up]


def routed_items(parts: LayerParts, first: str, down: str, router: str | None) -> Iterator[Item]:
    """Routed experts slice by slice, then the router (if `router` names it)."""
    for i in range(parts.num_experts):
        e = parts.expert(i)
        yield first, gated_first(e), i
        yield down, e.down, i
    if router is not None:
        yield router, parts.router(), None


def classic_items(parts: LayerParts, gate: str, up: str, down: str, router: str) -> Iterator[Item]:
    """Routed experts one tensor per projection and expert ("experts.{}.<gate>.weight", ...), then the router: the
    layout of the Hub's MoE checkpoints (Mixtral's w1/w3/w2, Qwen-MoE's gate_proj/up_proj/down_proj)."""
    for i in range(parts.num_experts):
        e = parts.expert(i)
        yield f"experts.{{}}.{gate}.weight", e.gate, i
        yield f"experts.{{}}.{up}.weight", e.up, i
        yield f"experts.{{}}.{down}.weight", e.down, i
    yield router, parts.router(), None


def _or_zeros(b: Tensor | None, n: int, like: Tensor) -> Tensor:
    return like.new_zeros(n) if b is None else b


def moekit_items(parts: LayerParts, own_router: bool, bias: bool) -> Iterator[Item]:
    """moekit's names (MoELayer.state_dict): experts.gate_up | experts.up (E, 2I | I, H), experts.down (E, H, I),
    experts.first_bias / down_bias (missing biases as zeros, as Experts.from_weights stores them),
    shared.{gate,up,down}_proj.{weight,bias}, router.weight (only for the layer that owns a shared router),
    shared_gate.weight."""
    for i in range(parts.num_experts):
        e = parts.expert(i)
        yield ("experts.gate_up" if e.gated else "experts.up"), gated_first(e), i
        yield "experts.down", e.down, i
        if bias:
            I, H = e.intermediate_size, e.hidden_size
            up_b = _or_zeros(e.up_bias, I, e.up)
            yield "experts.first_bias", [_or_zeros(e.gate_bias, I, e.up), up_b] if e.gated else up_b, i
            yield "experts.down_bias", _or_zeros(e.down_bias, H, e.up), i
    sh = parts.shared()
    if sh is not None:
        for proj, w, b in (("gate_proj", sh.gate, sh.gate_bias), ("up_proj", sh.up, sh.up_bias),
                           ("down_proj", sh.down, sh.down_bias)):
            if w is not None:
                yield f"shared.{proj}.weight", w, None
            if b is not None:
                yield f"shared.{proj}.bias", b, None
    if own_router:
        yield "router.weight", parts.router(), None
    gate = parts.shared_gate()
    if gate is not None:
        yield "shared_gate.weight", gate, None


def assemble(items: Iterator[Item]) -> dict[str, Tensor]:
    """{name: tensor} from items, stacking indexed slices in order (in-memory exports)."""
    whole, slices = {}, {}
    for name, t, i in items:
        t = torch.cat(t) if isinstance(t, list) else t
        if per_expert(name):
            whole[name.format(i)] = t
        elif i is None:
            whole[name] = t
        else:
            slices.setdefault(name, []).append(t)
    return {**whole, **{n: torch.stack(ts) for n, ts in slices.items()}}
