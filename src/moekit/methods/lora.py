"""LoRA on the dense model (peft; Hu et al. 2022), the parameter-efficient baseline; saves the adapter."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from moekit.methods.base import METHODS, TrainingMethod


@METHODS.register("lora")
class LoRA(TrainingMethod):
    name = "lora"
    section = "lora"

    def adapt(self, recipe, model: nn.Module, tokenizer=None) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        from moekit.methods.base import seeded

        lc = recipe.lora
        with seeded(recipe.train.seed):  # the A matrices' init
            return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                    target_modules=lc.target_modules, task_type="CAUSAL_LM"))

    def find_unused_parameters(self, recipe) -> bool:
        return True

    def load_trained(self, recipe, folder: Path) -> nn.Module:
        from peft import PeftModel

        from moekit.assets import resolve_model
        from moekit.methods.base import load_base

        return PeftModel.from_pretrained(load_base(recipe, resolve_model(recipe.model.path)), folder).eval()
