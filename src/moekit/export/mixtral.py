"""Export to Mixtral (transformers MixtralForCausalLM)."""
from __future__ import annotations

from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

from moekit.export.base import (EXPORTERS, MoEPlan, build_native, check_source, copied_config, native_state, plan,
                                refuse, routed_tensors)

FMT = "mixtral"


def _check(p: MoEPlan, model: nn.Module) -> None:
    cfg = model.config
    if getattr(cfg, "attention_bias", False):
        raise refuse(FMT, "the source has attention biases; Mixtral's attention has none")
    if cfg.hidden_act != "silu":
        raise refuse(FMT, f"the source's activation is {cfg.hidden_act!r}; Mixtral experts are gated SiLU")
    dense = p.dense_layers(cfg.num_hidden_layers)
    if dense:
        raise refuse(FMT, f"decoder layers {dense} are dense, and Mixtral has no dense layers (every MLP is "
                     "MoE); upcycle every layer, or export to qwen3_moe / qwen2_moe, which keep dense layers")
    if p.scoring != "topk_softmax":
        raise refuse(FMT, f"the router scoring is {p.scoring!r}, but Mixtral renormalizes the top-k weights "
                     "(scoring='topk_softmax'); qwen3_moe / qwen2_moe support it (norm_topk_prob=false)")
    if p.shared_size is not None:
        raise refuse(FMT, "the MoE layers have a shared expert, which Mixtral lacks; qwen2_moe has one")


@EXPORTERS.register(FMT)
def to_mixtral(model: nn.Module) -> MixtralForCausalLM:
    """Mixtral: every decoder MLP is y = Σ_{i∈topk} w_i E_i(x), w = softmax(logits) top-k renormalized
    (MixtralTopKRouter), experts gated SiLU, no shared expert. Source: Llama or Mistral without biases.

    The router jitter becomes router_jitter_noise. Training-time difference: Mixtral multiplies the
    input of both router and experts by the noise, moekit only the router's (inference is the same).
    """
    check_source(model, FMT, (LlamaForCausalLM, MistralForCausalLM))
    p = plan(model, FMT)
    _check(p, model)
    config = MixtralConfig(**copied_config(model, "sliding_window"), intermediate_size=p.intermediate_size,
                           num_local_experts=p.num_experts, num_experts_per_tok=p.top_k,
                           router_jitter_noise=p.jitter)
    return build_native(MixtralForCausalLM, config, model, native_state(model, p, routed_tensors), FMT)
