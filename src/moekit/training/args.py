"""transformers.TrainingArguments of a recipe: moekit's settings from the recipe, `train.trainer_args` on top.

`train.trainer_args` passes any other TrainingArguments field through (e.g. `optim`, `adam_beta2`,
`dataloader_num_workers`, `fsdp` + `fsdp_config`, `deepspeed`). Its keys are checked when the recipe is
validated; its values by building the TrainingArguments once when a run starts, before any data or model is
loaded (`check_training_args`).
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import torch

from moekit.errors import ConfigError
from moekit.methods import method

# TrainingArguments fields that moekit sets from the recipe -> the recipe key that sets them
FROM_RECIPE = {
    "output_dir": "out", "max_steps": "train.steps", "num_train_epochs": "train.steps",
    "per_device_train_batch_size": "train.batch_size", "gradient_accumulation_steps": "train.grad_accum",
    "learning_rate": "optim.lr", "weight_decay": "optim.weight_decay", "lr_scheduler_type": "optim.schedule",
    "warmup_steps": "optim.warmup_ratio", "max_grad_norm": "optim.max_grad_norm", "seed": "train.seed",
    "data_seed": "train.seed", "bf16": "train.precision", "fp16": "train.precision",
    "logging_steps": "train.logging_steps", "save_strategy": "train.save_every", "save_steps": "train.save_every",
    "save_total_limit": "train.save_total_limit", "report_to": "train.report_to",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "activation_checkpointing": "train.gradient_checkpointing",
    "eval_strategy": "train.eval_every (moekit evaluates with its own callback)",
    "eval_steps": "train.eval_every (moekit evaluates with its own callback)",
    "resume_from_checkpoint": "`moekit train --resume`",
}
# fields moekit fixes because its data, evaluation or device handling depend on them -> why
FIXED = {
    "remove_unused_columns": "moekit's collators build exactly the model's inputs",
    "use_cpu": "moekit trains on the CPU exactly when torch sees no accelerator",
    "ddp_find_unused_parameters": "moekit sets it from freeze.schedule and method",
}
DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"


def trainer_fields() -> list[str]:
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init]


def check_trainer_keys(args: dict) -> dict:
    """ValueError (one line) for a key of `train.trainer_args` that is no TrainingArguments field, or one
    that moekit sets itself; `args` unchanged otherwise."""
    if not args:
        return args
    fields = trainer_fields()
    for key in args:
        if key in FROM_RECIPE:
            raise ValueError(f"{key} is set from the recipe: use {FROM_RECIPE[key]} instead")
        if key in FIXED:
            raise ValueError(f"{key} cannot be set: {FIXED[key]}")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ValueError(f"{key!r} is not a TrainingArguments field; {hint}(all fields: {DOCS})")
    return args


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def use_cpu(device: str | None = None) -> bool:
    """TrainingArguments.use_cpu for a run asked to train on `device` ("cpu", or None for the default)."""
    return device == "cpu" or not has_accelerator()


def training_args(recipe, out: str | Path):
    """The transformers.TrainingArguments `moekit train` trains a recipe with.

    On a machine without an accelerator use_cpu is set: accelerate then runs bf16 autocast on the CPU and, under
    torchrun, CPU DDP (gloo); without it every process would train alone on all the data.

    Args:
        recipe: a validated recipe (moekit.load_recipe; translation, instruct, text or ASR).
        out: the run directory; the Trainer's checkpoints go to `out`/checkpoints.

    Returns:
        TrainingArguments from the recipe's `train` and `optim` sections, `train.trainer_args` on top.

    Raises:
        ValueError: a `train.trainer_args` value that TrainingArguments refuses.

    Example:
        >>> args = moekit.training_args(moekit.load_recipe("recipes/spri_two_stage.yaml"), "runs/mine")
        >>> args.max_steps, args.learning_rate
        (160, 0.0001)
    """
    from transformers import TrainingArguments

    from moekit.training.parallel import deepspeed_config

    t, o = recipe.train, recipe.optim
    extra = dict(t.trainer_args)
    if extra.get("deepspeed") is not None:  # a fresh, checked copy: TrainingArguments fills its "auto" values in place
        extra["deepspeed"] = deepspeed_config(extra["deepspeed"])
    return TrainingArguments(
        use_cpu=use_cpu(),
        output_dir=str(Path(out) / "checkpoints"), max_steps=t.steps, per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=o.lr, weight_decay=o.weight_decay,
        lr_scheduler_type="constant_with_warmup" if o.schedule == "constant" else o.schedule,
        warmup_steps=o.warmup_ratio, max_grad_norm=o.max_grad_norm,
        seed=t.seed, data_seed=t.seed, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        logging_steps=t.logging_steps, save_strategy="steps" if t.save_every else "no",
        save_steps=t.save_every or 500, save_total_limit=t.save_total_limit, report_to=list(t.report_to),
        activation_checkpointing=t.gradient_checkpointing, remove_unused_columns=False,
        ddp_find_unused_parameters=method(recipe.method).find_unused_parameters(recipe),
        # a model transformers shards itself (train.fsdp, train.expert_parallel) is checkpointed without its optimizer
        save_only_model=engine_of(recipe).by_transformers,
        **{"dataloader_num_workers": 0, "dataloader_pin_memory": False, "disable_tqdm": True, **extra},
    )


def check_training_args(recipe) -> None:
    """Build the recipe's TrainingArguments once, before any work: a value TrainingArguments refuses, or a
    setting that cannot run on this machine or in this launch (moekit.training.parallel), is one ConfigError."""
    from moekit.training.parallel import check_deepspeed, check_engine

    engine = engine_of(recipe)
    check_engine(engine, expert_counts(recipe) if engine.kind == "ep" else None)
    try:
        args = training_args(recipe, Path(recipe.out))
    except ConfigError:
        raise
    except (ValueError, TypeError, ImportError, OSError) as e:
        raise ConfigError(f"train.trainer_args: {e}") from None
    check_deepspeed(args)
    fsdp = args.fsdp_plugin_args or {}
    if fsdp.get("state_dict_type", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        raise ConfigError("train.trainer_args.fsdp_config.state_dict_type must be FULL_STATE_DICT: moekit writes its "
                          "checkpoints from the full state dict the Trainer gathers")
    check_device(recipe, args)


def check_device(recipe, args) -> None:
    """Refuse what accelerate would not do on this machine, instead of crashing or silently doing less."""
    if has_accelerator():
        return
    if recipe.train.precision == "fp16":
        raise ConfigError("train.precision=fp16 needs a GPU: on the CPU accelerate runs no fp16 autocast or grad "
                          "scaler, so the run would silently be fp32; use bf16 (CPU autocast) or fp32")
    if args.fsdp:
        raise ConfigError("train.trainer_args.fsdp needs GPUs: accelerate selects FSDP only for GPU-type devices; "
                          "on the CPU a multi-process run would silently train with DDP instead (and a single "
                          "process is refused by the Trainer); train.fsdp shards with FSDP2 on any device")


def engine_of(recipe):
    """The engine a recipe trains on in this launch (moekit.training.parallel.Engine)."""
    from moekit.training.parallel import engine_of as of

    t = recipe.train
    return of(t.trainer_args, t.fsdp, t.expert_parallel)


def expert_counts(recipe) -> list[int]:
    """The experts of each MoE layer the recipe trains: method moe, its spec; dense and LoRA, the base model's own
    (a native MoE checkpoint's, from its config); SIMoE's interpolated experts, none."""
    if recipe.method == "moe":
        spec = recipe.moe
        return [spec.num_experts * spec.granularity]
    if recipe.method in ("dense", "lora"):
        from moekit.training.plan_model import model_expert_counts

        m = recipe.model
        return model_expert_counts(m.path, m.trust_remote_code)
    return []
