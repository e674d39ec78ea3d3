"""Export to Mixtral (transformers MixtralForCausalLM)."""
from __future__ import annotations

from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

from moekit.export.base import EXPORTERS, MoEPlan, NativeFormat, copied_config, refuse


class Mixtral(NativeFormat):
    """Mixtral: every decoder MLP is y = Σ_{i∈topk} w_i E_i(x), w = softmax(logits) top-k renormalized
    (MixtralTopKRouter), experts gated SiLU, no shared expert. Source: Llama or Mistral without biases.

    The router jitter becomes router_jitter_noise. Training-time difference: Mixtral multiplies the
    input of both router and experts by the noise, moekit only the router's (inference is the same).
    """

    name = "mixtral"
    native = MixtralForCausalLM
    sources = (LlamaForCausalLM, MistralForCausalLM)

    def check(self, model: nn.Module, p: MoEPlan) -> None:
        cfg = model.config
        if getattr(cfg, "attention_bias", False):
            raise refuse(self.name, "the source has attention biases; Mixtral's attention has none")
        if cfg.hidden_act != "silu":
            raise refuse(self.name, f"the source's activation is {cfg.hidden_act!r}; Mixtral experts are gated SiLU")
        dense = p.dense_layers(cfg.num_hidden_layers)
        if dense:
            raise refuse(self.name, f"decoder layers {dense} are dense, and Mixtral has no dense layers (every MLP "
                         "is MoE); upcycle every layer, or export to qwen2_moe, which keeps dense layers")
        if p.scoring != "topk_softmax":
            raise refuse(self.name, f"the router scoring is {p.scoring!r}, but Mixtral renormalizes the top-k "
                         "weights (scoring='topk_softmax'); qwen2_moe / qwen3_moe support it (norm_topk_prob=false)")
        if p.shared_size is not None:
            raise refuse(self.name, "the MoE layers have a shared expert, which Mixtral lacks; qwen2_moe has one")

    def config(self, model: nn.Module, p: MoEPlan) -> MixtralConfig:
        return MixtralConfig(**copied_config(model, "sliding_window"), intermediate_size=p.intermediate_size,
                             num_local_experts=p.num_experts, num_experts_per_tok=p.top_k,
                             router_jitter_noise=p.jitter)


EXPORTERS.register("mixtral")(Mixtral())
