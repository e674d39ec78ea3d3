"""Export to Qwen2-MoE (transformers Qwen2MoeForCausalLM), the native format with a shared expert."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)

from moekit.checkpoint.parts import Item, LayerParts, routed_items
from moekit.export.base import EXPORTERS, MoEPlan, NativeFormat, copied_config, qwen_moe_fields, refuse


class Qwen2Moe(NativeFormat):
    """Qwen2-MoE: MoE decoder MLPs y = Σ_{i∈topk} w_i E_i(x) + sigmoid(g·x) S(x), w = top-k of
    softmax(logits), renormalized iff norm_topk_prob (= scoring "topk_softmax"); dense layers via
    mlp_only_layers (intermediate_size = the dense I, moe_intermediate_size = the routed expert I).
    Sources: Qwen2, and Llama / Mistral (their q/k/v projections get zero biases, which Qwen2-MoE's
    attention adds: exact). Shared experts must all have one size (see `layer_items` for the exact gate).
    Without one, each layer gets an all-zero shared expert of the routed expert's size: dead weight
    (~1/E of the routed experts) that keeps tensor-parallel runtimes' divisibility assumptions intact.
    No router jitter."""

    name = "qwen2_moe"
    native = Qwen2MoeForCausalLM
    sources = (Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM)

    def check(self, model: nn.Module, p: MoEPlan) -> None:
        p.require_no_jitter()
        cfg = model.config
        if not isinstance(model, Qwen2ForCausalLM) and (getattr(cfg, "attention_bias", False)
                                                        or getattr(cfg, "mlp_bias", False)):
            raise refuse(self.name, "the source has attention or MLP biases; Qwen2-MoE has q/k/v biases only")
        if isinstance(model, MistralForCausalLM) and (cfg.sliding_window or 0) > 0:
            raise refuse(self.name, f"the source uses a sliding window of {cfg.sliding_window} in every layer; "
                         "Qwen2-MoE's sliding window follows its own layer pattern; export to mixtral")

    def config(self, model: nn.Module, p: MoEPlan) -> Qwen2MoeConfig:
        src = model.config
        own = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
        return Qwen2MoeConfig(**copied_config(model, *(own if isinstance(model, Qwen2ForCausalLM) else ())),
                              **qwen_moe_fields(p, src.num_hidden_layers), intermediate_size=src.intermediate_size,
                              shared_expert_intermediate_size=p.shared_size or p.intermediate_size, qkv_bias=True)

    def layer_items(self, parts: LayerParts, p: MoEPlan) -> Iterator[Item]:
        """Routed experts and router, then the shared expert. Qwen2-MoE adds sigmoid(shared_expert_gate(x))·S(x):
        moekit's shared gate (MoESpec.shared_gate) is that gate, as is. An ungated moekit shared expert adds S(x):
        a zero gate gives sigmoid(0) = 0.5, so down_proj is doubled: 0.5·(2W)h = Wh exactly in floating point
        (scaling by 2 only shifts exponents). Without a shared expert, all-zero weights make S(x) = 0 exactly."""
        yield from routed_items(parts, "experts.gate_up_proj", "experts.down_proj", "gate.weight")
        sh, size, H = parts.shared(), p.shared_size or p.intermediate_size, parts.hidden_size
        gate = parts.shared_gate()
        if sh is None:
            zeros = torch.zeros(size, H)  # (I_s, H)
            mlp = {"gate_proj": zeros, "up_proj": zeros, "down_proj": torch.zeros(H, size)}
        else:
            mlp = {"gate_proj": sh.gate, "up_proj": sh.up, "down_proj": sh.down * 2 if gate is None else sh.down}
        yield "shared_expert_gate.weight", torch.zeros(1, H) if gate is None else gate, None  # sigmoid(0) = 0.5
        for k, w in mlp.items():
            yield f"shared_expert.{k}.weight", w, None

    def extra_tensors(self, model: nn.Module, p: MoEPlan) -> dict[str, Tensor]:
        """Zero q/k/v biases for Llama / Mistral sources (Qwen2 sources have their own)."""
        if isinstance(model, Qwen2ForCausalLM):
            return {}
        out = {}
        for i, layer in enumerate(model.model.layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, name)
                out[f"model.layers.{i}.self_attn.{name}.bias"] = torch.zeros(lin.out_features, dtype=model.dtype)
        return out


EXPORTERS.register("qwen2_moe")(Qwen2Moe())
