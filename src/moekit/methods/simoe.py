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
        from moekit.methods.base import seeded
        from moekit.simoe.model import simoe_upcycle

        with seeded(recipe.train.seed):  # the router MLP's init
            return simoe_upcycle(model, recipe.simoe)

    def callbacks(self, recipe, model: nn.Module) -> list:
        from moekit.simoe.objective import DualCallback

        return [DualCallback(model)]

    def zero3_units(self, model: nn.Module) -> list[nn.Module]:
        """Every interpolated layer (its norm variant calls its base module with substituted weights, functional_call,
        which ZeRO-3's per-module hooks would try to gather) and the instance router (called from the model's forward
        pre-hook, before DeepSpeed's own hooks on the model start the step)."""
        from moekit.simoe.model import si_modules

        return [*(m for _, m in si_modules(model)), model.simoe.router]

    def fsdp_units(self, model: nn.Module) -> list[str]:
        """The instance router, called from the model's forward pre-hook, outside every decoder layer."""
        return ["simoe.router"]

    def optimizer(self, recipe, model: nn.Module) -> torch.optim.Optimizer:
        from moekit.simoe.objective import param_groups

        return torch.optim.AdamW(param_groups(model, recipe.optim.lr, recipe.optim.weight_decay))

    def extra_loss(self, trainer, model: nn.Module, mask: torch.Tensor | None) -> torch.Tensor:
        from moekit.methods.base import gathered
        from moekit.simoe.model import si_modules
        from moekit.simoe.objective import penalty

        per_param = model.simoe.cfg.sparsity == "params"  # L0 weighted by δ's rows: δ's shape is read too
        names = ("log_alpha", "delta") if per_param else ("log_alpha",)
        with gathered((m, n) for _, m in si_modules(model) for n in names):
            loss, logs = penalty(model)  # reads the masks outside the layers' forward
        for k, v in logs.items():
            trainer.aux_logs[k].append(v)
        return loss

    def checkpoint_format(self) -> CheckpointFormat:
        from moekit.simoe.export import read_meta, write_checkpoint

        return CheckpointFormat("simoe.json", write_checkpoint, read_meta)
