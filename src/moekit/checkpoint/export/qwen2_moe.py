"""Export to Qwen2-MoE (transformers Qwen2MoeForCausalLM), the native format with a shared expert."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)

from moekit.checkpoint.parts import Item, LayerParts
from moekit.checkpoint.export.base import (LLAMA_CPP, EXPORTERS, MoEPlan, NativeFormat, copied_config, dense_gap, qwen_moe_fields,
                                refuse, rope_gap, window_gap)

HALF_GATE_SCALE = 2.0 ** -60  # entries of the constant gate row: 2^-60 * [1, 2) (float32 and bfloat16)
HALF_GATE_SCALE_F16 = 2.0 ** -24  # float16's smallest value: 2^-60 would be 0 there


def half_gate(hidden: int, dtype: torch.dtype) -> Tensor:
    """A shared-expert gate row g (1, H) with sigmoid(g·x) = 1/2 exactly for the inputs Qwen2-MoE gives it (the
    post-attention RMSNorm's output x), in transformers as in llama.cpp, which computes that sigmoid as
    silu(z)/z and so turns a zero gate (z = 0) into 0/0 = NaN.

    g_j = 2^-60 u_j, u_j in [1, 2) with 7 fraction bits (exact in bfloat16), fixed pseudo-random. An RMSNorm of
    weight w gives ||x||_1 <= sqrt(H) ||x||_2 <= H max|w|, so |z| < 2^-59 H max|w| <= 2^-26 whenever
    H max|w| <= 2^33 (e.g. H = 2^14 with max|w| <= 2^19). For |z| <= 2^-26, float32 computes exp(-z) as 1 (within an ulp), so
    1 / (1 + exp(-z)) = 1/2 exactly (transformers' sigmoid, also rounded to bfloat16) and silu(z) = z / 2,
    silu(z) / z = 1/2 exactly (llama.cpp; z / 2 is a normal float while |z| >= 2^-125). z = 0 only when the H
    products cancel exactly (or x = 0), which real hidden states do not; a zero row would be 0 always.
    float16 cannot hold 2^-60: there g_j = 2^-24 (its smallest value), exact in transformers computing in float16
    while |z| < 2^-11, and in llama.cpp (float32) 1/2 within a relative |z|/2 (docs/guides/export.md)."""
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.float16:
        return torch.full((1, hidden), HALF_GATE_SCALE_F16)
    u = 1 + torch.randint(0, 128, (1, hidden), generator=gen).float() / 128  # (1, H)
    return u * HALF_GATE_SCALE


class Qwen2Moe(NativeFormat):
    """Qwen2-MoE: MoE decoder MLPs y = Σ_{i∈topk} w_i E_i(x) + sigmoid(g·x) S(x), w = top-k of
    softmax(logits), renormalized iff norm_topk_prob (= scoring "topk_softmax"); dense layers via
    mlp_only_layers (intermediate_size = the dense I, moe_intermediate_size = the routed expert I).
    Sources: Qwen2, and Llama / Mistral (their q/k/v projections get zero biases, which Qwen2-MoE's
    attention adds: exact). Shared experts must all have one size (see `layer_items` for the exact gate).
    Without one, each layer gets an all-zero shared expert of the routed expert's size: dead weight
    (~1/E of the routed experts) that keeps tensor-parallel runtimes' divisibility assumptions intact.
    No router jitter. A tied lm_head is written too (llama.cpp's Qwen2-MoE loader needs output.weight)."""

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
        the gate is `half_gate` (sigmoid = 1/2 exactly), so down_proj is doubled: 0.5·(2W)h = Wh exactly in floating
        point (scaling by 2 only shifts exponents). Without a shared expert, all-zero weights make S(x) = 0 exactly.
        A gate row that is exactly zero is written as `half_gate` too (the same 1/2, and no 0/0 in llama.cpp)."""
        yield from self.routed(parts, p)
        sh, size, H = parts.shared(), p.shared_size or p.intermediate_size, parts.hidden_size
        gate = parts.shared_gate()
        if sh is None:
            zeros = torch.zeros(size, H)  # (I_s, H)
            mlp = {"gate_proj": zeros, "up_proj": zeros, "down_proj": torch.zeros(H, size)}
        else:
            mlp = {"gate_proj": sh.gate, "up_proj": sh.up, "down_proj": sh.down * 2 if gate is None else sh.down}
        if gate is None or (not gate.is_meta and not gate.any()):
            gate = half_gate(H, p.dtype)  # (1, H)
        yield "shared_expert_gate.weight", gate, None
        for k, w in mlp.items():
            yield f"shared_expert.{k}.weight", w, None

    def tied_copies(self, model: nn.Module, p: MoEPlan) -> list[str]:
        return ["lm_head.weight"] if getattr(model.config, "tie_word_embeddings", False) else []

    def gaps(self, model: nn.Module, p: MoEPlan, gaps: dict[str, list[str]]) -> None:
        """llama.cpp's Qwen2-MoE: every layer MoE with a shared expert, top-k weights never renormalized, no sliding
        window; float16 cannot hold half_gate's row."""
        cfg = model.config
        out = gaps[LLAMA_CPP]
        out += dense_gap(p, cfg.num_hidden_layers)
        if p.scoring == "topk_softmax":
            out.append("renormalized top-k weights (norm_topk_prob; llama.cpp's Qwen2-MoE ignores it)")
        if p.dtype == torch.float16 and any(m.shared is not None and m.shared_gate is None for m in p.layers.values()):
            out.append("an ungated shared expert in float16 (too small a gate row for float16: llama.cpp's float32 "
                       "sigmoid gives 1/2 only approximately)")
        if isinstance(model, Qwen2ForCausalLM):
            out += window_gap(cfg)
        out += rope_gap(cfg, ("default", "linear", "yarn"))

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
