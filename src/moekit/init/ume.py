from __future__ import annotations

from typing import Literal

from moekit.init.base import EXPERT_INITS, ExpertInitConfig, require_equal_to_dense


@EXPERT_INITS.register("ume")
class UMEInit(ExpertInitConfig):
    """UME upcycling (Upcycled MoE for speech recognition, §III-A/B): experts are copies of the
    dense FFN and the top-k weights are renormalized to sum to 1 (W_k = Softmax(TopK(Linear(h))), §III-B,
    unnumbered), so at init h_o = (Σ_n W_k,n) ∘ FFN(h) = FFN(h) (eq. 1): the MoE model equals the dense one
    (exactly in exact arithmetic; to float rounding of the sum over experts in practice). Pair with the
    layer-freezing recipe (only MoE layers train, §III-C) and the balance loss (eq. 2) added with α = 0.01
    (eq. 3)."""

    method: Literal["ume"] = "ume"

    def check(self, spec) -> None:
        require_equal_to_dense(spec, "ume", "topk_softmax")
