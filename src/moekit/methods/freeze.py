"""Which parameters train at which optimizer step (freeze schedules as a Trainer callback).

Frozen parameters get requires_grad=False, so they receive no gradient and AdamW skips them
entirely (no weight decay either). The optimizer is created over every parameter that trains at
some stage; the callback sets the stage's mask before each step (stateless: resuming works).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field
from torch import nn
from transformers import TrainerCallback

from moekit.config import Config
from moekit.moe.layer import moe_layers

Predicate = Callable[[str], bool]


class FreezeConfig(Config):
    """none: everything trains. spri_two_stage (SPRI §2.4): for the first tau·T optimizer steps only
    the routed experts' down projections and the routers train, then every parameter trains.
    ume (UME §III-C): only MoE layers (routed and shared experts, routers) train, throughout."""

    schedule: Literal["none", "spri_two_stage", "ume"] = "none"
    tau: float = Field(0.1, ge=0.0, le=1.0)


def _under(prefixes: list[str], suffixes: tuple[str, ...] = ("",)) -> Predicate:
    starts = tuple(f"{p}.{s}" for p in prefixes for s in suffixes)
    return lambda name: name.startswith(starts)


def stage_predicate(model: nn.Module, cfg: FreezeConfig, step: int, total_steps: int) -> Predicate:
    """Which parameter names train at optimizer step `step` (0-based)."""
    paths = [p for p, _ in moe_layers(model)]
    if cfg.schedule == "ume":
        return _under(paths)
    if cfg.schedule == "spri_two_stage" and step < round(cfg.tau * total_steps):
        return _under(paths, ("experts.down", "router."))
    return lambda name: True


def apply_mask(model: nn.Module, trains: Predicate) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(trains(name))


class FreezeCallback(TrainerCallback):
    """Sets requires_grad for the stage of the coming optimizer step."""

    def __init__(self, model: nn.Module, cfg: FreezeConfig):
        self.model, self.cfg = model, cfg

    def _apply(self, state) -> None:
        apply_mask(self.model, stage_predicate(self.model, self.cfg, state.global_step, state.max_steps))

    def on_train_begin(self, args, state, control, **kw):
        self._apply(state)

    def on_step_begin(self, args, state, control, **kw):
        self._apply(state)
