"""`moekit finetune` on any engine: selective fine-tuning (moekit.select.finetune: only the selected experts' rows
train, inside the fused expert tensors) in one process, under DDP, DeepSpeed (ZeRO-3 included), FSDP2 or expert
parallelism (moekit.train.parallel).

Everything but the selected rows is frozen, so the trained model is the input checkpoint with those rows replaced.
Under DDP (or one process) the in-memory model is merged and saved. Where no rank holds the model whole, the trained
rows are gathered (ZeRO-3: deepspeed.zero.GatheredParameters; FSDP2: DTensor.full_tensor; EP: each rank's share of
the experts, rows in place, as a DTensor sharded by expert, made full) and the main process writes them into the
checkpoint it reads again: no rank gathers the frozen parameters.

Under expert parallelism each rank holds a share of every MoE layer's experts, so each rank makes the selected rows
of its own share trainable (wherever the selection puts them; a rank whose share has none trains no rows of that
layer), between transformers' expert sharding and its FSDP2 wrapping (`distribute(..., between=...)`).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from moekit.errors import ConfigError
from moekit.train.args import has_accelerator
from moekit.train.parallel import (Engine, deepspeed_config, distribute, is_main, no_zero_init, zero3_leaves)


@dataclass
class Target:
    """One selected layer's experts: the module, its stacked tensor names, the selected global ids, its experts."""

    layer: str
    experts: nn.Module
    names: list[str]
    ids: list[int]
    num_experts: int


def targets_of(model: nn.Module, selection) -> list[Target]:
    from moekit.select.finetune import _expert_tensors
    from moekit.select.common import resolve

    return [Target(site.name, site.experts, _expert_tensors(site), sorted(ids), site.num_experts)
            for site, ids in resolve(model, selection) if ids]


def attach_local(targets: list[Target], rank: int, ranks: int) -> tuple[list[nn.Parameter], list]:
    """Expert parallelism: make trainable the selected rows of this rank's share of each layer's experts (transformers
    split every stacked tensor by expert into `ranks` contiguous shares; rank r holds experts r·E/N ... (r+1)·E/N - 1)."""
    from moekit.select.finetune import attach_rows

    trainable, hooks = [], []
    for t in targets:
        share = t.num_experts // ranks
        local = [i - rank * share for i in t.ids if rank * share <= i < (rank + 1) * share]
        if not local:
            continue
        for name in t.names:  # this rank's share as a plain tensor, parametrized like a whole one
            t.experts._parameters[name] = nn.Parameter(t.experts._parameters[name].to_local(), requires_grad=False)
        params, h = attach_rows(t.experts, t.names, local)
        trainable += params
        hooks += h
    return trainable, hooks


def _full(p: torch.Tensor) -> torch.Tensor:
    """A (sharded) parameter's full value; collective for a DTensor (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def trained_rows(targets: list[Target]) -> dict[tuple[str, str], torch.Tensor]:
    """{(layer, tensor): trained rows (K, ...)} of the selected experts, gathered on every rank (ZeRO-3 partitions,
    FSDP2 shards). A collective: every rank calls it, in the same order."""
    out = {}
    for t in targets:
        for name in t.names:
            p = t.experts.parametrizations[name].original
            if hasattr(p, "ds_id"):
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    out[t.layer, name] = p.detach().clone()
            else:
                out[t.layer, name] = _full(p)
    return out


def trained_experts(targets: list[Target], mesh) -> dict[tuple[str, str], torch.Tensor]:
    """Expert parallelism: {(layer, tensor): every expert (E, ...), trained rows in place}: each rank's share (its
    rows in place) as a DTensor sharded by expert over the EP mesh, made full. A collective, in the same order."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for t in targets:
        plists = getattr(t.experts, "parametrizations", {})
        for name in t.names:
            if name in plists:
                rows = plists[name][0]
                share = rows.base.index_copy(0, rows.ids, _full(plists[name].original))
            else:
                share = t.experts._parameters[name].to_local().detach()
            out[t.layer, name] = DTensor.from_local(share, mesh, [Shard(0)], run_check=False).full_tensor()
    return out


def finetune(model: nn.Module, selection, tokenizer, lines: list[str], engine: Engine, reload, *,
             steps: int | None, epochs: float, lr: float, batch_size: int, grad_accum: int, max_length: int,
             weight_decay: float, seed: int, device: str = "auto", deepspeed=None) -> tuple[nn.Module | None, list]:
    """Train only the selected experts of `model` on `lines` on `engine`; (the trained model on the main process,
    None elsewhere; the Trainer's log history). `reload()` reads the input checkpoint again (the main process writes
    the gathered rows into it when no rank holds the model whole); `deepspeed`: the DeepSpeed config."""
    from transformers import TrainingArguments

    from moekit.select.common import experts_of
    from moekit.select.finetune import attach, prepare_lines, selective_trainer, trainer_settings

    data = prepare_lines(lines, tokenizer, max_length, seed)
    if not experts_of(selection):
        raise ConfigError("the selection is empty")
    targets = targets_of(model, selection)
    handle, mesh = None, None
    if engine.kind == "ep":
        model.requires_grad_(False)
        meshes = distribute(model, engine, between=lambda m, ep: attach_local(targets, ep.get_local_rank(), ep.size()))
        mesh = meshes.get_mesh("ep")
    else:
        handle = attach(model, selection)
        if engine.kind == "fsdp":
            distribute(model, engine)
        elif engine.zero == 3:
            zero3_leaves(model)
    model.train()
    with tempfile.TemporaryDirectory(prefix="moekit-finetune-") as tmp:
        settings = trainer_settings(len(data), steps, epochs, lr, batch_size, grad_accum, weight_decay, seed)
        args = TrainingArguments(output_dir=tmp, use_cpu=device == "cpu" or not has_accelerator(),
                                 deepspeed=None if deepspeed is None else deepspeed_config(deepspeed), **settings)
        trainer = selective_trainer(model, args, data, tokenizer)
        trainer.train()
        log = trainer.state.log_history
        if not engine.sharded:
            handle.merge()
            return (model.eval() if is_main() else None), log
        gathered = trained_experts(targets, mesh) if engine.kind == "ep" else trained_rows(targets)
        if not is_main():
            return None, log
        with no_zero_init():
            fresh = reload()
    return write_rows(fresh, targets, gathered, whole=engine.kind == "ep"), log


def write_rows(model: nn.Module, targets: list[Target], trained: dict, whole: bool) -> nn.Module:
    """`model` (the input checkpoint, read again) with the trained rows (or, `whole`, every expert) in place."""
    from moekit.select.common import resolve

    sites = {site.name: site for site, _ in resolve(model, {t.layer: t.ids for t in targets})}
    with torch.no_grad():
        for t in targets:
            experts = sites[t.layer].experts
            for name in t.names:
                tensor = getattr(experts, name)
                if parametrize.is_parametrized(experts, name):
                    raise ConfigError(f"{t.layer}.{name} is parametrized in the checkpoint read again")
                values = trained[t.layer, name].to(tensor.dtype)
                if whole:
                    tensor.copy_(values)
                else:
                    tensor.index_copy_(0, torch.tensor(t.ids, device=tensor.device), values)
    return model.eval()


def check_finetune(engine: Engine, model: str, deepspeed, settings: dict, trust_remote_code: bool = False) -> None:
    """Everything about the engine that can be refused before any work: the launch (moekit.train.parallel.check_engine,
    with the model's expert counts for EP) and a DeepSpeed config (stage; batch keys that contradict the command's)."""
    from transformers import TrainingArguments

    from moekit.train.parallel import FINETUNE_OWNED, check_deepspeed, check_engine
    from moekit.train.plan_model import model_expert_counts

    check_engine(engine, model_expert_counts(model, trust_remote_code) if engine.kind == "ep" else None)
    if deepspeed is None:
        return
    config = deepspeed_config(deepspeed)
    with tempfile.TemporaryDirectory(prefix="moekit-finetune-") as tmp:
        try:
            args = TrainingArguments(output_dir=tmp, use_cpu=not has_accelerator(), deepspeed=config, **settings)
        except (ValueError, TypeError, ImportError, OSError) as e:
            raise ConfigError(f"--deepspeed: {e}") from None
    check_deepspeed(args, owned=FINETUNE_OWNED)


__all__ = ["check_finetune", "finetune"]
