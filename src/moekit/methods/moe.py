"""Upcycle the dense model into an MoE (any init in moekit.init: naive, noise, drop, BTX, UME, SPRI, …) and
train it with the router auxiliary losses; freeze schedules (SPRI §2.4 two-stage, UME §III-C) apply."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moekit.errors import ConfigError
from moekit.methods.base import METHODS, CheckpointFormat, TrainingMethod
from moekit.moe.layer import moe_layers


@METHODS.register("moe")
class MoE(TrainingMethod):
    name = "moe"
    section = "moe"
    tasks = frozenset({"translation", "instruct", "text", "asr", "speech_llm"})
    keeps_frozen = True
    freezes = True

    def adapt(self, recipe, model: nn.Module, tokenizer=None) -> nn.Module:
        from moekit.assets import resolve_model
        from moekit.checkpoint.dense import load_dense
        from moekit.checkpoint.upcycle_model import upcycle

        if moe_layers(model):  # model.path held the recipe's upcycled checkpoint (`prepared`)
            return model
        m = recipe.model
        branches = [load_dense(resolve_model(b), m.allow_pickle, m.trust_remote_code, model.dtype)
                    for b in recipe.moe.init.source_models()]  # btx, sources: the FFNs' models
        return upcycle(model, recipe.moe, branches or None, tokenizer=tokenizer)

    def prepared(self, recipe, folder: Path) -> bool:
        """Whether `folder` is a moekit checkpoint upcycled with the recipe's MoE spec (`moekit upcycle`, or a
        checkpoint of an earlier run), which then trains without upcycling again: the freeze schedule and aux losses
        apply as to the model the recipe upcycles itself. A spec that differs in any field (its moekit.json against
        the recipe's `moe` section, both with their defaults) is refused naming the first field that differs, as is
        an upcycled checkpoint in a native MoE format (no moekit MoE layers to train)."""
        from moekit.checkpoint.format import read_meta
        from moekit.config import validate
        from moekit.moe.spec import MoESpec

        if (folder / "moekit_spec.json").is_file():
            raise ConfigError(f"{folder} is an upcycled checkpoint in a native MoE format (moekit_spec.json); "
                              "method=moe trains a dense model or its upcycled checkpoint in moekit's format")
        if not (folder / "moekit.json").is_file():
            return False
        recorded = read_meta(folder)["spec"]
        if recorded is None:
            raise ConfigError(f"{folder}/moekit.json records no MoE spec to compare with the recipe's moe section")
        theirs = validate(MoESpec, recorded, source=f"MoE spec in {folder}/moekit.json").model_dump(mode="json")
        differs = first_difference(recipe.moe.model_dump(mode="json"), theirs)
        if differs is not None:
            key, ours, stored = differs
            raise ConfigError(f"{folder} was upcycled with moe.{key}={stored!r} (its moekit.json), the recipe has "
                              f"moe.{key}={ours!r}: give the recipe the checkpoint's spec, or start from the dense model")
        return True

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
        excluded; logged per layer with usage entropy and max load fraction, as device tensors (no host sync in
        the step: the Trainer's log reads them back, `moekit.training.trainer.means`). All layers' statistics come
        from one `layer_stats` call: a fixed number of device ops per step, not a number per layer. Only the layers
        that ran in this forward count (ran_in_last_forward: LayerDrop skips some)."""
        from moekit.moe.losses import layer_stats

        layers, aux, logs = ran_in_last_forward(model), trainer.aux, trainer.aux_logs
        if not layers:
            return None
        stats = layer_stats([moe.last_routing for _, moe in layers], mask, aux.balance_variant)  # each (L,)
        for i, (path, _) in enumerate(layers):
            for k, v in stats.items():
                logs[f"moe/{path}/{k}"].append(v[i].detach())
        reduce = torch.sum if aux.layer_reduction == "sum" else torch.mean
        lb, z = reduce(stats["lb"]), reduce(stats["z"])
        logs["moe/lb"].append(lb.detach())
        logs["moe/z"].append(z.detach())
        return aux.load_balance * lb + aux.z_loss * z

    def checkpoint_format(self) -> CheckpointFormat:
        from moekit.checkpoint.format import read_meta, write_checkpoint

        return CheckpointFormat("moekit.json", write_checkpoint, read_meta)


def first_difference(ours: dict, theirs: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """(dotted key, our value, their value) of the first field where two nested dicts differ, in `ours`' order."""
    for key in {**ours, **theirs}:
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, f"{prefix}{key}.")
            if found is not None:
                return found
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def _clear_routing(model: nn.Module, args) -> None:
    for _, moe in moe_layers(model):
        moe.last_routing = None


def track_routing(model: nn.Module) -> None:
    """From the model's next forward on, each forward begins by clearing every MoE layer's routing (a forward
    pre-hook, registered once), so that after it only the layers that ran hold one (ran_in_last_forward)."""
    if not getattr(model, "_moekit_clears_routing", False):
        model.register_forward_pre_hook(_clear_routing)
        model._moekit_clears_routing = True


def ran_in_last_forward(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers (path, layer) that ran in the model's last forward. A layer that LayerDrop skipped in training
    (wav2vec 2.0's and HuBERT's `layerdrop`, Whisper's `encoder_layerdrop`) must not add the routing of an earlier
    forward, whose graph is gone. MoETrainer and MoECallback track the model's forwards from the start
    (track_routing); a first call tracks them from then on."""
    track_routing(model)
    return [(path, moe) for path, moe in moe_layers(model) if moe.last_routing is not None]
