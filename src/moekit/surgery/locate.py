"""Find every FFN slot of a model: (stack of blocks, block index, adapter)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from moekit.errors import UnsupportedModelError
from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer
from moekit.surgery.adapters import ADAPTERS, ADAPTERS_BY_NAME, Adapter, supported_families

_ACT_KEYS = ("hidden_activation", "hidden_act", "activation_function")


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

    def install(self, moe: MoELayer) -> None:
        self.adapter.install(self.block, moe)

    def describe(self) -> dict:
        return {"stack": self.stack, "index": self.index, "adapter": self.adapter.name}


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
