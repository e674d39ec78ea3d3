"""Find every FFN slot of a model: (stack of blocks, block index, adapter)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig
from transformers.activations import ACT2CLS, ACT2FN

from moekit.errors import UnsupportedModelError
from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer
from moekit.surgery.adapters import ADAPTERS, ADAPTERS_BY_NAME, Adapter, probe, supported_families

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
        return self.adapter.read(self.block, self.rel, self.act)

    def checked_read(self, block: nn.Module | None = None, where: str = "") -> FFNWeights:
        """read(), refused where the weights read do not compute what the block's FFN computes (read_checked);
        `block`: a copy of the slot's block holding the weights to read instead."""
        return read_checked(self, self.block if block is None else block, where or self.path)

    def install(self, moe: nn.Module, block: nn.Module | None = None) -> None:
        self.adapter.install(self.block if block is None else block, self.rel, moe)

    def dropout(self) -> float:
        return self.adapter.dropout(self.block, self.rel)

    def describe(self) -> dict:
        return {"stack": self.stack, "index": self.index, "adapter": self.adapter.name}


PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-4}  # relative norm; 3e-2 for 16-bit weights


def read_checked(slot: Slot, block: nn.Module, where: str) -> FFNWeights:
    """The FFN weights the slot's adapter reads from `block` (the slot's, or a copy of it), after checking that they
    compute what the block's own FFN modules compute, on a probe of fixed random tokens (adapters.probe) in the
    weights' dtype (eval mode; a forward of those modules, no gradient). Adapters match modules by attribute names,
    and a family can keep the names and compute something else: a norm inside the MLP (BitNet's ffn_sub_norm,
    RoBERTa-PreLayerNorm's LayerNorm before its intermediate), a scale adapters.GatedMLP does not fold, an activation
    with learned parameters or activation sparsity (Gemma 3n). Each would be upcycled silently wrong; this makes it one
    UnsupportedModelError naming the layer. Weights on the meta device (a plan) are not checked; a non-finite reference
    is left to the init methods' finite checks."""
    adapter, act = slot.adapter, slot.act
    ffn = adapter.read(block, slot.rel, act)
    if ffn.up.is_meta:
        return ffn
    x = probe(ffn.hidden_size, ffn.up)
    modes = {m: m.training for m in block.modules()}
    block.eval()
    try:
        with torch.no_grad():
            want, got = ffn(x), adapter.forward(block, slot.rel, x[None])[0]  # (1, T, H): Moshi's view needs 3-D
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
            "MoE expert, so moekit cannot upcycle it faithfully (the spec's layers or target can leave it out)")
    return ffn


def _config_of(block: nn.Module, model: nn.Module) -> PretrainedConfig | None:
    for m in block.modules():  # e.g. attention modules keep their (sub-)config
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            return cfg
    return getattr(model, "config", None)


def _config_activation(block: nn.Module, model: nn.Module) -> str | None:
    cfg = _config_of(block, model)
    for c in (cfg, getattr(cfg, "get_text_config", lambda: None)()):
        for key in _ACT_KEYS:
            act = getattr(c, key, None)
            if isinstance(act, str):
                return act
    return None


_ACT_PROBE = torch.linspace(-12, 12, 97)  # past gelu_10's clip
_NOT_NAMED = ("linear", "prelu", "xielu")  # identity (any placeholder matches it) and activations with parameters


def _named(fn, first: str | None) -> str | None:
    """The ACT2FN key whose activation computes what `fn` computes on a probe (`first` tried first, then the keys of
    `fn`'s own class), or None."""
    try:
        with torch.no_grad():
            got = fn(_ACT_PROBE.clone())
    except Exception:  # noqa: BLE001 - not an activation of one tensor
        return None
    if not isinstance(got, torch.Tensor) or got.shape != _ACT_PROBE.shape or got.device != _ACT_PROBE.device:
        return None
    # its own class first (gelu_new, not gelu_fast), read off ACT2CLS: instantiating every activation would build
    # xIELU, whose constructor prints a warning about its CUDA kernel
    same = [k for k, c in ACT2CLS.items() if (c[0] if isinstance(c, tuple) else c) is type(fn)]
    keys = [k for k in ([first] if first in ACT2CLS else []) + same + list(ACT2CLS) if k not in _NOT_NAMED]
    with torch.no_grad():
        return next((k for k in keys if torch.allclose(ACT2FN[k](_ACT_PROBE.clone()), got, rtol=1e-6, atol=1e-6)),
                    None)


class _Calls(TorchFunctionMode):
    """Records the functions a forward calls on one tensor and nothing else (activation candidates): each as a
    function of that tensor, its other arguments kept."""

    def __init__(self):
        super().__init__()
        self.unary = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rest = (*args[1:], *kwargs.values())
        if args and isinstance(args[0], Tensor) and not any(isinstance(a, Tensor) for a in rest) \
                and isinstance(out, Tensor) and out.shape == args[0].shape:
            self.unary.append(lambda t, f=func, a=args[1:], k=kwargs: f(t, *a, **k))
        return out


def _called(block: nn.Module, adapter: Adapter, rel: str) -> list:
    """What the FFN's forward calls on one tensor at a time, on a probe (on the meta device too: only the calls
    matter): LFM2's `F.silu(self.w1(x))`, an activation held by no attribute."""
    first = next(block.get_submodule(rel).parameters(), None)
    if first is None:
        return []
    x, mode = probe(first.shape[-1], first)[None], _Calls()
    try:
        with torch.no_grad(), mode:
            adapter.forward(block, rel, x)
    except Exception:  # noqa: BLE001 - a forward that does not run names nothing; the caller refuses
        return []
    return mode.unary


def activation_of(block: nn.Module, model: nn.Module, adapter: Adapter, rel: str) -> str:
    """The ACT2FN key of the FFN's activation: the config's (hidden_act, ...) where the FFN holds that activation or
    none that moekit can name; else the key of the one it holds, named by what it computes (Moonshine's encoder MLP
    runs its config's encoder_hidden_act, OpenAI GPT's its `afn`, MPT's an nn.GELU). Where the config names none and
    the FFN holds none, the one activation its forward calls (LFM2's F.silu in code). read_checked checks the choice
    against the FFN's own forward."""
    config = _config_activation(block, model)
    held = {k for fn in adapter.activation(block, rel) if (k := _named(fn, config)) is not None}
    if len(held) == 1 and config not in held:
        return held.pop()
    if config is None and not held:
        held = {k for fn in _called(block, adapter, rel) if (k := _named(fn, None)) is not None}
    if config is None and len(held) == 1:
        return held.pop()
    if config is None:
        raise UnsupportedModelError(f"cannot tell the FFN activation of {type(block).__name__}: its config has none "
                                    f"of {', '.join(_ACT_KEYS)} and its FFN holds or calls no one activation moekit "
                                    "can name")
    return config


def _adapter_for(block: nn.Module) -> Adapter | None:
    return next((a for a in ADAPTERS if a.locate(block)), None)


def find_slots(model: nn.Module) -> list[Slot]:
    """All dense FFN slots, stack by stack in module order. Raises if none is found."""
    slots = []
    for stack, ml in model.named_modules():
        if not isinstance(ml, nn.ModuleList) or len(ml) == 0:
            continue
        for i, block in enumerate(ml):
            adapter = _adapter_for(block)
            for rel in [] if adapter is None else adapter.locate(block):
                slots.append(Slot(stack, i, block, adapter, activation_of(block, model, adapter, rel), rel))
    if not slots and not any(isinstance(m, MoELayer) for m in model.modules()):
        raise UnsupportedModelError(
            f"no supported FFN found in {type(model).__name__}. Supported families: {supported_families()}")
    return slots


def slot_at(model: nn.Module, stack: str, index: int, adapter: str, path: str | None = None) -> Slot:
    """The slot recorded in a saved moekit model (block located by path, adapter by name); `path`: the FFN's
    (`<stack>.<index>.<rel>`), for a block with more than one FFN (else its first)."""
    blocks = model.get_submodule(stack)
    if not isinstance(blocks, nn.ModuleList) or not 0 <= index < len(blocks):
        raise UnsupportedModelError(f"{stack} is not a list of blocks with a block {index}")
    block = blocks[index]
    ad = ADAPTERS_BY_NAME[adapter]
    found = ad.locate(block)
    rel = found[0] if found and path is None else (path or "").removeprefix(f"{stack}.{index}.")
    if rel not in found:
        raise UnsupportedModelError(f"{stack}.{index} has no {adapter} FFN {rel!r} to replace")
    return Slot(stack, index, block, ad, activation_of(block, model, ad, rel), rel)
