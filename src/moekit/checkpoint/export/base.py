"""What the native exporters share: the MoE layers of a decoder-only source and the one layout they
must share (a native config has one), the checks that keep the export exact, the config fields copied
from the source, and building the native model from a renamed state dict.

An exporter is a NativeFormat registered in EXPORTERS: `fmt(model)` gives the native model, and its
pieces (plan, config, per-layer tensor names) drive the writers (moekit.checkpoint.stream, for the streaming and
the in-memory export alike). It raises ExportError (one reason) before anything is written.

Two layouts of the routed experts are written. `classic` (the default): one tensor per expert and projection, the
names of the Hub's own checkpoints (mistralai/Mixtral-8x7B-v0.1: block_sparse_moe.gate / experts.E.w1|w3|w2;
Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B: mlp.gate / mlp.experts.E.gate_proj|up_proj|down_proj), which every
reader takes: transformers 4.x, llama.cpp's converter, vLLM, and transformers 5, which fuses them on load
(transformers/conversion_mapping.py). `fused`: transformers 5's own stacked tensors (experts.gate_up_proj (E, 2I, H),
experts.down_proj (E, H, I)), read by transformers >= 5 only (4.x initializes the experts anew, with a warning).
What a reader computes differently from transformers (llama.cpp's Qwen2-MoE ignores norm_topk_prob, ...) is known
per format: `NativeFormat.reader_gaps`.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights

from moekit.checkpoint.parts import Item, LayerParts, assemble, classic_items, routed_items
from moekit.errors import ConfigError, ExportError
from moekit.moe.layer import MoELayer, moe_layers
from moekit.registry import Registry
from moekit.moe.state import spec_of

EXPORTERS: Registry["NativeFormat"] = Registry("export format")
LAYOUTS = ("classic", "fused")  # see the module docstring
TF4, LLAMA_CPP = "transformers 4.57", "llama.cpp"  # the readers besides transformers 5 whose computation is known

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
    layout: str = "classic"  # of the routed experts as written (LAYOUTS)
    dtype: torch.dtype = torch.float32  # of the tensors as written

    def dense_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if i not in self.layers]

    def require_no_jitter(self) -> None:
        """For formats without router jitter (a training-time regularizer; dropping it silently would
        change training)."""
        if self.jitter > 0:
            raise refuse(self.fmt, f"router jitter ({self.jitter}) has no equivalent in this format; set "
                         "`router.jitter = 0` on every MoE layer (inference is unaffected) and export again")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    return layout


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


def legacy_config(config: dict) -> dict:
    """config.json as transformers 5 writes it plus the keys transformers 4.x reads instead (both read the same
    values): rope_theta (and rope_scaling for a scaled rope) beside rope_parameters, num_experts beside
    num_local_experts (Qwen-MoE). Without them 4.x takes its own defaults (e.g. Mixtral's rope_theta 1e6)."""
    out = dict(config)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # one rope for every layer
        out.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if out.get("model_type", "").startswith("qwen") and "num_local_experts" in out:
        out.setdefault("num_experts", out["num_local_experts"])
    return out


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
    classic_block: ClassVar[str] = "mlp"  # the MoE block's name in the classic layout (Mixtral: block_sparse_moe)
    classic_experts: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down

    def plan(self, model: nn.Module, layout: str = "classic", dtype: torch.dtype | None = None) -> MoEPlan:
        """Every check (one ExportError with the reason) and the layout the native config needs; `dtype`: of the
        tensors as written (default: the model's)."""
        check_layout(layout)
        check_source(model, self.name, self.sources)
        p = plan(model, self.name)
        p.layout, p.dtype = layout, dtype or model.dtype
        self.check(model, p)
        return p

    def check(self, model: nn.Module, p: MoEPlan) -> None:
        """Format-specific refusals."""

    def config(self, model: nn.Module, p: MoEPlan) -> PretrainedConfig:
        raise NotImplementedError

    def prefix(self, path: str, p: MoEPlan) -> str:
        """The prefix of the native tensors of the MoE layer at `path` (model.layers.<i>.mlp)."""
        block = self.classic_block if p.layout == "classic" else "mlp"
        return f"{path.removesuffix('.mlp')}.{block}."

    def routed(self, parts: LayerParts, p: MoEPlan) -> Iterator[Item]:
        """The routed experts and the router in the plan's layout."""
        if p.layout == "fused":
            return routed_items(parts, "experts.gate_up_proj", "experts.down_proj", "gate.weight")
        return classic_items(parts, *self.classic_experts, "gate.weight")

    def layer_items(self, parts: LayerParts, p: MoEPlan) -> Iterator[Item]:
        """The native tensors of one MoE layer (names relative to `prefix`). Default: routed experts only."""
        return self.routed(parts, p)

    def extra_tensors(self, model: nn.Module, p: MoEPlan) -> dict[str, Tensor]:
        """Native tensors the source lacks (e.g. zero q/k/v biases), by full name."""
        return {}

    def tied_copies(self, model: nn.Module, p: MoEPlan) -> list[str]:
        """Tied tensors written although the model ties them (a reader that needs them stored)."""
        return []

    def reader_gaps(self, model: nn.Module, p: MoEPlan) -> dict[str, list[str]]:
        """{reader: what it computes differently from transformers 5 (empty: the same)}, for the readers besides
        transformers 5 whose computation is known: transformers 4.57 and llama.cpp (its convert_hf_to_gguf.py and
        runtime, as of llama-cpp-python 0.3.36)."""
        gaps: dict[str, list[str]] = {TF4: [], LLAMA_CPP: []}
        if p.layout == "fused":
            gaps[TF4].append("the fused expert layout (transformers 4.x initializes those experts anew)")
        self.gaps(model, p, gaps)
        return gaps

    def gaps(self, model: nn.Module, p: MoEPlan, gaps: dict[str, list[str]]) -> None:
        """Format-specific reader gaps (see reader_gaps)."""

    def write_config(self, model: nn.Module, p: MoEPlan, folder: Path) -> None:
        """config.json of the native model (dtype as written) with transformers 4.x's keys too (legacy_config)."""
        config = self.config(model, p)
        config.dtype = str(p.dtype).removeprefix("torch.")
        config.architectures = [self.native.__name__]  # as the native model's save_pretrained writes it
        config.save_pretrained(folder)
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(legacy_config(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")

    def __call__(self, model: nn.Module) -> PreTrainedModel:
        """The native model holding `model`'s weights (in-memory, as transformers 5 holds it: fused)."""
        p = self.plan(model, "fused")
        prefixes = tuple(f"model.layers.{i}.mlp." for i in p.layers)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}
        for i, moe in p.layers.items():
            layer = assemble(self.layer_items(LayerParts(moe), p))
            state.update({f"model.layers.{i}.mlp.{k}": v for k, v in layer.items()})
        state.update(self.extra_tensors(model, p))
        return build_native(self.native, self.config(model, p), model, state, self.name)


def dense_gap(p: MoEPlan, num_layers: int) -> list[str]:
    dense = p.dense_layers(num_layers)
    shown = str(dense) if len(dense) <= 6 else f"[{', '.join(map(str, dense[:3]))}, ..., {dense[-1]}] ({len(dense)})"
    return [f"dense decoder layers {shown} between the MoE layers (every layer must be MoE)"] if dense else []


def window_gap(config: PretrainedConfig) -> list[str]:
    window = getattr(config, "sliding_window", None)
    use = getattr(config, "use_sliding_window", window is not None)
    return [f"a sliding window of {window} (llama.cpp attends to the whole context)"] if use and window else []


def rope_gap(config: PretrainedConfig, handled: tuple[str, ...]) -> list[str]:
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "per-layer"
    return [] if kind in handled else [f"rope scaling {kind!r}"]


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
