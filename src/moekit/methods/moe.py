"""Upcycle the dense model into an MoE (any init in moekit.init: naive, noise, drop, BTX, UME, SPRI, …) and
train it with the router auxiliary losses; freeze schedules (SPRI §2.4 two-stage, UME §III-C) apply."""
from __future__ import annotations

import torch
from torch import nn

from moekit.methods.base import METHODS, CheckpointFormat, TrainingMethod
from moekit.moe.layer import moe_layers


@METHODS.register("moe")
class MoE(TrainingMethod):
    name = "moe"
    section = "moe"
    tasks = frozenset({"translation", "instruct", "text", "asr", "speech_llm"})
    freezes = True

    def adapt(self, recipe, model: nn.Module, tokenizer=None) -> nn.Module:
        from moekit.assets import resolve_model
        from moekit.checkpoint.dense import load_dense
        from moekit.upcycling import upcycle

        m = recipe.model
        branches = [load_dense(resolve_model(b), m.allow_pickle, m.trust_remote_code, model.dtype)
                    for b in recipe.moe.init.source_models()]  # btx, sources: the FFNs' models
        return upcycle(model, recipe.moe, branches or None, tokenizer=tokenizer)

    def callbacks(self, recipe, model: nn.Module) -> list:
        from moekit.methods.freeze import FreezeCallback

        f = recipe.freeze
        return [FreezeCallback(model, f)] if f.schedule != "none" or f.frozen else []

    def fsdp_units(self, model: nn.Module) -> list[str]:
        """A router several MoE layers share (Omni-router) is one FSDP2 unit of its own: a parameter belongs to one
        unit, and the decoder layers that call it are several."""
        owners: dict[int, list[str]] = {}
        for path, layer in moe_layers(model):
            owners.setdefault(id(layer.router), []).append(f"{path}.router")
        return [paths[0] for paths in owners.values() if len(paths) > 1]

    def find_unused_parameters(self, recipe) -> bool:
        return recipe.freeze.schedule != "none" or bool(recipe.freeze.frozen)

    def extra_loss(self, trainer, model: nn.Module, mask: torch.Tensor | None) -> torch.Tensor | None:
        """λ_lb·LB + λ_z·Z, each summed or averaged over the MoE layers (aux.layer_reduction), padding
        excluded; logged per layer with usage entropy and max load fraction."""
        from moekit.losses import load_balance, z_loss
        from moekit.eval.usage import routing_stats

        layers, aux, logs = moe_layers(model), trainer.aux, trainer.aux_logs
        if not layers:
            return None
        lbs, zs = [], []
        for path, moe in layers:
            info = moe.last_routing
            m = mask.reshape(-1) if mask is not None and mask.numel() == info.logits.shape[0] else None
            lbs.append(load_balance(info, m, aux.balance_variant))
            zs.append(z_loss(info, m))
            for k, v in {"lb": lbs[-1].item(), "z": zs[-1].item(), **routing_stats(info, m)}.items():
                logs[f"moe/{path}/{k}"].append(v)
        reduce = torch.sum if aux.layer_reduction == "sum" else torch.mean
        lb, z = reduce(torch.stack(lbs)), reduce(torch.stack(zs))
        logs["moe/lb"].append(lb.item())
        logs["moe/z"].append(z.item())
        return aux.load_balance * lb + aux.z_loss * z

    def checkpoint_format(self) -> CheckpointFormat:
        from moekit.checkpoint.format import read_meta, write_checkpoint

        return CheckpointFormat("moekit.json", write_checkpoint, read_meta)
