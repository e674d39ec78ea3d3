"""`moekit.inspect`: what a moekit checkpoint, or a transformers MoE model directory, holds (`moekit inspect`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from moekit.moe.spec import MoESpec
    from moekit.routing.sites import RouterSite

CONFIG_KEYS = ("model_type", "hidden_size", "d_model", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "encoder_layers", "decoder_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "hidden_act", "activation_function", "dtype")


@dataclass(frozen=True)
class LayerSummary:
    """One MoE layer. `scoring`, `expert_ffn` and `router` describe a moekit layer; `params_per_expert` and
    `block` a native transformers one (None otherwise)."""

    path: str
    experts: int
    top_k: int
    shared_expert: str  # "no", or what the shared expert is
    scoring: str | None = None  # the router's scoring function (softmax, sigmoid, ...)
    expert_ffn: str | None = None  # e.g. "gated silu, I=64"
    router: str | None = None  # "own", or "shared with <path>"
    params_per_expert: int | None = None
    block: str | None = None  # the transformers class of the MoE block
    zero_experts: int = 0  # of `experts`, those that compute nothing (LongCat-Flash's identity experts)


@dataclass(frozen=True)
class InspectSummary:
    """What `moekit inspect` shows: the base config, the MoE layers, parameter counts and (moekit checkpoints) the
    MoE spec the model was upcycled with."""

    path: Path
    native: bool  # a transformers MoE directory (read from its config alone), not a moekit checkpoint
    description: str  # "LlamaForCausalLM, format 1" or "MixtralForCausalLM, native transformers MoE"
    config: dict[str, str]  # CONFIG_KEYS the base config sets
    layers: list[LayerSummary]
    total_params: int
    active_params: int  # per token: k of E routed experts per MoE layer
    spec: MoESpec | None = None  # None for a native model or a checkpoint that did not record it


def inspect(path: str | Path, *, trust_remote_code: bool = False) -> InspectSummary:
    """Describe a moekit checkpoint, or a transformers MoE model directory, without running it.

    A transformers MoE directory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) is built on the meta device from its
    config alone: no weight is read. A moekit checkpoint is validated and loaded.

    Args:
        path: A moekit checkpoint directory (with moekit.json) or a transformers MoE model directory.
        trust_remote_code: Allow a model directory that ships its own Python code (auto_map); it will run.

    Returns:
        The summary `moekit inspect` prints.

    Raises:
        MoekitError: `path` is neither a moekit checkpoint nor a transformers MoE model directory, or is damaged.

    Example:
        >>> summary = moekit.inspect("llama-moe")  # doctest: +SKIP
        >>> summary.layers[0].experts, summary.active_params  # doctest: +SKIP
    """
    folder = Path(path)
    if (folder / "config.json").is_file() and not (folder / "moekit.json").exists():
        return _native(folder, trust_remote_code)
    return _moekit(folder)


def _moekit(folder: Path) -> InspectSummary:
    from moekit.checkpoint.format import load, read_meta
    from moekit.moe.state import spec_of

    meta = read_meta(folder)  # a clear error before loading anything
    model = load(folder)
    return _summary(folder, False, f"{meta['architecture']}, format {meta['format']}", model, _moekit_layers(model),
                    spec_of(model))


def _native(folder: Path, trust_remote_code: bool) -> InspectSummary:
    """A transformers MoE directory, built on the meta device from its config (no weight is read; the shapes it gives
    are checked against the safetensors headers where there are weights)."""
    from moekit.checkpoint.dense import check_stored_shapes, has_safetensors, meta_model
    from moekit.checkpoint.files import quantization
    from moekit.errors import CheckpointError, UnsupportedModelError
    from moekit.routing.sites import find_sites

    model = meta_model(folder, trust_remote_code)
    if has_safetensors(folder, allow_pickle=True):
        check_stored_shapes(folder, model)
    try:
        sites = find_sites(model)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{folder} is not a moekit checkpoint (no moekit.json), and {e}") from None
    fmt = quantization(folder)
    return _summary(folder, True, f"{type(model).__name__}, native transformers MoE{f', {fmt}' if fmt else ''}",
                    model, [_native_layer(s) for s in sites], None)


def _summary(folder: Path, native: bool, description: str, model: nn.Module, layers: list[LayerSummary],
             spec: MoESpec | None) -> InspectSummary:
    from moekit.routing.sites import param_counts

    d = model.config.to_dict()
    config = {key: str(d[key]) for key in CONFIG_KEYS if d.get(key) is not None}
    total, active = param_counts(model)
    return InspectSummary(folder, native, description, config, layers, total, active, spec)


def _moekit_layers(model: nn.Module) -> list[LayerSummary]:
    from moekit.moe.layer import moe_layers

    layers: list[LayerSummary] = []
    owner: dict[int, str] = {}
    for path, moe in moe_layers(model):
        ex, r = moe.experts, moe.router
        first = owner.setdefault(id(r), path)
        shared = "no" if moe.shared is None else \
            f"yes (I={moe.shared.up_proj.out_features}{', gated' if moe.shared_gate is not None else ''})"
        layers.append(LayerSummary(path, ex.num_experts, r.top_k, shared, r.scoring,
                                   f"{'gated ' if ex.gated else ''}{ex.act}, I={ex.intermediate_size}",
                                   "own" if first == path else f"shared with {first}"))
    return layers


def _native_layer(site: RouterSite) -> LayerSummary:
    from moekit.routing.sites import zero_experts

    shared = [n for n, m in site.block.named_children() if "shared" in n and any(True for _ in m.parameters())]
    return LayerSummary(site.name, site.num_experts, site.top_k, ", ".join(shared) or "no",
                        params_per_expert=site.params_per_expert, block=type(site.block).__name__,
                        zero_experts=zero_experts(site))


__all__ = ["InspectSummary", "LayerSummary", "inspect"]
