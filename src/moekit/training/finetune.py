"""`moekit finetune` on any engine: selective fine-tuning (moekit.selection.finetune: only the selected experts' rows
train, inside the fused expert tensors) in one process, under DDP, DeepSpeed (ZeRO-3 included), FSDP2 or expert
parallelism (moekit.training.parallel). Under ZeRO-3 the rows are not a parametrization (DeepSpeed's partitioned backward
fails to accumulate its gradient: "The size of tensor a (0) must match the size of tensor b ..." in AccumulateGrad,
transformers 5.23 / DeepSpeed 0.19.8): the selected layers' whole tensors train with the other rows' gradients zeroed
(`mask_rows`), which leaves those rows exactly as they were without weight decay (refused under ZeRO-3).

Everything but the selected rows is frozen, so the trained model is the input checkpoint with those rows replaced.
Under DDP (or one process) the in-memory model is merged and saved. Where no rank holds the model whole, the trained
rows are gathered (FSDP2 and EP: DTensor.full_tensor; ZeRO-3: deepspeed.zero.GatheredParameters) and the main
process writes them into the checkpoint it reads again: no rank gathers the frozen parameters.

Under expert parallelism each rank holds a share of every MoE layer's experts; every rank holds the same trainable
parameters (all selected rows of each layer, sharded by FSDP2 like any other), and its share of the experts reads
the rows that fall in it (`attach_local`, between transformers' expert split and its FSDP2 wrapping:
`distribute(..., between=...)`).
"""
from __future__ import annotations

import math
import random
import tempfile
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from moekit.errors import ConfigError
from moekit.selection.common import experts_of
from moekit.selection.finetune import attach, owner
from moekit.selection.selection import Selection
from moekit.training.args import use_cpu
from moekit.training.parallel import (Engine, deepspeed_config, distribute, input_requires_grad, is_main, no_zero_init,
                                   zero3_leaves)


@dataclass
class Target:
    """One selected layer's experts: the module, its stacked tensor names, the selected global ids, its experts, and
    the rows of its stacked tensors those ids hold (one per expert, DBRX's I per expert)."""

    layer: str
    experts: nn.Module
    names: list[str]
    ids: list[int]
    num_experts: int
    rows: list[int]


def targets_of(model: nn.Module, selection) -> list[Target]:
    from moekit.routing.sites import routed_ids
    from moekit.selection.finetune import _expert_tensors, expert_row_ids
    from moekit.selection.common import resolve

    return [Target(site.name, site.experts, _expert_tensors(site), ids, site.num_experts, expert_row_ids(site, ids))
            for site, selected in resolve(model, selection) if (ids := routed_ids(site, selected))]


def attach_local(targets: list[Target], ep, initial: dict) -> tuple[list[nn.Parameter], list]:
    """Expert parallelism over the mesh `ep`: make trainable the selected rows of each layer, on every rank the same
    parameters (all K selected rows, `initial[layer][tensor]`), this rank's share of the experts reading those in it
    (transformers split every stacked tensor by expert into N contiguous shares; rank r holds experts r·E/N ...
    (r+1)·E/N - 1). transformers' FSDP2 does not shard what lives in an experts module over the EP ranks, so each
    rank's copy gets the gradients of its own share's rows only: they are summed over the ranks in the backward
    (SumGradients), which gives every rank the DDP gradient, the same update and the global gradient norm."""
    from moekit.selection.finetune import attach_rows

    rank, ranks, group = ep.get_local_rank(), ep.size(), ep.get_group()
    trainable, hooks = [], []
    for t in targets:
        # every rank's experts take part in the backward of a layer with trainable rows anywhere: the all-to-all that
        # returns their tokens' gradients runs on all ranks, also where this rank's share has nothing to train
        hooks.append(t.experts.register_forward_pre_hook(input_requires_grad))
        share = t.num_experts // ranks
        take = [j for j, i in enumerate(t.ids) if rank * share <= i < (rank + 1) * share]  # rows in this share
        for name in t.names:  # this rank's share as a plain tensor, parametrized like a whole one
            t.experts._parameters[name] = nn.Parameter(t.experts._parameters[name].to_local(), requires_grad=False)
        params, h = attach_rows(t.experts, t.names, [t.ids[j] - rank * share for j in take], take, initial[t.layer],
                                lambda rows: SumGradients.apply(rows, group))
        trainable += params
        hooks += h
    return trainable, hooks


class SumGradients(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the process group (every rank calls it, in the same
    order: each runs the same layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def mask_rows(targets: list[Target]) -> None:
    """ZeRO-3: the selected layers' whole stacked expert tensors train, the gradient of every row not selected zeroed
    by a hook before DeepSpeed reduces it. AdamW moves an element only by its gradient's moments and by weight decay
    (refused under ZeRO-3: check_finetune), so those rows keep their values exactly."""
    for t in targets:
        for name in t.names:
            p = t.experts.get_parameter(name)  # (E, ...) or DBRX's (E·I, H)
            keep = torch.zeros(p.shape[0], *[1] * (p.dim() - 1), dtype=p.dtype)  # (rows, 1, ...)
            keep[t.rows] = 1
            p.requires_grad_(True)
            p.register_hook(lambda grad, keep=keep: grad * keep.to(grad.device))


def trained_rows(targets: list[Target]) -> dict[tuple[str, str], torch.Tensor]:
    """{(layer, tensor): trained rows (K, ...)} of the selected experts, gathered on every rank (FSDP2 and EP: the
    rows' shards; ZeRO-3: the whole tensor's partitions). A collective: every rank calls it, in the same order."""
    out = {}
    for t in targets:
        for name in t.names:
            module, leaf = owner(t.experts, name)
            if parametrize.is_parametrized(module, leaf):
                out[t.layer, name] = module.parametrizations[leaf].original.full_tensor().detach()
                continue
            import deepspeed

            p = getattr(module, leaf)
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[t.layer, name] = p.detach().index_select(0, torch.tensor(t.rows, device=p.device)).clone()
    return out


def finetune(model: nn.Module, selection, tokenizer, lines: list[str], engine: Engine, reload, *,
             steps: int | None, epochs: float, lr: float, batch_size: int, grad_accum: int, max_length: int,
             weight_decay: float, seed: int, device: str = "auto", deepspeed=None) -> tuple[nn.Module | None, list]:
    """Train only the selected experts of `model` on `lines` on `engine`; (the trained model on the main process,
    None elsewhere; the Trainer's log history). `reload()` reads the input checkpoint again (the main process writes
    the gathered rows into it when no rank holds the model whole); `deepspeed`: the DeepSpeed config."""
    from transformers import TrainingArguments

    from moekit.selection.common import experts_of

    config = None if deepspeed is None else deepspeed_config(deepspeed)
    if not engine.sharded:  # one process, DDP or ZeRO-1/2: every rank holds the model whole
        log = train_selected(model, selection, tokenizer, lines, steps, epochs, lr, batch_size, grad_accum, max_length,
                             weight_decay, seed, device, config)
        return (model if is_main() else None), log
    data = prepare_lines(lines, tokenizer, max_length, seed)
    if not experts_of(selection):
        raise ConfigError("the selection is empty")
    targets = targets_of(model, selection)
    model.requires_grad_(False)
    if engine.kind == "ep":
        initial = {t.layer: {n: t.experts.get_parameter(n).index_select(0, torch.tensor(t.ids)).detach().clone()
                             for n in t.names} for t in targets}  # (K, ...) each, before the experts are split
        distribute(model, engine, between=lambda m, ep: attach_local(targets, ep, initial))
    elif engine.zero == 3:
        mask_rows(targets)
        zero3_leaves(model)
    else:  # FSDP2
        attach(model, selection)
        distribute(model, engine)
    model.train()
    with tempfile.TemporaryDirectory(prefix="moekit-finetune-") as tmp:
        settings = trainer_settings(len(data), steps, epochs, lr, batch_size, grad_accum, weight_decay, seed)
        args = TrainingArguments(output_dir=tmp, use_cpu=use_cpu(device),
                                 deepspeed=config, **settings)
        trainer = selective_trainer(model, args, data, tokenizer)
        trainer.train()
        log = trainer.state.log_history
        gathered = trained_rows(targets)
        if not is_main():
            return None, log
        with no_zero_init():
            fresh = reload()
    return write_rows(fresh, targets, gathered), log

def write_rows(model: nn.Module, targets: list[Target], trained: dict) -> nn.Module:
    """`model` (the input checkpoint, read again) with the trained rows in place."""
    from moekit.selection.common import resolve

    sites = {site.name: site for site, _ in resolve(model, {t.layer: t.ids for t in targets})}
    with torch.no_grad():
        for t in targets:
            experts = sites[t.layer].experts
            for name in t.names:
                module, leaf = owner(experts, name)
                tensor = getattr(module, leaf)
                if parametrize.is_parametrized(module, leaf):
                    raise ConfigError(f"{t.layer}.{name} is parametrized in the checkpoint read again")
                tensor.index_copy_(0, torch.tensor(t.rows, device=tensor.device), trained[t.layer, name].to(tensor.dtype))
    return model.eval()


def check_finetune(engine: Engine, model: str, deepspeed, settings: dict, trust_remote_code: bool = False,
                   owned: dict[str, str] | None = None) -> None:
    """Everything about the engine that can be refused before any work: the launch (moekit.training.parallel.check_engine,
    with the model's expert counts for EP) and a DeepSpeed config (stage; batch keys that contradict the command's).; `owned`: the DeepSpeed keys the caller sets -> what sets them, named when the config contradicts one"""
    from transformers import TrainingArguments

    from moekit.training.parallel import check_deepspeed, check_engine
    from moekit.training.plan_model import model_expert_counts

    check_engine(engine, model_expert_counts(model, trust_remote_code) if engine.kind == "ep" else None)
    if engine.zero == 3 and settings["weight_decay"]:
        raise ConfigError("selective fine-tuning under DeepSpeed ZeRO-3 trains the selected layers' whole expert "
                          "tensors with the other experts' gradients zeroed, so weight decay would move the experts "
                          "not selected: it needs weight decay 0 (or FSDP2, expert parallelism, ZeRO-1/2)")
    if deepspeed is None:
        return
    config = deepspeed_config(deepspeed)
    with tempfile.TemporaryDirectory(prefix="moekit-finetune-") as tmp:
        try:
            args = TrainingArguments(output_dir=tmp, use_cpu=use_cpu(), deepspeed=config, **settings)
        except (ValueError, TypeError, ImportError, OSError) as e:
            raise ConfigError(f"the DeepSpeed config: {e}") from None
    check_deepspeed(args, owned=owned or {})


__all__ = ["check_finetune", "finetune"]


def encode_lines(lines: list[str], tokenizer, max_length: int) -> list[dict[str, list[int]]]:
    """Causal-LM examples: each non-empty line + eos, truncated to max_length; labels = input_ids."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for line in lines:
        if line.strip():
            ids = (tokenizer(line.strip(), add_special_tokens=False)["input_ids"] + eos)[:max_length]
            out.append({"input_ids": ids, "labels": list(ids)})
    return out


def prepare_lines(lines: list[str], tokenizer, max_length: int, seed: int) -> list[dict[str, list[int]]]:
    """The training examples of `lines` (encode_lines), in the order of `seed`; refuses text without a line."""
    data = encode_lines(lines, tokenizer, max_length)
    if not data:
        raise ConfigError("no training text: every line is empty")
    random.Random(seed).shuffle(data)
    return data


def trainer_settings(examples: int, steps: int | None, epochs: float, lr: float, batch_size: int, grad_accum: int,
                     weight_decay: float, seed: int) -> dict:
    """TrainingArguments of selective fine-tuning (causal LM, AdamW, linear schedule), besides where and on which
    device: `steps` optimizer steps, or `epochs` passes over `examples`; `batch_size` examples per optimizer step,
    split into `grad_accum` micro-batches (per process: a distributed launch multiplies it)."""
    total = steps or max(1, math.ceil(epochs * math.ceil(examples / batch_size)))
    return dict(max_steps=total, per_device_train_batch_size=batch_size // grad_accum,
                gradient_accumulation_steps=grad_accum, learning_rate=lr, weight_decay=weight_decay,
                lr_scheduler_type="linear", seed=seed, data_seed=seed, logging_steps=max(1, total // 10),
                save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False,
                dataloader_num_workers=0, dataloader_pin_memory=False)


def selective_trainer(model: nn.Module, args, data: list[dict], tokenizer):
    """transformers' Trainer over the selected rows, reporting progress (TrainProgress), its log not printed."""
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    from moekit.data.parallel import TranslationCollator
    from moekit.training.progress import TrainProgress

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=TranslationCollator(pad),
                      callbacks=[TrainProgress()])
    trainer.remove_callback(PrinterCallback)  # the log dicts are returned, not printed
    return trainer


def train_selected(model: nn.Module, selection: Selection | dict[str, list[int]], tokenizer, lines: list[str],
                   steps: int | None = None, epochs: float = 3.0, lr: float = 2e-5, batch_size: int = 16,
                   grad_accum: int = 1, max_length: int = 128, weight_decay: float = 0.0, seed: int = 0,
                   device: str = "auto", deepspeed: dict | None = None) -> list[dict]:
    """Train only the selected experts of `model` (in place) on plain text lines with transformers'
    Trainer (causal LM, AdamW, linear schedule), then merge. Returns the Trainer's log history. Defaults are
    RISE's (§5.1: 3 epochs, effective batch 16 = 2 × 8 accumulation steps, lr 2e-5); `steps` replaces the
    epochs; `batch_size` counts examples per optimizer step, split into `grad_accum` micro-batches. `device`:
    "cpu" keeps training on the CPU; otherwise the Trainer places the model (a CUDA device when present).
    Under a distributed launch the Trainer runs DDP (on the CPU: gloo, every process its share of the data), or
    DeepSpeed ZeRO-1/2 with `deepspeed` (a resolved config dict); moekit.training.finetune adds the engines that
    shard the model (ZeRO-3, FSDP2, expert parallelism)."""
    from transformers import TrainingArguments

    data = prepare_lines(lines, tokenizer, max_length, seed)
    if not experts_of(selection):
        raise ConfigError("the selection is empty")
    handle = attach(model, selection)
    model.train()
    try:
        with tempfile.TemporaryDirectory(prefix="moekit-finetune-") as tmp:
            args = TrainingArguments(output_dir=tmp, use_cpu=device == "cpu" or not torch.accelerator.is_available(),
                                     deepspeed=deepspeed, **trainer_settings(len(data), steps, epochs, lr, batch_size,
                                                                             grad_accum, weight_decay, seed))
            trainer = selective_trainer(model, args, data, tokenizer)
            trainer.train()
            return trainer.state.log_history
    finally:
        handle.merge()
        model.eval()
