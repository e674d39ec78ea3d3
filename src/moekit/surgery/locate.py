"""Find every FFN slot of a model: (stack of blocks, block index, adapter)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from moekit.errors import UnsupportedModelError
from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer
from moekit.surgery.adapters import ADAPTERS, ADAPTERS_BY_NAME, Adapter, supported_families

_ACT_KEYS = ("hidden_activation", "hidden_act", "activation_function", "activation")  # "activation": Falcon


@dataclass
class Slot:
    stack: str  # module path of the nn.ModuleList of blocks, e.g. "model.layers"
    index: int  # block index within the stack
    block: nn.Module
    adapter: Adapter
    act: str  # ACT2FN key of the FFN activation
    rel: str  # FFN path inside the block (where the MoE layer will live), e.g. "mlp"

    @property
    def path(self) -> str:
        return f"{self.stack}.{self.index}.{self.rel}"

    def read(self) -> FFNWeights:
        return self.adapter.read(self.block, self.act)

    def checked_read(self) -> FFNWeights:
        """read(), refused where the weights read do not compute what the block's FFN computes (read_checked)."""
        return read_checked(self.adapter, self.block, self.act, self.path)

    def install(self, moe: MoELayer) -> None:
        self.adapter.install(self.block, moe)

    def describe(self) -> dict:
        return {"stack": self.stack, "index": self.index, "adapter": self.adapter.name}


PROBE_TOKENS = 4
PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-4}  # relative norm; 3e-2 for 16-bit weights


def read_checked(adapter: Adapter, block: nn.Module, act: str, where: str) -> FFNWeights:
    """The FFN weights `adapter` reads from `block`, after checking that they compute what the block's own FFN
    modules compute, on PROBE_TOKENS fixed random tokens in the weights' dtype (eval mode; a forward of those
    modules, no gradient). Adapters match modules by attribute names, and a family can keep the names and compute
    something else: a norm inside the MLP (BitNet's ffn_sub_norm, RoBERTa-PreLayerNorm's LayerNorm before its
    intermediate), scales on the gate or down projection (Falcon-H1's mlp_multipliers), an activation with learned
    parameters or activation sparsity, a gated layout read as a plain one (Moshi's fc1/fc2). Each would be
    upcycled silently wrong; this makes it one UnsupportedModelError naming the layer. Weights on the meta device
    (a plan) are not checked; a non-finite reference is left to the init methods' finite checks."""
    ffn = adapter.read(block, act)
    if ffn.up.is_meta:
        return ffn
    x = torch.randn(PROBE_TOKENS, ffn.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device=ffn.up.device, dtype=ffn.up.dtype)
    modes = {m: m.training for m in block.modules()}
    block.eval()
    try:
        with torch.no_grad():
            want, got = ffn(x), adapter.forward(block, x)
        if not torch.isfinite(want).all():
            return ffn
        err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        why = None if err <= PROBE_TOL.get(ffn.up.dtype, 3e-2) else f"{err:.2g} relative difference on a probe"
    except Exception as e:  # noqa: BLE001 - any failure to compute the read FFN is the same refusal
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for m, mode in modes.items():
            m.training = mode
    if why is not None:
        raise UnsupportedModelError(
            f"{where}: {type(block).__name__}'s FFN does not compute what moekit reads from it as a {adapter.name} "
            f"({act} activation; {why}): something inside it (a norm, a scale, its activation) has no place in an "
            "MoE expert, so moekit cannot upcycle it faithfully")
    return ffn


def _config_of(block: nn.Module, model: nn.Module) -> PretrainedConfig | None:
    for m in block.modules():  # e.g. attention modules keep their (sub-)config
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            return cfg
    return getattr(model, "config", None)


def activation_of(block: nn.Module, model: nn.Module) -> str:
    cfg = _config_of(block, model)
    for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()):
        for key in _ACT_KEYS:
            act = getattr(c, key, None)
            if isinstance(act, str):
                return act
    raise UnsupportedModelError(f"cannot tell the FFN activation of {type(block).__name__}: its config has none of "
                                f"{', '.join(_ACT_KEYS)}")


def _adapter_for(block: nn.Module) -> Adapter | None:
    return next((a for a in ADAPTERS if a.locate(block) is not None), None)


def find_slots(model: nn.Module) -> list[Slot]:
    """All dense FFN slots, stack by stack in module order. Raises if none is found."""
    slots = []
    for stack, ml in model.named_modules():
        if not isinstance(ml, nn.ModuleList) or len(ml) == 0:
            continue
        for i, block in enumerate(ml):
            adapter = _adapter_for(block)
            if adapter is not None:
                slots.append(Slot(stack, i, block, adapter, activation_of(block, model), adapter.locate(block)))
    if not slots and not any(isinstance(m, MoELayer) for m in model.modules()):
        raise UnsupportedModelError(
            f"no supported FFN found in {type(model).__name__}. Supported families: {supported_families()}")
    return slots


def slot_at(model: nn.Module, stack: str, index: int, adapter: str) -> Slot:
    """The slot recorded in a saved moekit model (block located by path, adapter by name)."""
    blocks = model.get_submodule(stack)
    if not isinstance(blocks, nn.ModuleList) or not 0 <= index < len(blocks):
        raise UnsupportedModelError(f"{stack} is not a list of blocks with a block {index}")
    block = blocks[index]
    ad = ADAPTERS_BY_NAME[adapter]
    rel = ad.locate(block)
    if rel is None:
        raise UnsupportedModelError(f"{stack}.{index} has no {adapter} FFN to replace")
    return Slot(stack, index, block, ad, activation_of(block, model), rel)
