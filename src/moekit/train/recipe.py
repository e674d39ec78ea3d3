"""Training recipe: one YAML file (pydantic, extra="forbid") with dotted key=value overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from moekit.config import Config, apply_overrides, read_yaml, validate
from moekit.data.instruct import InstructConfig
from moekit.data.parallel import DataConfig
from moekit.moe.spec import MoESpec
from moekit.simoe.model import SIMoEConfig
from moekit.train.args import check_trainer_keys


class ModelConfig(Config):
    path: str = "smollm2-135m"  # model directory or built-in asset name
    dtype: Literal["float32", "bfloat16"] = "float32"
    allow_pickle: bool = False
    trust_remote_code: bool = False


class LoraConfig(Config):
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class FreezeConfig(Config):
    """none: everything trains. spri_two_stage (SPRI §2.4): for the first tau·T optimizer steps only
    the routed experts' down projections and the routers train, then every parameter trains.
    ume (UME §III-C): only MoE layers (routed and shared experts, routers) train, throughout."""

    schedule: Literal["none", "spri_two_stage", "ume"] = "none"
    tau: float = Field(0.1, ge=0.0, le=1.0)


class AuxConfig(Config):
    """Router auxiliary losses, added per micro-batch: λ_lb · LB + λ_z · Z, each reduced over the MoE layers
    by `layer_reduction`: "sum" (UME eq. 3 adds α·L_B "into each MoE layer"; Omni-router L_load = Σ_l, eq.
    3.5-; Switch/ST-MoE add the loss per layer) or "mean" (each layer weighted λ/L). `balance_variant`: see
    moekit.losses.load_balance (topk, argmax = Switch/UME, omni = Omni-router eqs. 3.3-3.5)."""

    load_balance: float = Field(1e-2, ge=0.0)  # λ_lb
    z_loss: float = Field(1e-3, ge=0.0)  # λ_z
    balance_variant: Literal["topk", "argmax", "omni"] = "topk"
    layer_reduction: Literal["sum", "mean"] = "sum"


class OptimConfig(Config):
    """AdamW (Adam with weight_decay 0) with warm-up and a `schedule` (SPRI §3.3: linear; SIMoE Table 6:
    constant; Omni-router §5.2: cosine)."""

    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    schedule: Literal["linear", "constant", "cosine"] = "linear"
    max_grad_norm: float = Field(1.0, gt=0.0)


class TrainConfig(Config):
    steps: int = Field(100, ge=1)  # optimizer steps
    batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    seed: int = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16/fp16: mixed precision (autocast); fp16 needs a GPU
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory)
    report_to: list[str] = Field(default_factory=list)  # Trainer integrations, e.g. ["tensorboard"]
    trainer_args: dict[str, Any] = Field(default_factory=dict)  # other TrainingArguments fields (moekit.train.args)
    logging_steps: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0)  # 0: evaluate at the end only
    save_every: int = Field(0, ge=0)  # 0: no intermediate checkpoints
    save_total_limit: int = Field(2, ge=1)

    @field_validator("trainer_args")
    @classmethod
    def _check_trainer_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_trainer_keys(args)


class EvalConfig(Config):
    kl_examples: int = Field(32, ge=0)  # held-out examples for KL(dense ‖ model), dense reference cached once
    max_new_tokens: int = Field(64, ge=1)
    generate: bool = True  # greedy generation for BLEU/chrF
    batch_size: int = Field(8, ge=1)


class Recipe(Config):
    task: Literal["translation"] = "translation"  # En→XX translation by a decoder-only LM
    name: str = "run"
    out: str = "runs/run"
    model: ModelConfig = ModelConfig()
    method: Literal["moe", "dense", "lora", "simoe"] = "moe"
    moe: MoESpec | None = None
    lora: LoraConfig | None = None
    simoe: SIMoEConfig | None = None
    freeze: FreezeConfig = FreezeConfig()
    aux: AuxConfig = AuxConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if (self.method == "moe") != (self.moe is not None):
            raise ValueError("method=moe needs a `moe` spec, and only method=moe takes one")
        if (self.method == "lora") != (self.lora is not None):
            raise ValueError("method=lora needs a `lora` section, and only method=lora takes one")
        if (self.method == "simoe") != (self.simoe is not None):
            raise ValueError("method=simoe needs a `simoe` section, and only method=simoe takes one")
        if self.freeze.schedule != "none" and self.method != "moe":
            raise ValueError(f"freeze.schedule={self.freeze.schedule} applies to MoE models (method=moe) only")
        return self


class InstructRecipe(Recipe):
    """Multi-task instruction tuning (SIMoE §4) on the Bible instruction mix (moekit.data.instruct):
    trained tasks are evaluated on held-out verses, unseen tasks measure cross-task generalization."""

    task: Literal["instruct"] = "instruct"
    data: InstructConfig = InstructConfig()


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Config:
    """A translation `Recipe`, an `InstructRecipe` (`task: instruct`), a `TextRecipe` (moekit.train.text,
    `task: text`) or an `ASRRecipe` (moekit.train.asr, `task: asr`)."""
    data = apply_overrides(read_yaml(path), overrides or [])
    if data.get("task") == "instruct":
        return validate(InstructRecipe, data, source=str(path))
    if data.get("task") == "text":
        from moekit.train.text import TextRecipe

        return validate(TextRecipe, data, source=str(path))
    if data.get("task") == "asr":
        from moekit.train.asr import ASRRecipe

        return validate(ASRRecipe, data, source=str(path))
    return validate(Recipe, data, source=str(path))
