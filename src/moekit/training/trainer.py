"""transformers.Trainer with the training method's extra losses (MoE router losses, SIMoE objective), freeze schedule,
per-layer routing logs and checkpoint formats (MoETrainer); the same MoE training for a Trainer that is not a
MoETrainer (MoECallback)."""
from __future__ import annotations

import contextlib
import pickle
import re
from collections import defaultdict
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from moekit.errors import CheckpointError, ConfigError, MoekitError
from moekit.methods import TrainingMethod, method, method_for
from moekit.methods.freeze import FreezeCallback, FreezeConfig
from moekit.methods.moe import track_routing
from moekit.moe.layer import moe_layers
from moekit.training.recipe import AuxConfig


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


def means(logs: dict[str, list[float | torch.Tensor]]) -> dict[str, float]:
    """The mean of each logged series, the series emptied (the router logs since the last training log). Series of
    0-dim tensors (what a training step logs without waiting for the device) are averaged where they are (float32:
    MPS has no float64) and read back together, one transfer per training log."""
    tensors = {k: torch.stack([t.detach().float() for t in v]).mean() for k, v in logs.items()
               if v and all(isinstance(t, torch.Tensor) for t in v)}
    device = next(iter(tensors.values())).device if tensors else None
    read = dict(zip(tensors, torch.stack([t.to(device) for t in tensors.values()]).tolist())) if tensors else {}
    out = {k: read[k] if k in read else sum(map(float, v)) / len(v) for k, v in logs.items()}
    logs.clear()
    return out


def freezer(model, freeze: FreezeConfig | None) -> list[FreezeCallback]:
    """The callback that runs `freeze`'s schedule on `model` (none for no schedule); a schedule needs MoE layers."""
    if freeze is None or freeze.schedule == "none":
        return []
    if not moe_layers(model):
        raise ConfigError(f"freeze.schedule={freeze.schedule} applies to MoE models only: the model has no MoE layers "
                          "(moekit.upcycle makes them)")
    return [FreezeCallback(model, freeze)]


def later_checkpoints(folder: Path, step: int) -> list[Path]:
    """The Trainer's checkpoint folders in `folder` (checkpoint-STEP) after `step` that hold files."""
    steps = {f: f.name.removeprefix("checkpoint-") for f in folder.glob("checkpoint-*")}
    return sorted(f for f, n in steps.items() if n.isdigit() and int(n) > step and any(f.iterdir()))


class MoETrainer(Trainer):
    """transformers.Trainer that trains what `moekit train` trains: the training method's extra losses (the MoE
    router losses λ_lb·LB + λ_z·Z, logged per layer with usage entropy and max load as moe/*; SIMoE's penalty and
    Lagrangian term as simoe/*), the freeze schedule, and the method's checkpoints (moekit's format, SIMoE's).

    Args:
        *args: transformers.Trainer's (model, args, data_collator, train_dataset, ...).
        aux: the router losses' weights and forms (a recipe's `aux`); default AuxConfig() (λ_lb 1e-2, λ_z 1e-3).
        freeze: which parameters train at which step (a recipe's `freeze`: SPRI's two stages, UME's MoE layers
            only); default none: the parameters train as they are set.
        method: the training method (moekit.methods); default the one the model's structure implies
            (moekit.methods.method_for: moe for a model with MoE layers).
        engine: the parallel engine of a `moekit train` run (moekit.training.parallel); None when used directly.
        **kwargs: transformers.Trainer's.

    Raises:
        ConfigError: a freeze schedule for a model without MoE layers.

    Example:
        >>> recipe = moekit.load_recipe("recipes/spri_two_stage.yaml", ["train.steps=10"])
        >>> model = moekit.upcycle(AutoModelForCausalLM.from_pretrained(path), recipe.moe)
        >>> trainer = moekit.MoETrainer(model=model, args=moekit.training_args(recipe, "runs/mine"),
        ...                             train_dataset=data, data_collator=collate, aux=recipe.aux,
        ...                             freeze=recipe.freeze)
        >>> trainer.train()

    A Trainer subclass of your own keeps the method by deriving from MoETrainer (`class Mine(moekit.MoETrainer)`,
    or `class Mine(moekit.MoETrainer, OtherTrainer)`); a Trainer you cannot derive, with MoECallback.
    """

    def __init__(self, *args, aux: AuxConfig | None = None, freeze: FreezeConfig | None = None,
                 method: TrainingMethod | None = None, engine=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine  # moekit.training.parallel.Engine (None: the Trainer used directly)
        self.own_optimizer = self.optimizer  # the method's (optimizers=(...)): DeepSpeed's init drops the Trainer's
        self.aux = aux or AuxConfig()
        self.method = method or method_for(self.accelerator.unwrap_model(self.model))
        track_routing(self.accelerator.unwrap_model(self.model))
        self.aux_logs: dict[str, list[float]] = defaultdict(list)
        self.engine_record: dict | None = None  # moekit.training.parallel.engine_record, at the first step
        for cb in freezer(self.model, freeze):
            self.add_callback(cb)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.engine_record is None and self.engine is not None:  # the model as the engine holds it
            from moekit.training.parallel import engine_record

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
            logs.update(means(self.aux_logs))
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
        from moekit.training.parallel import full_state_dict, global_expert_counts, is_sharded_by_transformers, materialized

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


class MoECallback(TrainerCallback):
    """MoE training for a transformers.Trainer that is not a MoETrainer (one a library builds, or a subclass you
    cannot derive from MoETrainer): as a callback it runs the freeze schedule and logs the router losses per layer;
    its `compute_loss`, given to the Trainer as `compute_loss_func`, adds the router losses λ_lb·LB + λ_z·Z (padding
    excluded) to the model's own loss. Together they train what MoETrainer trains (tests/test_trainer_api.py: the
    same per-step losses and weights).

    Args:
        aux: the router losses' weights and forms (a recipe's `aux`); default AuxConfig().
        freeze: which parameters train at which step (a recipe's `freeze`); default none.

    Raises:
        ConfigError: a model without MoE layers (when the Trainer is built); an output_dir holding checkpoints of
            an earlier run that this run's would replace (when training begins: the Trainer saves them with the
            model's save_pretrained, which in moekit's format writes no folder over another).

    Example:
        >>> moe = moekit.MoECallback(aux=recipe.aux, freeze=recipe.freeze)
        >>> trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
        ...                   callbacks=[moe], compute_loss_func=moe.compute_loss)

    The model's loss is its `loss_function` on the logits (for causal LMs the shifted cross-entropy over the
    labelled tokens of the accumulated batch, as the model computes it from `labels`); models with another loss
    (Whisper's) train with MoETrainer. The router logs (moe/*) go to the Trainer's log history, which
    `report_to` integrations have read by then. The model's save_pretrained ignores the Trainer's gathered
    `state_dict`: with DeepSpeed ZeRO-3 or FSDP, train with MoETrainer. With gradient accumulation each micro-batch's router losses count
    1/gradient_accumulation_steps; MoETrainer divides by the micro-batches of each step, which differ at an
    epoch's last step only when the epoch's micro-batches are no multiple of gradient_accumulation_steps.
    """

    def __init__(self, aux: AuxConfig | None = None, freeze: FreezeConfig | None = None):
        self.aux, self.freeze, self.method = aux or AuxConfig(), freeze, method("moe")
        self.aux_logs: dict[str, list[float]] = defaultdict(list)
        self.model, self.mask, self.accumulation, self.stages = None, None, 1, []

    def _record_mask(self, module, args, kwargs) -> None:
        self.mask = kwargs.get("attention_mask")

    def on_init_end(self, args, state, control, model=None, **kw):
        """The Trainer's model, checked; its freeze schedule; a hook on it that records each forward's attention
        mask (the router losses exclude padding)."""
        if not moe_layers(model):
            raise ConfigError("MoECallback trains MoE models: the model has no MoE layers (moekit.upcycle makes them)")
        self.model, self.accumulation = model, args.gradient_accumulation_steps
        self.stages = freezer(model, self.freeze)
        model.register_forward_pre_hook(self._record_mask, with_kwargs=True)
        track_routing(model)

    def on_train_begin(self, args, state, control, **kw):
        """Checked first: the Trainer saves its checkpoints with the model's save_pretrained, which (moekit's format)
        writes no folder over another: a checkpoint folder of a step still to come must not hold an earlier run's."""
        taken = [] if args.save_strategy == "no" else later_checkpoints(Path(args.output_dir), state.global_step)
        if taken:
            raise ConfigError(f"{taken[0]} holds a checkpoint of an earlier run, which this run's checkpoints would "
                              "replace; give this run another output_dir, or remove it")
        for cb in self.stages:
            cb.on_train_begin(args, state, control)

    def on_step_begin(self, args, state, control, **kw):
        for cb in self.stages:
            cb.on_step_begin(args, state, control)

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs and self.aux_logs:  # a training log: the means since the last one
            logs.update(means(self.aux_logs))
            state.log_history[-1].update(logs)

    def compute_loss(self, outputs, labels, num_items_in_batch=None) -> torch.Tensor:
        """The loss for `Trainer(compute_loss_func=...)`: the model's loss function on `outputs.logits` and `labels`
        (normalized by `num_items_in_batch`, the labelled tokens of the accumulated batch) plus, in training, the
        router losses of this forward divided by the gradient accumulation steps."""
        model = self.model
        loss = model.loss_function(logits=outputs.logits, labels=labels, vocab_size=model.config.vocab_size,
                                   num_items_in_batch=num_items_in_batch)
        if not model.training:
            return loss
        return loss + self.method.extra_loss(self, model, self.mask) / self.accumulation
