"""Training recipe: one YAML file (pydantic, extra="forbid") with dotted key=value overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator

from moekit.config import Config, apply_overrides, read_yaml, validate
from moekit.methods.freeze import FreezeConfig
from moekit.data.instruct import InstructConfig
from moekit.data.parallel import DataConfig
from moekit.moe.spec import MoESpec
from moekit.simoe.model import SIMoEConfig
from moekit.data.hf import TextDataConfig
from moekit.speech.data import ASRDataConfig
from moekit.speech.s2tt import S2TTDataConfig
from moekit.training.args import check_trainer_keys


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


class AuxConfig(Config):
    """Router auxiliary losses, added per micro-batch: λ_lb · LB + λ_z · Z, each reduced over the MoE layers
    by `layer_reduction`: "sum" (UME §III-C-2 adds α·L_B "into each MoE layer"; Omni-router L_load = Σ_l, eq.
    3.5-; Switch/ST-MoE add the loss per layer) or "mean" (each layer weighted λ/L). `balance_variant`: see
    moekit.moe.losses.load_balance (topk, argmax = Switch/UME, omni = Omni-router eqs. 3.3-3.5)."""

    load_balance: float = Field(1e-2, ge=0.0)  # λ_lb
    z_loss: float = Field(1e-3, ge=0.0)  # λ_z
    balance_variant: Literal["topk", "argmax", "omni"] = "topk"
    layer_reduction: Literal["sum", "mean"] = "sum"


class OptimConfig(Config):
    """AdamW (Adam with weight_decay 0) with warm-up and a `schedule` (SPRI §3.3: linear; SIMoE Table 6:
    constant; Omni-router §5.3: cosine)."""

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
    trainer_args: dict[str, Any] = Field(default_factory=dict)  # other TrainingArguments fields (moekit.training.args)
    # beyond one device (moekit.training.parallel; a distributed launch): FSDP2 full shard over every process, or the
    # experts of each MoE layer split over `expert_parallel` ranks (all-to-all) with the rest FSDP2-sharded
    fsdp: bool = False
    expert_parallel: int = Field(1, ge=1)
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


class RecipeBase(Config):
    """What every task's recipe has: the training method (moekit.methods; its section `moe`, `lora` or
    `simoe` is required iff it is the one chosen), freeze schedule, aux losses, optimizer and training loop."""

    name: str = "run"
    out: str = "runs/run"
    method: str = "moe"  # a name in moekit.methods.METHODS: moe, dense, lora, simoe
    moe: MoESpec | None = None
    lora: LoraConfig | None = None
    simoe: SIMoEConfig | None = None
    freeze: FreezeConfig = FreezeConfig()
    aux: AuxConfig = AuxConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    @field_validator("method")
    @classmethod
    def _known(cls, name: str) -> str:
        from moekit.methods import METHODS

        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHODS.names())}")
        return name

    @model_validator(mode="after")
    def _check(self) -> RecipeBase:
        from moekit.methods import METHODS

        chosen = METHODS.get(self.method)
        if self.task not in chosen.tasks:
            raise ValueError(f"method={self.method} does not train task={self.task} "
                             f"(it trains {', '.join(sorted(chosen.tasks))})")
        for name in METHODS.names():
            section = METHODS.get(name).section
            if section is not None and (name == self.method) != (getattr(self, section) is not None):
                raise ValueError(f"method={name} needs a `{section}` section, and only method={name} takes one")
        if self.freeze.schedule != "none" and not chosen.freezes:
            raise ValueError(f"freeze.schedule={self.freeze.schedule} applies to MoE models (method=moe) only")
        if self.freeze.frozen and not chosen.keeps_frozen:
            raise ValueError(f"freeze.frozen applies to method=moe or method=dense, not method={self.method} (whose "
                             "training would ignore it)")
        return self


class TranslationRecipe(RecipeBase):
    """En→XX translation by a decoder-only LM (SPRI §3, UME-style upcycling of LLMs)."""

    task: Literal["translation"] = "translation"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()


class InstructRecipe(TranslationRecipe):
    """Multi-task instruction tuning (SIMoE §4) on the Bible instruction mix (moekit.data.instruct):
    trained tasks are evaluated on held-out verses, unseen tasks measure cross-task generalization."""

    task: Literal["instruct"] = "instruct"
    data: InstructConfig = InstructConfig()


class CTCArch(Config):
    """The from-scratch CTC encoder (Omni-router §5.2 in miniature; moekit.speech.ctc)."""

    hidden_size: int = Field(256, ge=8)
    num_layers: int = Field(6, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(1024, ge=8)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    act: str = "gelu"
    stack: int = Field(4, ge=1)  # log-mel frames stacked per step (§5.3: 4 -> 40 ms)


class ASRModelConfig(Config):
    kind: Literal["whisper", "ctc", "pretrained_ctc"] = "whisper"
    # whisper: a model directory or built-in asset (whisper-tiny.en, whisper-base); pretrained_ctc: a transformers CTC
    # checkpoint with its processor (wav2vec 2.0, HuBERT, WavLM, MMS, ..., Parakeet:
    # moekit.speech.data.ProcessorCTCCollator)
    path: str | None = None
    ctc: CTCArch | None = None  # CTC: the architecture, trained from scratch
    allow_pickle: bool = False
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _check(self) -> ASRModelConfig:
        if self.kind == "whisper" and (self.path is None or self.ctc is not None):
            raise ValueError("model.kind=whisper needs model.path (a directory or whisper-tiny.en / whisper-base) "
                             "and no model.ctc")
        if self.kind == "ctc" and (self.ctc is None or self.path is not None):
            raise ValueError("model.kind=ctc trains from scratch: give model.ctc (the architecture), not model.path")
        if self.kind == "pretrained_ctc" and (self.path is None or self.ctc is not None):
            raise ValueError("model.kind=pretrained_ctc needs model.path (a transformers CTC checkpoint with its "
                             "processor) and no model.ctc")
        return self


class ASREvalConfig(Config):
    batch_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(96, ge=1)  # Whisper generation
    loss_per_lang: int = Field(16, ge=1)  # test utterances per language for the loss logged every eval_every
    routing_stack: str | None = None  # regex of the MoE layers for Cramér's V / usage (default Whisper: "encoder")
    permutation: list[float] = Field(default_factory=lambda: [0.1, 0.5])  # rates p of the permutation test
    routing_batches: int = Field(4, ge=1)  # teacher-forced batches per language for the routing statistics


class ASRRecipe(RecipeBase):
    """Speech recognition (moekit.training.asr): a pretrained Whisper (UME upcycling, or full fine-tuning), a
    pretrained transformers CTC checkpoint (wav2vec 2.0 and its kin), or a from-scratch CTC encoder (dense, Switch or
    Omni-router) on a corpus from `moekit speech corpus`."""

    task: Literal["asr"] = "asr"
    name: str = "asr"
    out: str = "runs/asr"
    model: ASRModelConfig
    data: ASRDataConfig = ASRDataConfig()
    eval: ASREvalConfig = ASREvalConfig()

    @model_validator(mode="after")
    def _own_masking(self) -> ASRRecipe:
        if self.model.kind == "pretrained_ctc" and self.data.spec_augment is not None:
            raise ValueError("model.kind=pretrained_ctc: data.spec_augment masks log-mel features, which a wav2vec "
                             "2.0 checkpoint does not take; it masks its own features in training (its config's "
                             "mask_time_prob): set data.spec_augment: null")
        return self


class TextEvalConfig(Config):
    batch_size: int = Field(8, ge=1)


class TextRecipe(RecipeBase):
    """Causal-LM fine-tuning on the user's local files (data.source: datasets; formats text, alpaca, chat,
    translation; moekit.training.text)."""

    task: Literal["text"] = "text"
    model: ModelConfig = ModelConfig()
    data: TextDataConfig
    eval: TextEvalConfig = TextEvalConfig()


class SpeechLLMModelConfig(Config):
    """A speech-LLM (moekit.speech.llm: Qwen3-ASR, Qwen2-Audio) with its processor in one directory."""

    path: str  # the model directory (weights, config, processor: feature extractor, tokenizer, chat template)
    dtype: Literal["float32", "bfloat16"] = "float32"
    freeze_audio: bool = False  # the audio encoder and adapter never train (False: they train as the recipe's stages say)
    instruction: str | None = None  # text in the prompt, {src_name}/{tgt_name} filled in (moekit.speech.llm)
    allow_pickle: bool = False
    trust_remote_code: bool = False


class SpeechLLMEvalConfig(Config):
    batch_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(256, ge=1)  # Qwen2-Audio's evaluation: greedy, at most 256 new tokens
    generate: bool = True  # greedy generation for BLEU/chrF (WER/CER for transcription) and COMET
    loss_per_direction: int = Field(16, ge=1)  # test rows per direction for eval_<dir>_loss every train.eval_every
    comet: str | None = None  # a local Unbabel/wmt22-comet-da checkpoint (folder or .ckpt); None: COMET not computed
    comet_batch_size: int = Field(16, ge=1)


class SpeechLLMRecipe(RecipeBase):
    """Speech-to-text with a speech-LLM (moekit.training.speech_llm): En→XX speech translation (SPRI §3) and English
    transcription, one path: the model's own processor and chat template, loss on the target tokens only, the
    directions shuffled together, SPRI A.2's length filters, BLEU/chrF (Qwen2-Audio's tokenizers) and COMET."""

    task: Literal["speech_llm"] = "speech_llm"
    name: str = "speech_llm"
    out: str = "runs/speech_llm"
    model: SpeechLLMModelConfig
    data: S2TTDataConfig = S2TTDataConfig()
    eval: SpeechLLMEvalConfig = SpeechLLMEvalConfig()


AnyRecipe = TranslationRecipe | InstructRecipe | ASRRecipe | TextRecipe | SpeechLLMRecipe
RECIPE = TypeAdapter(Annotated[AnyRecipe, Field(discriminator="task")])


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> AnyRecipe:
    """The recipe in a YAML file, validated, as `moekit train` reads it.

    Args:
        path: the recipe's YAML file.
        overrides: dotted `key=value` settings applied first (values are YAML), e.g. ["train.steps=10"].

    Returns:
        The recipe, of the class its `task` names (TranslationRecipe by default, InstructRecipe, TextRecipe,
        ASRRecipe): its `moe` is the MoESpec for moekit.upcycle, `aux` and `freeze` are MoETrainer's settings.

    Raises:
        ConfigError: an unreadable file, an invalid override, or a key or value the recipe refuses.

    Example:
        >>> recipe = moekit.load_recipe("recipes/spri_two_stage.yaml", ["train.steps=10"])
        >>> recipe.freeze.schedule, recipe.moe.num_experts
        ('spri_two_stage', 8)
    """
    data = apply_overrides(read_yaml(path), overrides or [])
    data.setdefault("task", "translation")
    return validate(RECIPE, data, source=str(path))
