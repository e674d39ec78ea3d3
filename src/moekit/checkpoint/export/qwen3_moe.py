"""Export to Qwen3-MoE (transformers Qwen3MoeForCausalLM)."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moekit.checkpoint.export.base import (LLAMA_CPP, EXPORTERS, MoEPlan, NativeFormat, copied_config, dense_gap, qwen_moe_fields,
                                refuse, rope_gap)


class Qwen3Moe(NativeFormat):
    """Qwen3-MoE: MoE decoder MLPs y = Σ_{i∈topk} w_i E_i(x), w = top-k of softmax(logits), renormalized
    iff norm_topk_prob (= moekit scoring "topk_softmax"); dense layers kept via mlp_only_layers; no
    shared expert, no router jitter. Source: Qwen3 (q/k norms)."""

    name = "qwen3_moe"
    native = Qwen3MoeForCausalLM
    sources = (Qwen3ForCausalLM,)

    def check(self, model: nn.Module, p: MoEPlan) -> None:
        if p.shared_size is not None:
            raise refuse(self.name, "the MoE layers have a shared expert, which Qwen3-MoE lacks; qwen2_moe has one "
                         "(from a Qwen2, Llama or Mistral source)")
        p.require_no_jitter()
        self._attention(model.config)

    def gaps(self, model: nn.Module, p: MoEPlan, gaps: dict[str, list[str]]) -> None:
        """llama.cpp's Qwen3-MoE: every layer MoE, top-k weights always renormalized, no sliding window."""
        cfg = model.config
        out = gaps[LLAMA_CPP]
        out += dense_gap(p, cfg.num_hidden_layers)
        if p.scoring != "topk_softmax":
            out.append("top-k weights that are not renormalized (norm_topk_prob false; it always renormalizes)")
        if self._attention(cfg)["use_sliding_window"]:
            out.append(f"a sliding window of {cfg.sliding_window} (llama.cpp attends to the whole context)")
        out += rope_gap(cfg, ("default", "linear", "yarn"))

    def _attention(self, src: PretrainedConfig) -> dict:
        """Qwen3-MoE uses one sliding window for every layer or none; Qwen3 may choose per layer (layer_types)."""
        kinds = set(src.layer_types)
        if kinds == {"full_attention"}:
            return {"use_sliding_window": False}
        if kinds == {"sliding_attention"}:
            return {"use_sliding_window": True, "sliding_window": src.sliding_window}
        raise refuse(self.name, "the source mixes sliding-window and full-attention layers (layer_types); Qwen3-MoE "
                     "uses one attention kind for every layer")

    def config(self, model: nn.Module, p: MoEPlan) -> Qwen3MoeConfig:
        src = model.config
        return Qwen3MoeConfig(**copied_config(model, "attention_bias"), **self._attention(src),
                              **qwen_moe_fields(p, src.num_hidden_layers), intermediate_size=src.intermediate_size)


EXPORTERS.register("qwen3_moe")(Qwen3Moe())
