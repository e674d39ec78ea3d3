from __future__ import annotations

from typing import Literal

from moekit.init.base import EXPERT_INITS, ExpertInitConfig, require_equal_to_dense


@EXPERT_INITS.register("ume")
class UMEInit(ExpertInitConfig):
    """UME upcycling (Upcycled MoE for speech recognition, §III-A/B): experts are copies of the
    dense FFN and the top-k weights are renormalized to sum to 1 (eq. 2), so at init
    y = Σ_i g_i FFN(x) = FFN(x): the MoE model equals the dense one exactly. Pair with the
    layer-freezing recipe (only MoE layers train, §III-C) and balance loss α = 0.01 (eq. 3)."""

    method: Literal["ume"] = "ume"

    def check(self, spec) -> None:
        require_equal_to_dense(spec, "ume", "topk_softmax")
