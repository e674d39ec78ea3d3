"""SIMoE (Chen et al. 2025): sparse interpolated experts on every linear layer, trained with the
orthogonality penalty and the Lagrangian sparsity constraint (moekit.simoe.objective, eqs. 3 and 10-13);
the masks' log α in their own AdamW group and λ's ascent step after each optimizer step."""
from __future__ import annotations

import torch
from torch import nn

from moekit.methods.base import METHODS, CheckpointFormat, TrainingMethod


@METHODS.register("simoe")
class SIMoEMethod(TrainingMethod):
    name = "simoe"
    section = "simoe"

    def adapt(self, recipe, model: nn.Module, tokenizer=None) -> nn.Module:
        from moekit.simoe.model import simoe_upcycle

        return simoe_upcycle(model, recipe.simoe)

    def callbacks(self, recipe, model: nn.Module) -> list:
        from moekit.simoe.objective import DualCallback

        return [DualCallback(model)]

    def optimizer(self, recipe, model: nn.Module) -> torch.optim.Optimizer:
        from moekit.simoe.objective import param_groups

        return torch.optim.AdamW(param_groups(model, recipe.optim.lr, recipe.optim.weight_decay))

    def extra_loss(self, trainer, model: nn.Module, mask: torch.Tensor | None) -> torch.Tensor:
        from moekit.simoe.objective import penalty

        loss, logs = penalty(model)
        for k, v in logs.items():
            trainer.aux_logs[k].append(v)
        return loss

    def checkpoint_format(self) -> CheckpointFormat:
        from moekit.simoe.export import read_meta, write_checkpoint

        return CheckpointFormat("simoe.json", write_checkpoint, read_meta)
