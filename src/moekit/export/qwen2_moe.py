"""Export to Qwen2-MoE (transformers Qwen2MoeForCausalLM), the native format with a shared expert."""
from __future__ import annotations

from torch import Tensor, nn
from transformers import Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from moekit.export.base import (EXPORTERS, build_native, check_source, copied_config, native_state, plan,
                                qwen_moe_fields, routed_tensors)
from moekit.moe.layer import MoELayer

FMT = "qwen2_moe"


def _shared_tensors(moe: MoELayer, size: int) -> dict[str, Tensor]:
    """Qwen2-MoE adds sigmoid(shared_expert_gate(x)) · S(x); moekit adds S(x) ungated. A zero gate gives
    sigmoid(0) = 0.5, so down_proj is doubled: 0.5 · (2W)h = Wh exactly in floating point (scaling by 2
    only shifts exponents). Without a shared expert, all-zero weights make S(x) = 0 exactly."""
    H = moe.experts.hidden_size
    down = moe.experts.down
    sh = moe.shared
    if sh is None:
        zeros = down.new_zeros(size, H)  # (I_s, H)
        mlp = {"gate_proj": zeros, "up_proj": zeros, "down_proj": down.new_zeros(H, size)}
    else:
        mlp = {"gate_proj": sh.gate_proj.weight.detach(), "up_proj": sh.up_proj.weight.detach(),
               "down_proj": sh.down_proj.weight.detach() * 2}  # (H, I_s)
    gate = down.new_zeros(1, H)  # (1, H): sigmoid(0) = 0.5
    return {"shared_expert_gate.weight": gate, **{f"shared_expert.{k}.weight": w for k, w in mlp.items()}}


@EXPORTERS.register(FMT)
def to_qwen2_moe(model: nn.Module) -> Qwen2MoeForCausalLM:
    """Qwen2-MoE: MoE decoder MLPs y = Σ_{i∈topk} w_i E_i(x) + sigmoid(g·x) S(x), w = top-k of
    softmax(logits), renormalized iff norm_topk_prob (= scoring "topk_softmax"); dense layers via
    mlp_only_layers (intermediate_size = the dense I, moe_intermediate_size = the routed expert I).
    Source: Qwen2. Shared experts must all have one size (see _shared_tensors for the exact gate).
    Without one, each layer gets an all-zero shared expert of the routed expert's size: dead weight
    (~1/E of the routed experts) that keeps tensor-parallel runtimes' divisibility assumptions intact.
    No router jitter."""
    check_source(model, FMT, (Qwen2ForCausalLM,))
    p = plan(model, FMT)
    p.require_no_jitter()
    src = model.config
    size = p.shared_size or p.intermediate_size
    config = Qwen2MoeConfig(**copied_config(model, "use_sliding_window", "sliding_window", "max_window_layers",
                                            "layer_types"),
                            **qwen_moe_fields(p, src.num_hidden_layers), intermediate_size=src.intermediate_size,
                            shared_expert_intermediate_size=size, qkv_bias=True)
    state = native_state(model, p, lambda moe: {**routed_tensors(moe), **_shared_tensors(moe, size)})
    return build_native(Qwen2MoeForCausalLM, config, model, state, FMT)
