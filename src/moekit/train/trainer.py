"""transformers.Trainer with the training method's extra losses (MoE router losses, SIMoE objective), per-layer
routing logs and checkpoint formats."""
from __future__ import annotations

import contextlib
import pickle
import re
from collections import defaultdict
from pathlib import Path

import torch
from transformers import Trainer

from moekit.errors import CheckpointError, MoekitError
from moekit.methods import TrainingMethod, method_for
from moekit.train.recipe import AuxConfig


@contextlib.contextmanager
def checkpoint_errors(folder):
    """A checkpoint that does not load (truncated, corrupt, of another model) is one CheckpointError; a file that
    torch.load (weights_only, as the Trainer calls it) refuses for its pickled objects is named, without torch's
    advice to load it unsafely."""
    load = torch.load

    def named_load(f, *args, **kwargs):
        try:
            return load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"unsupported GLOBAL (\S+)", str(e))
            what = f" (it names {found.group(1)})" if found else ""
            raise CheckpointError(f"cannot resume from {folder}: {f} holds pickled Python objects other than tensors"
                                  f"{what}; it is refused and nothing in it ran") from None

    torch.load = named_load
    try:
        yield
    except MoekitError:
        raise
    except Exception as e:  # noqa: BLE001  (torch/safetensors raise many types for a bad file)
        raise CheckpointError(f"cannot resume from {folder}: {type(e).__name__}: {e}") from e
    finally:
        torch.load = load


class MoETrainer(Trainer):
    """transformers.Trainer that asks the training method (moekit.methods) for its extra losses and its
    checkpoint format: the MoE router losses (λ_lb·LB + λ_z·Z, logged per layer with usage entropy and max
    load), SIMoE's penalty and Lagrangian term (logged as simoe/*), moekit or SIMoE checkpoints. `method`
    defaults to the one the model's structure implies (moekit.methods.method_for)."""

    def __init__(self, *args, aux: AuxConfig | None = None, method: TrainingMethod | None = None, engine=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine  # moekit.train.parallel.Engine (None: the Trainer used directly)
        self.own_optimizer = self.optimizer  # the method's (optimizers=(...)): DeepSpeed's init drops the Trainer's
        self.aux = aux or AuxConfig()
        self.method = method or method_for(self.accelerator.unwrap_model(self.model))
        self.aux_logs: dict[str, list[float]] = defaultdict(list)
        self.engine_record: dict | None = None  # moekit.train.parallel.engine_record, at the first step

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.engine_record is None and self.engine is not None:  # the model as the engine holds it
            from moekit.train.parallel import engine_record

            self.engine_record = engine_record(self.engine, model)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = self.method.extra_loss(self, self.accelerator.unwrap_model(model), mask) if model.training else None
        if aux is not None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
            # the task loss is already normalized over the accumulated batch; the aux loss is a per-batch mean
            loss = loss + (aux / self.current_gradient_accumulation_steps if scaled else aux)
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (or the method's), its groups split by the step their parameters start training
        at when a freeze schedule runs (moekit.methods.freeze.StagedSteps: exact under DeepSpeed too)."""
        from moekit.methods.freeze import FreezeCallback

        if self.optimizer is None and self.own_optimizer is not None:  # transformers' deepspeed_init reset it
            self.optimizer = self.own_optimizer
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        for cb in self.callback_handler.callbacks:
            if fresh and isinstance(cb, FreezeCallback) and cb.staged is None:
                cb.stage_optimizer(optimizer, self.args.max_steps)
        return optimizer

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.aux_logs:  # training logs: add the means since the last log
            logs.update({k: sum(v) / len(v) for k, v in self.aux_logs.items()})
            self.aux_logs.clear()
        super().log(logs, start_time)

    @property
    def sharded(self) -> bool:
        """No rank holds the whole model (ZeRO-3, FSDP2, EP): evaluation runs on every rank or from the saved model."""
        return self.engine is not None and self.engine.sharded

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The method's own format (moekit, SIMoE) or save_pretrained. Under accelerate's FSDP (FULL_STATE_DICT) or
        DeepSpeed, Trainer.save_model gathers the full `state_dict` on every rank first; a model sharded by
        transformers (train.fsdp, train.expert_parallel) is gathered here, by every rank. Only the main process
        writes."""
        from moekit.train.parallel import full_state_dict, global_expert_counts, is_sharded_by_transformers, materialized

        model = self.accelerator.unwrap_model(self.model)
        by_transformers = is_sharded_by_transformers(model)
        if by_transformers:
            if self.method.checkpoint_format() is None and not hasattr(model, "peft_config"):
                return super()._save(output_dir, state_dict)  # save_pretrained gathers on every rank itself
            state_dict = full_state_dict(model)
        if not self.args.should_save:  # Trainer calls _save on every rank and leaves the check to it
            return
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        whole = materialized(model, state_dict) if self.sharded and state_dict is not None else contextlib.nullcontext()
        with whole, global_expert_counts(model):  # the writers read the model whole, on this process alone
            if self.method.write_checkpoint(model, out, state_dict):
                return
            if hasattr(model, "peft_config") and by_transformers:
                model.save_pretrained(out, state_dict=state_dict)  # the adapter, from the gathered tensors
                return
        super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        with checkpoint_errors(resume_from_checkpoint):
            model = model or self.model
            if not self.method.load_checkpoint(self.accelerator.unwrap_model(model), Path(resume_from_checkpoint)):
                super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with checkpoint_errors(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        with checkpoint_errors(checkpoint):
            super()._load_rng_state(checkpoint)
