"""The memory plan of a training run, before any work (`moekit train|finetune --dry-run`): the model the run would
train is built on PyTorch's meta device from config.json (an upcycle from the recipe's MoE spec, LoRA, SIMoE, or a
selection's K trainable rows per layer), its shapes checked against the safetensors headers where the weights are
present, and no tensor data is read. What trains in each freeze stage, what the optimizer keeps, the activations of a
micro-batch and the per-device bytes under each engine follow from it (moekit.training.memory: the arithmetic and each
engine's convention)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moekit.errors import ConfigError
from moekit.training.memory import ACTIVATION_TOLERANCE, Counts, Geometry, Share, recast, shares, token_bytes
from moekit.training.plan_model import (geometry, largest_layer, linear_params, routed_names, stages_of, trains_now,
                                     unique_params)

Predicate = Callable[[str], bool]


@dataclass(frozen=True)
class Stage:
    name: str
    params: int  # trainable elements in this stage
    bytes: int


@dataclass
class Plan:
    """What a run holds; `shares` per device under each engine. Sizes in bytes, counts in elements."""

    title: str
    model: str  # the directory whose config (and headers) were read
    shapes: str  # where the shapes came from
    dtype: str  # of the parameters as trained
    precision: str
    params: int
    param_bytes: int  # resident on one device (finetune: with the selected rows' trainable copies)
    trainable: int  # the largest stage's
    trainable_bytes: int
    grad_bytes: int
    optimizer_bytes: int  # torch AdamW on one device, over every parameter that trains in some stage
    frozen_bytes: int  # parameters that never train, resident all the same
    routed: int  # routed-expert elements (what expert parallelism splits; a selection's full tensors included)
    stages: list[Stage]
    micro_batch: int  # examples per device and micro-batch
    max_length: int
    gradient_checkpointing: bool
    activations_per_1k: int | None  # estimated bytes per 1,000 tokens (None: not estimated for this model)
    activations: int | None  # per micro-batch (micro_batch × max_length tokens, every example at max_length)
    devices: int
    expert_parallel: int | None
    shares: list[Share]  # every engine with its weights and AdamW state in the parameters' stored dtype
    other_dtype: str  # the same engines with every weight and state in this dtype instead
    other_shares: list[Share]
    notes: list[str] = field(default_factory=list)
    geometry: Geometry | None = None  # what the activation estimate saw

    @property
    def peak_stage(self) -> Stage:
        return max(self.stages, key=lambda s: s.params)


def check_devices(devices: int, expert_parallel: int | None, experts: list[int]) -> tuple[int | None, str]:
    """(expert-parallel ranks or None, why there is no EP row). An explicit `expert_parallel` that cannot apply is
    an error; by default EP spans all devices where that divides every MoE layer's experts."""
    if devices < 1:
        raise ConfigError(f"devices must be a positive count, got {devices}")
    if expert_parallel is not None:
        ep = f"expert parallelism over {expert_parallel} ranks"
        if expert_parallel < 1 or expert_parallel > devices or devices % expert_parallel:
            raise ConfigError(f"{ep} needs a device count it divides (EP ranks × data-parallel replicas = devices); "
                              f"{devices} devices given")
        if not experts:
            raise ConfigError(f"{ep} needs MoE layers; this model has none")
        bad = sorted({e for e in experts if e % expert_parallel})
        if bad:
            raise ConfigError(f"{ep} must divide every MoE layer's expert count; this model's layers have "
                              f"{', '.join(map(str, bad))} experts")
        return expert_parallel, ""
    if not experts:
        return None, "no MoE layer"
    if any(e % devices for e in experts):
        return None, f"{devices} devices do not divide {sorted(set(experts))} experts (give expert_parallel)"
    return devices, ""


def counts_of(model: nn.Module, stages: list[tuple[str, Predicate]],
              extra: list[torch.Tensor] = ()) -> tuple[Counts, list[Stage]]:
    """Counts (moekit.training.memory) at the largest stage; `extra`: resident tensors that are no parameters (the full
    expert tensors behind a selection's trainable rows: buffers, which ZeRO-3 and FSDP2 do not shard)."""
    params = unique_params(model)
    routed = routed_names(model)
    made = [(name, [(n, p) for n, p in params if trains_now(p, n, trains)]) for name, trains in stages]
    union = {n: p for _, group in made for n, p in group}
    peak = max(made, key=lambda m: sum(p.numel() for _, p in m[1]))[1]

    def total(items, attr):
        return sum(p.numel() * (p.element_size() if attr else 1) for _, p in items)

    def routed_of(items):
        return [(n, p) for n, p in items if n in routed]

    resident, kept = [*params, *(("", t) for t in extra)], [("", t) for t in extra]
    c = Counts(params=total(resident, False), param_bytes=total(resident, True),
               replicated=total(kept, False), replicated_bytes=total(kept, True),
               trainable=total(peak, False), trainable_bytes=total(peak, True),
               state=total(union.items(), False), state_bytes=total(union.items(), True), state_tensors=len(union),
               routed=total(routed_of(params), False), routed_bytes=total(routed_of(params), True),
               routed_trainable=total(routed_of(peak), False), routed_trainable_bytes=total(routed_of(peak), True),
               routed_state=total(routed_of(union.items()), False),
               routed_state_bytes=total(routed_of(union.items()), True),
               routed_state_tensors=len(routed_of(union.items())),
               layer_params=largest_layer(model), linear_params=linear_params(model),
               materialized_bytes=total(kept, True))
    return c, [Stage(name, total(group, False), total(group, True)) for name, group in made]


@dataclass(frozen=True)
class Setting:
    """How the run trains: what `plan` needs besides the model."""

    title: str
    precision: str  # fp32 | bf16 | fp16
    micro_batch: int
    max_length: int
    gradient_checkpointing: bool = False
    aux_losses: bool = True
    lora_dropout: bool = True
    devices: int = 8
    expert_parallel: int | None = None


def plan(model: nn.Module, folder: Path, shapes: str, stages: list[tuple[str, Predicate]], s: Setting,
         extra: list[torch.Tensor] = (), notes: list[str] = ()) -> Plan:
    """The Plan of training `model` (on the meta device) in `stages` [(name, trains(param name))]."""
    from moekit.routing.sites import moe_sites

    c, staged = counts_of(model, stages, extra)
    experts = [site.num_experts for site in moe_sites(model)]
    ep, why = check_devices(s.devices, s.expert_parallel, experts)
    dtype = next((p.dtype for _, p in unique_params(model)), torch.float32)
    p_size = dtype.itemsize
    other = torch.bfloat16 if p_size == 4 else torch.float32
    peak = max(stages, key=lambda st: sum(x.params for x in staged if x.name == st[0]))[1]
    geo = geometry(model, peak, s.aux_losses, s.lora_dropout)
    per_token, rows = _table(c, geo, s, ep, why, p_size, p_size)
    _, other_rows = _table(c, geo, s, ep, why, other.itemsize, p_size)
    acts = None if per_token is None else per_token * s.micro_batch * s.max_length
    frozen = c.param_bytes - c.state_bytes
    more = [*notes, *([] if geo is None else geo.notes)]
    if geo is None:
        more.append("activations: not estimated for this architecture (the per-device totals leave them out)")
    return Plan(s.title, str(folder), shapes, str(dtype).removeprefix("torch."), s.precision, c.params,
                c.param_bytes, c.trainable, c.trainable_bytes, c.grad_bytes, c.optimizer_bytes, frozen,
                c.routed + c.replicated,
                staged, s.micro_batch, s.max_length, s.gradient_checkpointing,
                None if per_token is None else per_token * 1000, acts, s.devices, ep, rows,
                str(other).removeprefix("torch."), other_rows, more, geo)


def _table(c: Counts, geo: Geometry | None, s: Setting, ep: int | None, why: str, size: int,
           stored: int) -> tuple[int | None, list[Share]]:
    """(activation bytes per token, the engines' rows) with every weight, gradient and AdamW state in `size` bytes
    per element (the counts `c` are in `stored` bytes). DeepSpeed computes on its parameters cast to 2 bytes under
    bf16/fp16: its activations are those of 2-byte parameters."""
    mixed = s.precision in ("bf16", "fp16")

    def per_token(p: int) -> int | None:
        return None if geo is None else token_bytes(geo, 2 if mixed or p == 2 else 4, p, s.gradient_checkpointing)

    tokens = s.micro_batch * s.max_length
    own, cast = per_token(size), per_token(2 if mixed else size)
    counts = c if size == stored else recast(c, size, stored)
    return own, shares(counts, (own or 0) * tokens, s.devices, ep, mixed, size, why, (cast or 0) * tokens)


# ---------------------------------------------------------------------------------------------- recipes


def plan_recipe(recipe, devices: int = 8, expert_parallel: int | None = None, log=None) -> Plan:
    """The plan of `moekit train RECIPE`: the recipe's method applied to its base model on the meta device."""
    from moekit.training.plan_model import recipe_model

    if devices < 1:
        raise ConfigError(f"devices must be a positive count, got {devices}")
    model, folder, shapes = recipe_model(recipe, log)
    t, length, task_notes = recipe.train, _max_length(recipe), []
    if recipe.task == "speech_llm":  # the audio modules, and a sequence length from the processor
        from moekit.training.speech_llm import plan_setting

        recipe, length, task_notes = plan_setting(recipe, model, folder)
    stages = stages_of(recipe, model)
    init = f", {recipe.moe.init.method} init" if getattr(recipe, "moe", None) is not None else ""
    setting = Setting(f"moekit train {recipe.name}: {recipe.task}, method {recipe.method}{init}, "
                      f"{recipe.model.path if recipe.task != 'asr' else recipe.model.path or 'CTC'}",
                      t.precision, t.batch_size, length, t.gradient_checkpointing,
                      aux_losses=recipe.method == "moe",
                      lora_dropout=getattr(recipe.lora, "dropout", 0) > 0 if recipe.lora else True,
                      devices=devices, expert_parallel=expert_parallel)
    notes = [*task_notes, *_optimizer_note(t.trainer_args), *_stage_note(stages)]
    if recipe.method == "simoe":
        notes.append("SIMoE: activations not estimated (its interpolated layers are not in the formula)")
    return plan(model, folder, shapes, stages, setting, notes=notes)


def _max_length(recipe) -> int:
    return getattr(recipe.data, "max_length", None) or 0


def _stage_note(stages) -> list[str]:
    if len(stages) < 2:
        return []
    return ["stages: gradients follow the largest stage; the optimizer keeps AdamW state for every parameter that "
            "has trained so far (a state, once made, stays)"]


def _optimizer_note(trainer_args: dict) -> list[str]:
    optim = str(trainer_args.get("optim", "adamw_torch_fused"))
    if optim.startswith("adamw_torch") or optim in ("adamw_hf",):
        return []
    return [f"optimizer {optim}: its state is counted as torch AdamW's (2 states per trainable parameter); "
            "8-bit, factored or momentum-free optimizers keep less"]


# ---------------------------------------------------------------------------------------------- finetune


def plan_finetune(model: str, experts: str, *, batch_size: int = 16, grad_accum: int = 1, max_length: int = 128,
                  trust_remote_code: bool = False, devices: int = 8, expert_parallel: int | None = None,
                  allow_other_model: bool = False, log=None, warn=None) -> Plan:
    """The plan of `moekit finetune`: only the selection's expert rows train (moekit.selection.finetune.attach on the
    meta device), with the Trainer's AdamW in the checkpoint's dtype (moekit checkpoints) or float32 (transformers
    directories, as finetune loads them); no mixed precision, no aux losses. A selection made for another model is
    refused as finetune refuses it (moekit.selection.common.check_source, `warn` told of one without a source)."""
    from moekit.selection.common import check_source
    from moekit.selection.finetune import ExpertRows, attach
    from moekit.selection.selection import Selection
    from moekit.training.plan_model import finetune_model

    if devices < 1:
        raise ConfigError(f"devices must be a positive count, got {devices}")
    selection = Selection.load(experts)
    meta, folder, shapes = finetune_model(model, trust_remote_code, log)
    check_source(selection, meta, allow_other_model, warn)
    attach(meta, selection)
    bases = [m.base for m in meta.modules() if isinstance(m, ExpertRows)]
    setting = Setting(f"moekit finetune {model}: {selection.count} experts in {len(selection.experts)} layers",
                      "fp32", batch_size // grad_accum, max_length, aux_losses=False, devices=devices,
                      expert_parallel=expert_parallel)
    notes = ["parameters: the full expert tensors stay resident (frozen) and the K selected rows are trainable "
             "copies beside them; the full tensors are buffers of the parametrization, which ZeRO-3 and FSDP2 do "
             "not shard (counted whole on every device) and expert parallelism splits with the experts"]
    return plan(meta, folder, shapes, [("all steps", lambda name: True)], setting, bases, notes)


__all__ = ["ACTIVATION_TOLERANCE", "Plan", "Stage", "plan_finetune", "plan_recipe"]
