from __future__ import annotations

from typing import ClassVar, Literal

from moekit.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext, require_equal_to_dense


@EXPERT_INITS.register("scaled_copy")
class ScaledCopyInit(ExpertInitConfig):
    """Weight scaling for softmax-then-top-k routers (He et al. 2024, "Upcycling Large Language
    Models into Mixture of Experts", §3; Megatron-Core `upcycling_utils._get_moe_activation_scale`).

    With softmax-then-top-k and no renormalization, the k kept probabilities of a uniform router
    sum to k/E, so the MoE output is (k/E)·FFN(x). Megatron scales the expert output by
    s = E·G²/k (granularity G = 1 here: s = E/k). `distribute="down"` puts all of s on the down
    projection, which is exact for every activation, so with the zero-initialized router this
    method defaults to, the MoE equals the dense model at init. `distribute="megatron"` spreads it
    as Megatron does (s^(1/3) on gate, up and down for gated FFNs, s^(1/2) on fc1 and fc2
    otherwise); that is exact only for homogeneous activations (ReLU², ReLU), not SiLU/GELU.
    """

    method: Literal["scaled_copy"] = "scaled_copy"
    distribute: Literal["down", "megatron"] = "down"
    default_scoring: ClassVar[str] = "softmax_topk"
    default_router_init: ClassVar[str] = "zeros"

    def check(self, spec) -> None:
        require_equal_to_dense(spec, "scaled_copy", "softmax_topk")

    def prepare(self, ctx: InitContext) -> FFNWeights:
        """The scaled copy every expert is."""
        s = ctx.spec.num_experts / ctx.spec.top_k
        d = ctx.dense
        if self.distribute == "down":  # y_i = s·(W_down h + b_down): exact
            scaled = d.clone(down=d.down * s, down_bias=None if d.down_bias is None else d.down_bias * s)
        elif d.gated:
            c = s ** (1 / 3)
            scaled = d.clone(gate=d.gate * c, up=d.up * c, down=d.down * c)
        else:  # Megatron scales fc1 (weight and bias) and fc2's weight, not fc2's bias
            c = s ** (1 / 2)
            scaled = d.clone(up=d.up * c, down=d.down * c, up_bias=None if d.up_bias is None else d.up_bias * c)
        return scaled

    def expert(self, ctx: InitContext, state: FFNWeights, i: int) -> FFNWeights:
        return state
