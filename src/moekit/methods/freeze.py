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
    ume (UME §III-C): only MoE layers (routed and shared experts, routers) train, throughout. `frozen`: module paths
    whose parameters never train, in any stage (a speech-LLM recipe's model.freeze_audio fills in its audio encoder
    and adapter)."""

    schedule: Literal["none", "spri_two_stage", "ume"] = "none"
    tau: float = Field(0.1, ge=0.0, le=1.0)
    frozen: list[str] = Field(default_factory=list)


def _under(prefixes: list[str], suffixes: tuple[str, ...] = ("",)) -> Predicate:
    starts = tuple(f"{p}.{s}" for p in prefixes for s in suffixes)
    return lambda name: name.startswith(starts)


def stage_predicate(model: nn.Module, cfg: FreezeConfig, step: int, total_steps: int) -> Predicate:
    """Which parameter names train at optimizer step `step` (0-based); never those under `cfg.frozen`."""
    trains = _schedule(model, cfg, step, total_steps)
    if not cfg.frozen:
        return trains
    never = _under(cfg.frozen)
    return lambda name: trains(name) and not never(name)


def _schedule(model: nn.Module, cfg: FreezeConfig, step: int, total_steps: int) -> Predicate:
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
    """Sets requires_grad for the stage of the coming optimizer step (and tells a staged optimizer which step comes:
    `stage_optimizer`)."""

    def __init__(self, model: nn.Module, cfg: FreezeConfig):
        self.model, self.cfg, self.staged = model, cfg, None

    def stage_optimizer(self, optimizer, total_steps: int) -> None:
        """Split `optimizer`'s groups by the step their parameters start training at (StagedSteps)."""
        ids = {name: id(p) for name, p in self.model.named_parameters()}
        starts = {ids[name]: s for name, s in first_steps(self.model, self.cfg, total_steps).items()}
        self.staged = StagedSteps(optimizer, starts)

    def _apply(self, state) -> None:
        apply_mask(self.model, stage_predicate(self.model, self.cfg, state.global_step, state.max_steps))
        if self.staged is not None:
            self.staged.clock = state.global_step

    def on_train_begin(self, args, state, control, **kw):
        self._apply(state)

    def on_step_begin(self, args, state, control, **kw):
        self._apply(state)


def first_steps(model: nn.Module, cfg: FreezeConfig, total_steps: int) -> dict[str, int | None]:
    """For each parameter name, the first optimizer step (0-based) at which it trains; None: it never trains."""
    starts = [0] if cfg.schedule != "spri_two_stage" else sorted({0, round(cfg.tau * total_steps)})
    predicates = [(s, stage_predicate(model, cfg, s, total_steps)) for s in starts]
    return {name: next((s for s, trains in predicates if trains(name)), None) for name, _ in model.named_parameters()}


class StagedSteps:
    """The optimizer side of a freeze schedule: its parameter groups split by the step at which their parameters
    start training, and a step that leaves a group alone until then (no update, no weight decay, no moment, no step
    count), as torch's AdamW leaves a parameter without a gradient alone. Under DDP a frozen parameter has no
    gradient, so this changes nothing; DeepSpeed steps flat partitions whose frozen parts hold zeros, which AdamW
    would decay and count as steps (SPRI's second stage would start from moments and a bias correction its
    parameters never had). Parameters that never train are left out of the optimizer."""

    def __init__(self, optimizer, starts: dict[int, int | None]):  # id(parameter) -> first step
        self.optimizer, self.clock = optimizer, 0
        groups = []
        for group in optimizer.param_groups:
            by_start: dict[int, list] = {}
            for p in group["params"]:
                start = starts.get(id(p), 0)
                if start is not None:
                    by_start.setdefault(start, []).append(p)
            groups += [{**group, "params": ps, "first_step": s} for s, ps in sorted(by_start.items())]
        optimizer.param_groups[:] = groups
        self._step, optimizer.step = optimizer.step, self.step

    def step(self, *args, **kwargs):
        waiting = [(g, g["params"]) for g in self.optimizer.param_groups if g.get("first_step", 0) > self.clock]
        for g, _ in waiting:
            g["params"] = []
        try:
            return self._step(*args, **kwargs)
        finally:
            for g, params in waiting:
                g["params"] = params
