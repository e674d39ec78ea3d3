"""transformers.Trainer with MoE auxiliary losses, per-layer routing logs and moekit checkpoints."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path

import torch
from transformers import Trainer

from moekit.errors import CheckpointError, MoekitError
from moekit.io import load_state, read_meta, write_checkpoint
from moekit.losses import load_balance, z_loss
from moekit.moe.layer import moe_layers
from moekit.simoe import export as simoe_export
from moekit.simoe.export import is_simoe
from moekit.simoe.objective import penalty
from moekit.train.recipe import AuxConfig


def routing_stats(info, mask) -> dict[str, float]:
    """Expert-usage entropy (nats) and max load fraction of one layer, padding excluded."""
    counts = info.tokens_per_expert(mask).float()  # (E,)
    frac = counts / counts.sum().clamp_min(1)  # (E,)
    entropy = -(frac * frac.clamp_min(1e-12).log()).sum()
    return {"usage_entropy": float(entropy), "max_load": float(frac.max())}


@contextlib.contextmanager
def checkpoint_errors(folder):
    """A checkpoint that does not load (truncated, corrupt, of another model) is one CheckpointError."""
    try:
        yield
    except MoekitError:
        raise
    except Exception as e:  # noqa: BLE001  (torch/safetensors raise many types for a bad file)
        raise CheckpointError(f"cannot resume from {folder}: {type(e).__name__}: {e}") from e


class MoETrainer(Trainer):
    """Adds λ_lb·LB + λ_z·Z (each summed or averaged over MoE layers: aux.layer_reduction; padding excluded)
    to the task loss and
    logs them per layer with usage entropy and max load fraction; for SIMoE models, the orthogonality
    penalty and the Lagrangian sparsity term (moekit.simoe.objective), logged as simoe/*."""

    def __init__(self, *args, aux: AuxConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.aux = aux or AuxConfig()
        self._aux_logs: dict[str, list[float]] = defaultdict(list)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        unwrapped = self.accelerator.unwrap_model(model)
        layers = moe_layers(unwrapped)  # paths without DDP's `module.`
        aux = None
        if layers and model.training:
            aux = self._aux_loss(layers, mask)
        elif is_simoe(unwrapped) and model.training:
            aux, logs = penalty(unwrapped)
            for k, v in logs.items():
                self._aux_logs[k].append(v)
        if aux is not None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
            # the task loss is already normalized over the accumulated batch; the aux loss is a per-batch mean
            loss = loss + (aux / self.current_gradient_accumulation_steps if scaled else aux)
        return (loss, outputs) if return_outputs else loss

    def _aux_loss(self, layers, mask) -> torch.Tensor:
        lbs, zs = [], []
        for path, moe in layers:
            info = moe.last_routing
            m = mask.reshape(-1) if mask is not None and mask.numel() == info.logits.shape[0] else None
            lbs.append(load_balance(info, m, self.aux.balance_variant))
            zs.append(z_loss(info, m))
            stats = {"lb": lbs[-1].item(), "z": zs[-1].item(), **routing_stats(info, m)}
            for k, v in stats.items():
                self._aux_logs[f"moe/{path}/{k}"].append(v)
        reduce = torch.sum if self.aux.layer_reduction == "sum" else torch.mean
        lb, z = reduce(torch.stack(lbs)), reduce(torch.stack(zs))
        self._aux_logs["moe/lb"].append(lb.item())
        self._aux_logs["moe/z"].append(z.item())
        return self.aux.load_balance * lb + self.aux.z_loss * z

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._aux_logs:  # training logs: add the means since the last log
            logs.update({k: sum(v) / len(v) for k, v in self._aux_logs.items()})
            self._aux_logs.clear()
        super().log(logs, start_time)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """moekit format for MoE and SIMoE models. Under FSDP (FULL_STATE_DICT) or ZeRO-3, Trainer.save_model
        gathers the full `state_dict` on every rank first; only the main process writes it."""
        model = self.accelerator.unwrap_model(self.model)
        if not (moe_layers(model) or is_simoe(model)):
            return super()._save(output_dir, state_dict)
        if not self.args.should_save:  # Trainer calls _save on every rank and leaves the check to it
            return
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (simoe_export.write_checkpoint if is_simoe(model) else write_checkpoint)(model, out, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        with checkpoint_errors(resume_from_checkpoint):
            self._load_weights(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with checkpoint_errors(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        with checkpoint_errors(checkpoint):
            super()._load_rng_state(checkpoint)

    def _load_weights(self, resume_from_checkpoint: str, model=None) -> None:
        model = model or self.model
        folder = Path(resume_from_checkpoint)
        if (folder / "simoe.json").is_file():
            return load_state(self.accelerator.unwrap_model(model), folder, simoe_export.read_meta(folder))
        if not (folder / "moekit.json").is_file():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_state(self.accelerator.unwrap_model(model), folder, read_meta(folder))
