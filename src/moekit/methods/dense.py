"""Full fine-tuning of the dense model: the baseline of every paper here (SPRI Table 2 "Dense", SIMoE
"full FT", Omni-router "Dense", UME "FMFT")."""
from __future__ import annotations

from moekit.methods.base import METHODS, TrainingMethod


@METHODS.register("dense")
class Dense(TrainingMethod):
    name = "dense"
    tasks = frozenset({"translation", "instruct", "text", "asr"})
