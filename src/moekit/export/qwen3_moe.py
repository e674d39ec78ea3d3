"""Export to Qwen3-MoE (transformers Qwen3MoeForCausalLM)."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moekit.export.base import (EXPORTERS, build_native, check_source, copied_config, native_state, plan,
                                qwen_moe_fields, refuse, routed_tensors)

FMT = "qwen3_moe"


def _attention(src: PretrainedConfig) -> dict:
    """Qwen3-MoE uses one sliding window for every layer or none; Qwen3 may choose per layer (layer_types)."""
    kinds = set(src.layer_types)
    if kinds == {"full_attention"}:
        return {"use_sliding_window": False}
    if kinds == {"sliding_attention"}:
        return {"use_sliding_window": True, "sliding_window": src.sliding_window}
    raise refuse(FMT, "the source mixes sliding-window and full-attention layers (layer_types); Qwen3-MoE "
                 "uses one attention kind for every layer")


@EXPORTERS.register(FMT)
def to_qwen3_moe(model: nn.Module) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE: MoE decoder MLPs y = Σ_{i∈topk} w_i E_i(x), w = top-k of softmax(logits), renormalized
    iff norm_topk_prob (= moekit scoring "topk_softmax"); dense layers kept via mlp_only_layers; no
    shared expert, no router jitter. Source: Qwen3 (q/k norms)."""
    check_source(model, FMT, (Qwen3ForCausalLM,))
    p = plan(model, FMT)
    if p.shared_size is not None:
        raise refuse(FMT, "the MoE layers have a shared expert, which Qwen3-MoE lacks; qwen2_moe has one "
                     "(from a Qwen2 source)")
    p.require_no_jitter()
    src = model.config
    config = Qwen3MoeConfig(**copied_config(model, "attention_bias"), **_attention(src),
                            **qwen_moe_fields(p, src.num_hidden_layers), intermediate_size=src.intermediate_size)
    return build_native(Qwen3MoeForCausalLM, config, model, native_state(model, p, routed_tensors), FMT)
