from __future__ import annotations

from typing import ClassVar, Literal

from moekit.moe.ffn import FFNWeights
from moekit.init.base import EXPERT_INITS, ExpertInitConfig, InitContext, require_equal_to_dense


@EXPERT_INITS.register("scaled_copy")
class ScaledCopyInit(ExpertInitConfig):
    """Weight scaling for upcycled experts (He et al. 2024, "Upcycling Large Language Models into Mixture of
    Experts", arXiv:2410.07524, §3; Megatron-Core `upcycling_utils._get_moe_activation_scale`): every expert
    copies the dense FFN with its output scaled by s, so that the MoE equals the dense model at init.

    Granularity G = 1, softmax-then-top-k without renormalization (the default): a uniform (zero) router gives
    every expert p = 1/E, the k kept weights sum to k/E, so y = (k/E)·s·FFN(x) and s = E/k.

    Granularity G > 1 (MoESpec.granularity): expert e·G + g is shard g of copy e (FFNWeights.shard) and the router
    keeps K = k·G of the E·G experts. Its rows are drawn once per copy and repeated over the copy's G shards
    (virtual groups, moekit.moe.build.init_router), so a copy's shards tie: the top-K experts are all G shards of
    k copies, and renormalized weights (topk_softmax) give the shards of copy e one weight w_e with
    Σ_e G·w_e = 1. Then y = Σ_e w_e Σ_g s·FFN_g(x) = Σ_e w_e·s·FFN(x) = (s/G)·FFN(x), so s = G for any such
    router (Megatron's factor without pre-softmax). Megatron's pre-softmax factor E·G²/K (= E·G/k) would need a
    uniform router, whose ties torch.topk breaks in no specified order, so nothing would give each shard to a
    token equally often: G > 1 requires topk_softmax and a drawn router, the defaults there.

    `distribute="down"` puts all of s on the down projection, exact for every activation; the down bias b
    becomes (s/G)·b in each shard (b itself for G > 1: the G shards of a copy add up to s·b). `distribute=
    "megatron"` spreads s as Megatron does (s^(1/3) on gate, up and down for gated FFNs, s^(1/2) on fc1 and fc2
    otherwise, the down bias unscaled in every shard); exact only for homogeneous activations (ReLU², ReLU).
    """

    method: Literal["scaled_copy"] = "scaled_copy"
    distribute: Literal["down", "megatron"] = "down"
    granular: ClassVar[bool] = True

    def scoring_default(self, spec) -> str:
        return "softmax_topk" if spec.granularity == 1 else "topk_softmax"

    def router_init_default(self, spec) -> str:
        return "zeros" if spec.granularity == 1 else "normal"

    def check(self, spec) -> None:
        G = spec.granularity
        require_equal_to_dense(spec, "scaled_copy" if G == 1 else f"scaled_copy with granularity {G}",
                               self.scoring_default(spec))
        if G > 1 and spec.router_init == "zeros":
            raise ValueError("scaled_copy with granularity > 1 needs a drawn router (router.init=normal): a zero "
                             "router ties every expert, and ties need not give a token all shards of a copy")

    @staticmethod
    def scale(spec) -> float:
        """s = E/k (G = 1, softmax_topk) or G (G > 1, topk_softmax); see the class docstring."""
        return spec.num_experts / spec.top_k if spec.granularity == 1 else float(spec.granularity)

    def prepare(self, ctx: InitContext) -> list[FFNWeights]:
        """The G shards of the scaled copy every expert is."""
        s, G, d = self.scale(ctx.spec), ctx.spec.granularity, ctx.dense
        if self.distribute == "down":  # y_i = s·W_down h + (s/G)·b_down per shard: exact
            scaled = d.clone(down=d.down * s, down_bias=None if d.down_bias is None else d.down_bias * (s / G))
        elif d.gated:
            c = s ** (1 / 3)
            scaled = d.clone(gate=d.gate * c, up=d.up * c, down=d.down * c)
        else:  # Megatron scales fc1 (weight and bias) and fc2's weight, not fc2's bias
            c = s ** (1 / 2)
            scaled = d.clone(up=d.up * c, down=d.down * c, up_bias=None if d.up_bias is None else d.up_bias * c)
        return [scaled.shard(g, G) for g in range(G)]

    def expert(self, ctx: InitContext, state: list[FFNWeights], i: int) -> FFNWeights:
        return state[i % len(state)]
