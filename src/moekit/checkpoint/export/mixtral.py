"""Export to Mixtral (transformers MixtralForCausalLM)."""
from __future__ import annotations

from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

from moekit.checkpoint.export.base import LLAMA_CPP, EXPORTERS, MoEPlan, NativeFormat, copied_config, refuse, rope_gap, window_gap


class Mixtral(NativeFormat):
    """Mixtral: every decoder MLP is y = Σ_{i∈topk} w_i E_i(x), w = softmax(logits) top-k renormalized
    (MixtralTopKRouter), experts gated SiLU, no shared expert. Source: Llama or Mistral without biases.

    The router jitter becomes router_jitter_noise. Training-time difference: Mixtral multiplies the
    input of both router and experts by the noise, moekit only the router's (inference is the same).
    Classic layout: model.layers.N.block_sparse_moe.gate.weight, ...experts.E.w1|w3|w2.weight (gate, up, down).
    """

    name = "mixtral"
    native = MixtralForCausalLM
    sources = (LlamaForCausalLM, MistralForCausalLM)
    classic_block = "block_sparse_moe"
    classic_experts = ("w1", "w3", "w2")

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

    def gaps(self, model: nn.Module, p: MoEPlan, gaps: dict[str, list[str]]) -> None:
        """llama.cpp reads Mixtral as its Llama architecture: no sliding window; its converter maps only the classic
        expert names ("Can not map tensor ...experts.gate_up_proj")."""
        if p.layout == "fused":
            gaps[LLAMA_CPP].append("the fused expert layout (its converter maps only the classic names)")
        gaps[LLAMA_CPP] += window_gap(model.config) + rope_gap(model.config, ("default", "linear", "yarn", "llama3"))

    def config(self, model: nn.Module, p: MoEPlan) -> MixtralConfig:
        return MixtralConfig(**copied_config(model, "sliding_window"), intermediate_size=p.intermediate_size,
                             num_local_experts=p.num_experts, num_experts_per_tok=p.top_k,
                             router_jitter_noise=p.jitter)


EXPORTERS.register("mixtral")(Mixtral())
