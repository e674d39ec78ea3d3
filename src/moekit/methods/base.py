"""Training methods, one file each, registered in METHODS: how a method builds the model it trains, which
parameters train when, its extra losses and callbacks, and its checkpoint format. The recipe validation,
the Trainer, `moekit train` and `moekit evaluate` ask the method instead of branching on its name."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from moekit.registry import Registry


def load_base(recipe, path: Path) -> nn.Module:
    """The recipe's base model from its resolved directory, in the recipe's dtype (moekit.checkpoint.dense's policy:
    safetensors unless model.allow_pickle, the model's own code only with model.trust_remote_code), or the recipe's
    model already adapted where the directory holds it (TrainingMethod.prepared: an upcycled moekit checkpoint)."""
    from moekit.checkpoint.dense import load_dense
    from moekit.checkpoint.format import load

    dtype = torch.bfloat16 if getattr(recipe.model, "dtype", "float32") == "bfloat16" else torch.float32  # ASR: float32
    if method(recipe.method).prepared(recipe, path):
        return load(path).to(dtype)
    return load_dense(path, recipe.model.allow_pickle, recipe.model.trust_remote_code, dtype)


@contextlib.contextmanager
def gathered(params: Iterable[tuple[nn.Module, str]]) -> Iterator[None]:
    """Sharded parameters (module, name) whole for use outside their module's forward (a penalty computed on them
    after the model ran), gradients included; a collective: every rank enters it. DeepSpeed ZeRO-3 partitions are
    gathered in place (deepspeed.zero.GatheredParameters); an FSDP2 shard (a DTensor) is replaced on its module by
    its full tensor (DTensor.full_tensor, whose backward hands each rank its shard's gradient) and put back after.
    Other parameters as they are."""
    params = list(params)
    partitioned = [getattr(m, n) for m, n in params if hasattr(getattr(m, n), "ds_id")]
    shards = [(m, n, getattr(m, n)) for m, n in params if _is_dtensor(getattr(m, n))]
    for m, n, p in shards:
        m._parameters[n] = p.full_tensor()  # a plain tensor in the parameter's place, as transformers' EP does
    try:
        if partitioned:
            import deepspeed

            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
                yield
        else:
            yield
    finally:
        for m, n, p in shards:
            m._parameters[n] = p


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's global generator seeded for a method's random init (LoRA's A, SIMoE's router), restored after: the
    same recipe starts from the same weights whatever ran before it in the process (an engine's imports draw random
    numbers too), and every rank from the same ones (ZeRO-3 and FSDP2 shard each rank's own copy)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class CheckpointFormat(NamedTuple):
    meta: str  # the file that marks a checkpoint of this format (moekit.json, simoe.json)
    write: Callable[[nn.Module, Path, dict | None], None]  # (model, folder, full state dict or None)
    read_meta: Callable[[Path], dict]


class TrainingMethod:
    """The default behaviour (the dense model trains as it is, saved with save_pretrained); methods
    override what differs."""

    name: ClassVar[str]
    section: ClassVar[str | None] = None  # the recipe section with the method's settings: required iff chosen
    tasks: ClassVar[frozenset[str]] = frozenset({"translation", "instruct", "text"})  # recipe tasks it trains
    freezes: ClassVar[bool] = False  # whether it takes a freeze.schedule (moekit.methods.freeze)
    keeps_frozen: ClassVar[bool] = False  # whether it honours freeze.frozen (module paths that never train)

    def adapt(self, recipe, model: nn.Module, tokenizer=None) -> nn.Module:
        """The model the recipe trains, built from the loaded base model (`tokenizer`: for router prompts)."""
        return model

    def prepared(self, recipe, folder: Path) -> bool:
        """Whether `folder` holds, in moekit's format, the model `adapt` would build from the recipe's base model (so
        that it trains as it is); an error for a checkpoint of this method that the recipe cannot train so."""
        return False

    def callbacks(self, recipe, model: nn.Module) -> list:
        return []

    def optimizer(self, recipe, model: nn.Module) -> torch.optim.Optimizer | None:
        """None: the Trainer's own AdamW."""
        return None

    def zero3_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules besides the MoE blocks that DeepSpeed ZeRO-3 must gather as one unit (leaf modules)."""
        return []

    def fsdp_units(self, model: nn.Module) -> list[str]:
        """Paths of modules called outside the decoder layers that FSDP2 must shard as units of their own."""
        return []

    def find_unused_parameters(self, recipe) -> bool:
        """Whether DDP must look for parameters without a gradient (frozen stages, adapters)."""
        return False

    def extra_loss(self, trainer, model: nn.Module, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Added to the task loss in training (`model` unwrapped); logs go to trainer.aux_logs."""
        return None

    def checkpoint_format(self) -> CheckpointFormat | None:
        """The method's own checkpoint format; None: the Trainer's save_pretrained and loading."""
        return None

    def write_checkpoint(self, model: nn.Module, folder: Path, state_dict: dict | None = None) -> bool:
        """Write the model in the method's own format into `folder` (`state_dict`: the full one gathered from
        FSDP/ZeRO-3 shards, else None); False: the Trainer's save_pretrained."""
        fmt = self.checkpoint_format()
        if fmt is None:
            return False
        fmt.write(model, folder, state_dict)
        return True

    def load_checkpoint(self, model: nn.Module, folder: Path) -> bool:
        """Load a resumed checkpoint of the method's own format into `model`; False: the Trainer's loading."""
        from moekit.checkpoint.format import load_state

        fmt = self.checkpoint_format()
        if fmt is None or not (folder / fmt.meta).is_file():
            return False
        load_state(model, folder, fmt.read_meta(folder))
        return True

    def load_trained(self, recipe, folder: Path) -> nn.Module:
        """The trained model of a finished run (`moekit evaluate`)."""
        from moekit.checkpoint.format import load_model

        m = recipe.model
        return load_model(folder, m.allow_pickle, m.trust_remote_code)


METHODS: Registry[type[TrainingMethod]] = Registry("training method")


def method(name: str) -> TrainingMethod:
    """The registered method `name` (a ConfigError listing the others if unknown)."""
    return METHODS.get(name)()


def method_for(model: nn.Module) -> TrainingMethod:
    """The method of a model trained without a recipe (MoETrainer used directly): simoe for a SIMoE model,
    moe for a model with MoE layers, dense otherwise."""
    from moekit.moe.layer import moe_layers
    from moekit.moe.state import model_state

    return method("simoe" if model_state(model).simoe is not None else "moe" if moe_layers(model) else "dense")
