"""What the native exporters share: the MoE layers of a decoder-only source and the one layout they
must share (a native config has one), the checks that keep the export exact, the config fields copied
from the source, and building the native model from a renamed state dict.

An exporter is a NativeFormat registered in EXPORTERS: `fmt(model)` gives the native model, and its
pieces (plan, config, per-layer tensor names) drive the streaming writers. It raises ExportError (one
reason) before anything is written.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from moekit.checkpoint.parts import Item, LayerParts, assemble, routed_items
from moekit.errors import ExportError
from moekit.moe.layer import MoELayer, moe_layers
from moekit.registry import Registry
from moekit.state import spec_of

EXPORTERS: Registry["NativeFormat"] = Registry("export format")

_DECODER_MLP = re.compile(r"model\.layers\.(\d+)\.mlp")
_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
           "tie_word_embeddings", "rope_parameters", "attention_dropout", "pad_token_id", "bos_token_id",
           "eos_token_id")


def refuse(fmt: str, reason: str) -> ExportError:
    return ExportError(f"cannot export to {fmt}: {reason}")


@dataclass
class MoEPlan:
    """The source's MoE layers and the layout they all share."""

    fmt: str
    layers: dict[int, MoELayer]  # decoder layer index -> its MoE MLP
    num_experts: int
    top_k: int
    scoring: str
    jitter: float
    intermediate_size: int  # routed expert I
    shared_size: int | None  # shared expert I; None when no layer has a shared expert

    def dense_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if i not in self.layers]

    def require_no_jitter(self) -> None:
        """For formats without router jitter (a training-time regularizer; dropping it silently would
        change training)."""
        if self.jitter > 0:
            raise refuse(self.fmt, f"router jitter ({self.jitter}) has no equivalent in this format; set "
                         "`router.jitter = 0` on every MoE layer (inference is unaffected) and export again")


def check_source(model: nn.Module, fmt: str, classes: tuple[type, ...]) -> None:
    if not isinstance(model, classes):
        names = " or ".join(c.__name__ for c in classes)
        raise refuse(fmt, f"the source model must be a {names}, got {type(model).__name__}")


def _decoder_moes(model: nn.Module, fmt: str) -> dict[int, MoELayer]:
    found = moe_layers(model)
    if not found:
        raise refuse(fmt, "the model has no MoE layers (upcycle it first)")
    out = {}
    for path, moe in found:
        m = _DECODER_MLP.fullmatch(path)
        if m is None:
            raise refuse(fmt, f"the MoE layer at {path} is not a decoder layer's MLP (model.layers.<i>.mlp); "
                         "native MoE formats only have MoE decoder MLPs")
        out[int(m.group(1))] = moe
    return out


def _check_layer(fmt: str, i: int, moe: MoELayer, act: str) -> None:
    ex, sh, where = moe.experts, moe.shared, f"layer {i}"
    if ex.first_bias is not None:
        raise refuse(fmt, f"the experts of {where} have biases; native MoE experts have none")
    if not ex.gated:
        raise refuse(fmt, f"the experts of {where} are not gated; native experts compute down(act(gate) * up)")
    if ex.act != act:
        raise refuse(fmt, f"the experts of {where} use activation {ex.act!r} but the source's hidden_act is "
                     f"{act!r}; the native config has one activation")
    if sh is not None and (sh.gate_proj is None or sh.act != act
                           or any(lin.bias is not None for lin in (sh.gate_proj, sh.up_proj, sh.down_proj))):
        raise refuse(fmt, f"the shared expert of {where} is not a bias-free gated MLP with activation {act!r}")
    if moe.dropout is not None:
        raise refuse(fmt, f"{where} applies dropout to the MoE output; native MoE blocks have none")


def _check_routers(fmt: str, model: nn.Module, moes: list[MoELayer]) -> None:
    spec = spec_of(model)
    ids = {id(m.router) for m in moes}
    if (spec is not None and spec.router_sharing != "none") or len(ids) < len(moes):
        raise refuse(fmt, "routers are shared between layers (router_sharing, Omni-router); native formats have "
                     "one router per layer, and untied copies would train differently from the shared router")


def _one(fmt: str, what: str, values: list):
    distinct = sorted(set(values), key=str)
    if len(distinct) > 1:
        raise refuse(fmt, f"{what} differs across MoE layers ({distinct}); the native config has one value")
    return distinct[0]


def plan(model: nn.Module, fmt: str) -> MoEPlan:
    """Collect the decoder MoE layers and check what every native format needs (see module docstring)."""
    layers = _decoder_moes(model, fmt)
    for i, moe in layers.items():
        _check_layer(fmt, i, moe, model.config.hidden_act)
    moes = list(layers.values())
    _check_routers(fmt, model, moes)
    shared = sorted({m.shared.up_proj.out_features for m in moes if m.shared is not None})
    if len(shared) > 1:
        raise refuse(fmt, f"shared experts have different sizes ({shared}); the native config has one")
    return MoEPlan(
        fmt, layers, num_experts=_one(fmt, "the number of experts", [m.experts.num_experts for m in moes]),
        top_k=_one(fmt, "top_k", [m.router.top_k for m in moes]),
        scoring=_one(fmt, "the router scoring", [m.router.scoring for m in moes]),
        jitter=_one(fmt, "the router jitter", [m.router.jitter for m in moes]),
        intermediate_size=_one(fmt, "the expert size", [m.experts.intermediate_size for m in moes]),
        shared_size=shared[0] if shared else None,
    )


def copied_config(model: nn.Module, *extra: str) -> dict:
    """Config fields shared by source and native format (those the source has), plus the weights' dtype."""
    src: PretrainedConfig = model.config
    out = {k: copy.deepcopy(getattr(src, k)) for k in _COPIED + extra if hasattr(src, k)}
    return {**out, "dtype": model.dtype}


def qwen_moe_fields(p: MoEPlan, num_layers: int) -> dict:
    """Qwen-MoE config fields: dense layers listed in mlp_only_layers (decoder_sparse_step = 1), and
    norm_topk_prob = renormalized top-k weights (moekit scoring "topk_softmax")."""
    return {"num_experts": p.num_experts, "num_experts_per_tok": p.top_k, "moe_intermediate_size": p.intermediate_size,
            "norm_topk_prob": p.scoring == "topk_softmax", "decoder_sparse_step": 1,
            "mlp_only_layers": p.dense_layers(num_layers)}


class NativeFormat:
    """A transformers MoE architecture moekit writes. Subclasses give the source classes, the checks, the
    native config and how one MoE layer's parts are named; the same pieces serve the in-memory export
    (`fmt(model)` -> the native model) and the streaming ones (moekit.checkpoint.stream), where `model` is
    built on the meta device."""

    name: ClassVar[str]
    native: ClassVar[type[PreTrainedModel]]
    sources: ClassVar[tuple[type, ...]]

    def plan(self, model: nn.Module) -> MoEPlan:
        """Every check (one ExportError with the reason) and the layout the native config needs."""
        check_source(model, self.name, self.sources)
        p = plan(model, self.name)
        self.check(model, p)
        return p

    def check(self, model: nn.Module, p: MoEPlan) -> None:
        """Format-specific refusals."""

    def config(self, model: nn.Module, p: MoEPlan) -> PretrainedConfig:
        raise NotImplementedError

    def layer_items(self, parts: LayerParts, p: MoEPlan) -> Iterator[Item]:
        """The native tensors of one MoE layer (names relative to its MLP). Default: routed experts only."""
        return routed_items(parts, "experts.gate_up_proj", "experts.down_proj", "gate.weight")

    def extra_tensors(self, model: nn.Module, p: MoEPlan) -> dict[str, Tensor]:
        """Native tensors the source lacks (e.g. zero q/k/v biases), by full name."""
        return {}

    def __call__(self, model: nn.Module) -> PreTrainedModel:
        """The native model holding `model`'s weights (in-memory export)."""
        p = self.plan(model)
        prefixes = tuple(f"model.layers.{i}.mlp." for i in p.layers)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
        for i, moe in p.layers.items():
            layer = assemble(self.layer_items(LayerParts(moe), p))
            state.update({f"model.layers.{i}.mlp.{k}": v for k, v in layer.items()})
        state.update(self.extra_tensors(model, p))
        return build_native(self.native, self.config(model, p), model, state, self.name)


def build_native(cls: type[PreTrainedModel], config: PretrainedConfig, model: nn.Module, state: dict,
                 fmt: str) -> PreTrainedModel:
    """`cls(config)` without random init, in the source dtype, holding `state` (strict load)."""
    with no_init_weights():
        native = cls(config)
    native.to(model.dtype)
    try:
        native.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise refuse(fmt, f"the mapped weights do not fit {cls.__name__}: {e}") from None
    if getattr(model, "generation_config", None) is not None:
        native.generation_config = copy.deepcopy(model.generation_config)
    return native.eval()
