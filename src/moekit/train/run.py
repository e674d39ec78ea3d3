"""Run a recipe: load -> (upcycle | LoRA | dense) -> HF Trainer -> final model + evaluation."""
from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from moekit.assets import resolve_model
from moekit.data.parallel import TranslationCollator, encode_pair, load_pairs
from moekit.errors import ConfigError
from moekit.io import check_output_dir, load_dense, save
from moekit.train.freeze import FreezeCallback
from moekit.train.recipe import Recipe
from moekit.train.trainer import MoETrainer
from moekit.upcycle import upcycle


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {path} has no eos token; translation targets need one")
    return tok


def build_model(recipe: Recipe, path: Path) -> nn.Module:
    dtype = torch.bfloat16 if recipe.model.dtype == "bfloat16" else torch.float32
    model = load_dense(path, recipe.model.allow_pickle, recipe.model.trust_remote_code, dtype)
    if recipe.method == "moe":
        upcycle(model, recipe.moe)
    elif recipe.method == "lora":
        from peft import LoraConfig, get_peft_model

        lc = recipe.lora
        model = get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                 target_modules=lc.target_modules, task_type="CAUSAL_LM"))
    return model.train()


def training_args(recipe: Recipe, out: Path) -> TrainingArguments:
    t, o = recipe.train, recipe.optim
    return TrainingArguments(
        output_dir=str(out / "checkpoints"), max_steps=t.steps, per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=o.lr, weight_decay=o.weight_decay,
        lr_scheduler_type="linear", warmup_steps=o.warmup_ratio, max_grad_norm=o.max_grad_norm,
        seed=t.seed, data_seed=t.seed, bf16=t.precision == "bf16", logging_steps=t.logging_steps,
        save_strategy="steps" if t.save_every else "no", save_steps=t.save_every or 500,
        save_total_limit=t.save_total_limit, report_to=[], remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True,
        ddp_find_unused_parameters=recipe.freeze.schedule != "none" or recipe.method == "lora",
    )


def train(recipe: Recipe, overwrite: bool = False, resume: bool = False, callbacks=()) -> MoETrainer:
    """Train `recipe`; with `resume`, continue from the last checkpoint in its output directory."""
    out = Path(recipe.out)
    last = get_last_checkpoint(str(out / "checkpoints")) if resume and (out / "checkpoints").is_dir() else None
    if last is None:
        check_output_dir(out, overwrite)
    path = resolve_model(recipe.model.path)
    tok = load_tokenizer(path)
    train_pairs, _ = load_pairs(recipe.data)
    d = recipe.data
    encoded = [encode_pair(p, tok, d.template, d.max_length) for p in train_pairs]
    dataset = [e for e in encoded if any(label != -100 for label in e["labels"])]  # target left after truncation
    if not dataset:
        raise ConfigError(f"no training example keeps a target token within data.max_length={d.max_length}")
    model = build_model(recipe, path)
    cbs = list(callbacks)
    if recipe.freeze.schedule != "none":
        cbs.append(FreezeCallback(model, recipe.freeze))
    trainer = MoETrainer(model=model, args=training_args(recipe, out), train_dataset=dataset,
                         data_collator=TranslationCollator(tok.pad_token_id), aux=recipe.aux, callbacks=cbs)
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model(str(out / "model"))  # main process only; moekit format for MoE, adapter for LoRA
    if trainer.is_world_process_zero():
        tok.save_pretrained(out / "model")
        (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return trainer
