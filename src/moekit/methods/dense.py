"""Full fine-tuning of the dense model: the baseline of every paper here (SPRI Table 2 "Dense", SIMoE
"full FT", Omni-router "Dense", UME "FMFT")."""
from __future__ import annotations

from moekit.methods.base import METHODS, TrainingMethod


@METHODS.register("dense")
class Dense(TrainingMethod):
    name = "dense"
    tasks = frozenset({"translation", "instruct", "text", "asr", "speech_llm"})
    keeps_frozen = True

    def callbacks(self, recipe, model):
        """Parameters under freeze.frozen (a speech-LLM's audio encoder and adapter) never train."""
        from moekit.methods.freeze import FreezeCallback

        return [FreezeCallback(model, recipe.freeze)] if recipe.freeze.frozen else []

    def find_unused_parameters(self, recipe) -> bool:
        return bool(recipe.freeze.frozen)
