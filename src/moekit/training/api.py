"""`moekit.train`, `moekit.plan` and `moekit.evaluate`: the `moekit train`, `moekit train --dry-run` and `moekit
evaluate` commands as functions, for every recipe kind (translation, instruct, text, asr, speech_llm)."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from moekit.selection.selection import Selection
    from moekit.training.plan import Plan
    from moekit.training.recipe import AnyRecipe
    from moekit.training.trainer import MoETrainer

__all__ = ["Evaluation", "Finetuned", "evaluate", "finetune", "plan", "recipe_of", "train"]

Log = Callable[[str], None]

# DeepSpeed keys the Trainer fills -> the `finetune` arguments that set them (named when a config contradicts one)
FINETUNE_OWNED = {"train_micro_batch_size_per_gpu": "batch_size / grad_accum",
                  "gradient_accumulation_steps": "grad_accum", "train_batch_size": "batch_size × processes",
                  "gradient_clipping": "the Trainer's default (1.0)", "optimizer.params.lr": "lr",
                  "optimizer.params.weight_decay": "weight_decay", "scheduler.params.warmup_max_lr": "lr",
                  "fp16.enabled": "float32 training", "bf16.enabled": "float32 training"}


def recipe_of(recipe: AnyRecipe | str | Path, overrides: Sequence[str] = ()) -> AnyRecipe:
    """A recipe object as it is, or read from its YAML file; `overrides` (dotted key=value, values in YAML) applied
    either way."""
    from moekit.config import apply_overrides, validate
    from moekit.training.recipe import RECIPE, load_recipe

    if isinstance(recipe, (str, Path)):
        return load_recipe(recipe, list(overrides))
    if not overrides:
        return recipe
    return validate(RECIPE, apply_overrides(recipe.model_dump(mode="json"), list(overrides)), source="recipe")


def train(recipe: AnyRecipe | str | Path, overrides: Sequence[str] = (), *, overwrite: bool = False,
          resume: bool = False, callbacks: Sequence[TrainerCallback] = ()) -> MoETrainer:
    """Train a recipe of any kind and evaluate the result (`moekit train RECIPE [key=value ...]`).

    Upcycles the recipe's base model (method moe), or trains a dense or LoRA baseline, with the recipe's auxiliary
    losses and freeze schedule, then writes the model, results.json/csv and plots into `recipe.out`. The run lives
    in a working directory until it has finished. Under `torchrun` or `accelerate launch`, every process calls it.

    Args:
        recipe: A recipe (`moekit.load_recipe`) or its YAML file.
        overrides: Dotted `key=value` settings (values are YAML), e.g. ["train.steps=10", "model.path=my-model"].
        overwrite: Replace an existing output directory.
        resume: Continue from the last checkpoint in `recipe.out` (with `overwrite`: start over if there is none).
        callbacks: More transformers TrainerCallbacks for the run's Trainer.

    Returns:
        The Trainer that ran; `trainer.results` holds the evaluation (on the main process).

    Raises:
        ConfigError: An invalid recipe or override, or data the recipe cannot use.
        OutputExistsError: `recipe.out` exists and neither `overwrite` nor `resume` is set.

    Example:
        >>> trainer = moekit.train("recipes/spri_two_stage.yaml", ["train.steps=10"])  # doctest: +SKIP
    """
    r = recipe_of(recipe, overrides)
    inputs = [Path(recipe)] if isinstance(recipe, (str, Path)) else []
    if r.task == "asr":
        from moekit.training.asr import train_asr

        trainer: MoETrainer = train_asr(r, overwrite, resume, callbacks, inputs)
        return trainer
    from moekit.training.run import train as train_text_model

    return train_text_model(r, overwrite=overwrite, resume=resume, callbacks=callbacks, inputs=inputs)


def plan(recipe: AnyRecipe | str | Path, overrides: Sequence[str] = (), *, devices: int = 8,
         expert_parallel: int | None = None, log: Log | None = None) -> Plan:
    """The memory plan of training a recipe (`moekit train RECIPE --dry-run`): parameters, gradients, optimizer
    state and activations, per device under DDP, ZeRO-2/3, FSDP2 and expert parallelism, from config.json and the
    safetensors headers alone (no weight is read, nothing is written).

    Args:
        recipe: A recipe (`moekit.load_recipe`) or its YAML file.
        overrides: Dotted `key=value` settings (values are YAML).
        devices: The devices the engines spread over.
        expert_parallel: Expert-parallel ranks (None: the recipe's train.expert_parallel when above 1, else
            `devices` where it divides every MoE layer's experts).
        log: Called with status lines (e.g. a download of the base model's config); None: silent.

    Returns:
        The plan (sizes in bytes, counts in elements; `shares`: per device under each engine).

    Raises:
        ConfigError: An invalid recipe, or `devices` / `expert_parallel` that do not fit the model.

    Example:
        >>> p = moekit.plan("recipes/spri_two_stage.yaml", devices=4)  # doctest: +SKIP
        >>> [(s.engine, s.total) for s in p.shares]  # doctest: +SKIP
    """
    from moekit.training.plan import plan_recipe

    r = recipe_of(recipe, overrides)
    ep = expert_parallel or (r.train.expert_parallel if r.train.expert_parallel > 1 else None)
    return plan_recipe(r, devices, ep, log=log)


@dataclass(frozen=True)
class Evaluation:
    """What `evaluate` measured: the run's recipe (its `task` says which metrics `results` holds) and the results
    as written to the run's results.json."""

    run_dir: Path
    recipe: AnyRecipe
    results: dict[str, Any]


def evaluate(run_dir: str | Path, *, device: str = "cpu") -> Evaluation:
    """Evaluate a finished run again on its recipe's held-out test sets (`moekit evaluate RUN_DIR`).

    Translation and instruct: BLEU/chrF or ROUGE-L, loss, KL to the dense model, diversity, expert usage; text:
    held-out loss and perplexity; asr: WER/CER and routing statistics; speech_llm: BLEU/chrF/COMET or WER/CER per
    direction, loss, usage. Writes results.json, results.csv and plots into `run_dir`.

    Args:
        run_dir: A run directory that `train` finished (recipe.yaml and model/).
        device: auto, cpu, cuda or cuda:N.

    Returns:
        The recipe and the results.

    Raises:
        CheckpointError: `run_dir` is not a finished run.
        ConfigError: An unknown device.

    Example:
        >>> moekit.evaluate("runs/spri").results  # doctest: +SKIP
    """
    from moekit.config import resolve_device
    from moekit.errors import CheckpointError
    from moekit.training.recipe import load_recipe

    folder, device = Path(run_dir), resolve_device(device)
    if not (folder / "recipe.yaml").is_file() or not (folder / "model").is_dir():
        raise CheckpointError(f"{folder} is not a finished run (needs recipe.yaml and model/)")
    recipe = load_recipe(folder / "recipe.yaml", [f"out={folder}"])
    if recipe.task == "speech_llm":
        from moekit.training.speech_llm import evaluate_run

        return Evaluation(folder, recipe, evaluate_run(recipe, folder, device))
    return Evaluation(folder, recipe, _EVALUATORS[recipe.task](recipe, folder, device))


def _history(run_dir: Path) -> list[dict[str, Any]]:
    log = run_dir / "log_history.json"
    return json.loads(log.read_text()) if log.is_file() else []


def _trained(recipe: AnyRecipe, run_dir: Path, device: str) -> Any:
    from moekit.methods import method

    return method(recipe.method).load_trained(recipe, run_dir / "model").to(device)


def _translation(recipe: Any, run_dir: Path, device: str) -> dict[str, Any]:
    from moekit.eval.translation import DenseReference
    from moekit.training.common import load_tokenizer
    from moekit.training.run import load_data, report

    tok = load_tokenizer(run_dir / "model", recipe.model.trust_remote_code)
    ref = DenseReference.load(run_dir) if (run_dir / "dense_reference.safetensors").is_file() else None
    _, test = load_data(recipe)
    return report(recipe, _trained(recipe, run_dir, device), tok, test, ref, _history(run_dir))


def _asr(recipe: Any, run_dir: Path, device: str) -> dict[str, Any]:
    from moekit.speech.data import load_split
    from moekit.training.asr import load_speech, report

    _, test = load_split(recipe.data)
    return report(recipe, _trained(recipe, run_dir, device), load_speech(recipe, run_dir / "model"), test,
                  _history(run_dir))


def _text(recipe: Any, run_dir: Path, device: str) -> dict[str, Any]:
    from moekit.data.hf import load_text_data
    from moekit.eval.text import report_text
    from moekit.training.common import load_tokenizer

    _, test = load_text_data(recipe.data, load_tokenizer(run_dir / "model", recipe.model.trust_remote_code))
    return report_text(recipe, _trained(recipe, run_dir, device), test, _history(run_dir))


_EVALUATORS: dict[str, Callable[[Any, Path, str], dict[str, Any]]] = {
    "translation": _translation, "instruct": _translation, "asr": _asr, "text": _text}


@dataclass(frozen=True)
class Finetuned:
    """What `finetune` trained and saved (on the main process of a launch)."""

    path: Path
    selection: Selection
    steps: int  # optimizer steps run
    losses: list[float]  # the training loss at each logged step
    log_history: list[dict[str, Any]]  # the Trainer's, as saved in finetune.json
    trained: dict[str, list[int]] = field(default_factory=dict)  # {layer: experts}: LongCat-Flash's zero-computation
    # experts in the selection hold no weights and are not among them


def finetune(model: str | Path, experts: str | Path, data: dict[str, str | Path], out: str | Path, *,
             epochs: float = 3.0, steps: int | None = None, lr: float = 2e-5, batch_size: int = 16, grad_accum: int = 1,
             max_length: int = 128, weight_decay: float = 0.0, seed: int = 0, device: str = "auto",
             deepspeed: str | Path | None = None, fsdp: bool = False, expert_parallel: int | None = None,
             overwrite: bool = False, trust_remote_code: bool = False, allow_other_model: bool = False,
             log: Log | None = None, warn: Log | None = None) -> Finetuned | None:
    """Fine-tune only the selected experts on plain text, and save the model (`moekit finetune`).

    Causal-LM training (AdamW, linear decay; the defaults are RISE §5.1's) in which only the experts of a selection
    train; routers, attention, embeddings, norms and every other expert stay bit-identical. Saves the merged model
    with finetune.json (the settings and the Trainer's log). Under `torchrun` or `accelerate launch`, every process
    calls it and the main one writes.

    Args:
        model: An MoE model: a moekit checkpoint, a transformers model directory or a built-in asset name.
        experts: A selection JSON (`moekit.select`).
        data: {language: text file}, one training example per line.
        out: The output directory.
        epochs: Passes over the data (unless `steps`).
        steps: Optimizer steps instead of `epochs`.
        lr: The peak learning rate.
        batch_size: Examples per optimizer step.
        grad_accum: Micro-batches each optimizer step's batch is split into.
        max_length: Tokens per line; longer lines are cut.
        weight_decay: AdamW weight decay (selected rows only).
        seed: The seed of the data order.
        device: auto (a CUDA device when torch sees one), cpu, cuda or cuda:N.
        deepspeed: A DeepSpeed config (JSON) to train with under a distributed launch (ZeRO-3 needs weight decay 0).
        fsdp: FSDP2 full shard over the processes of a distributed launch.
        expert_parallel: Expert-parallel ranks under a distributed launch.
        overwrite: Replace a non-empty `out`.
        trust_remote_code: Allow a model directory that ships its own Python code (auto_map); it will run.
        allow_other_model: Use a selection made for another model (the layers and expert ids are still checked).
        log: Called with status lines (e.g. a download); None: silent.
        warn: Called with warnings (a selection that does not record its model); None: silent.

    Returns:
        What was trained and saved; None on the other processes of a distributed launch.

    Raises:
        ConfigError: Settings out of range, a selection that does not fit the model, a launch or DeepSpeed config
            that contradicts the settings.
        CheckpointError: The model has no tokenizer.
        OutputExistsError: `out` is not empty and `overwrite` is False.

    Example:
        >>> moekit.finetune("olmoe", "sw.json", {"sw": "sw.txt"}, "olmoe-sw", steps=100)  # doctest: +SKIP
    """
    from moekit.errors import ConfigError
    from moekit.training.finetune import check_finetune, trainer_settings
    from moekit.training.parallel import engine_of

    if min(steps or 1, batch_size, max_length, grad_accum) < 1 or epochs <= 0:
        raise ConfigError("epochs, steps, batch_size, grad_accum and max_length must be positive")
    if batch_size % grad_accum:
        raise ConfigError(f"batch_size {batch_size} is not a multiple of grad_accum {grad_accum}")
    engine = engine_of({} if deepspeed is None else {"deepspeed": str(deepspeed)}, fsdp, expert_parallel or 1)
    settings = dict(steps=steps, epochs=epochs, lr=lr, batch_size=batch_size, grad_accum=grad_accum,
                    weight_decay=weight_decay, seed=seed)
    check_finetune(engine, str(model), deepspeed, trainer_settings(1, steps, epochs, lr, batch_size, grad_accum,
                                                                   weight_decay, seed), trust_remote_code, FINETUNE_OWNED)
    return _finetune(model, experts, data, out, engine, settings, max_length, device, deepspeed, overwrite,
                     trust_remote_code, allow_other_model, log, warn)


def finetune_plan(model: str | Path, experts: str | Path, *, batch_size: int = 16, grad_accum: int = 1,
                  max_length: int = 128, devices: int = 8, expert_parallel: int | None = None,
                  trust_remote_code: bool = False, allow_other_model: bool = False, log: Log | None = None,
                  warn: Log | None = None) -> Plan:
    """The memory plan of `finetune` (`moekit finetune ... --dry-run`): only the selection's expert rows train, the
    full expert tensors stay resident; per device under DDP, ZeRO-2/3, FSDP2 and expert parallelism, from config.json,
    the safetensors headers and the selection alone (no weight is read, nothing is written).

    Args:
        model: An MoE model: a moekit checkpoint, a transformers model directory or a built-in asset name.
        experts: A selection JSON (`moekit.select`).
        batch_size: Examples per optimizer step.
        grad_accum: Micro-batches each optimizer step's batch is split into.
        max_length: Tokens per example.
        devices: The devices the engines spread over.
        expert_parallel: Expert-parallel ranks (None: `devices` where it divides every MoE layer's experts).
        trust_remote_code: Allow a model directory that ships its own Python code (auto_map).
        allow_other_model: Plan with a selection made for another model (the layers and expert ids are still checked).
        log: Called with status lines; None: silent.
        warn: Called with warnings (a selection that does not record its model); None: silent.

    Returns:
        The plan (sizes in bytes, counts in elements; `shares`: per device under each engine).

    Raises:
        ConfigError: Settings out of range, or a selection that does not fit the model.

    Example:
        >>> p = moekit.finetune_plan("olmoe", "sw.json", devices=4)  # doctest: +SKIP
        >>> p.trainable  # doctest: +SKIP
    """
    from moekit.errors import ConfigError
    from moekit.training.plan import plan_finetune

    if min(batch_size, max_length, grad_accum) < 1:
        raise ConfigError("batch_size, grad_accum and max_length must be positive")
    if batch_size % grad_accum:
        raise ConfigError(f"batch_size {batch_size} is not a multiple of grad_accum {grad_accum}")
    return plan_finetune(str(model), str(experts), batch_size=batch_size, grad_accum=grad_accum, max_length=max_length,
                         trust_remote_code=trust_remote_code, devices=devices, expert_parallel=expert_parallel,
                         allow_other_model=allow_other_model, log=log, warn=warn)


def _finetune(model: str | Path, experts: str | Path, data: dict[str, str | Path], out: str | Path, engine: Any,
              settings: dict[str, Any], max_length: int, device: str, deepspeed: str | Path | None, overwrite: bool,
              trust_remote_code: bool, allow_other_model: bool, log: Log | None, warn: Log | None) -> Finetuned | None:
    import contextlib

    from moekit._fs import reserve
    from moekit.assets import model_inputs, resolve_model
    from moekit.checkpoint.format import load_model
    from moekit.config import resolve_device
    from moekit.errors import CheckpointError
    from moekit.selection.api import load_for_selection
    from moekit.selection.common import save_model
    from moekit.training.finetune import finetune as train_selected, targets_of
    from moekit.training.parallel import is_main, leave_launch

    main, device = is_main(), resolve_device(device)
    inputs = [*model_inputs(str(model)), Path(experts), *map(Path, data.values())]
    # only the main process of a distributed launch reserves and writes the output
    with reserve(out, inputs, overwrite) if main else contextlib.nullcontext(Path(out)) as real:
        lines = _read_lines(data)
        folder = resolve_model(str(model), log=log)
        selection, loaded, tokenizer = load_for_selection(folder, experts, trust_remote_code, allow_other_model, warn)
        if tokenizer is None:
            raise CheckpointError(f"{model} has no tokenizer files; finetune needs one to read the text")

        def reload() -> Any:
            return load_model(folder, trust_remote_code=trust_remote_code)

        trained_ids = {t.layer: t.ids for t in targets_of(loaded, selection)}
        trained, history = train_selected(loaded, selection, tokenizer, lines, engine, reload, max_length=max_length,
                                          device=device, deepspeed=deepspeed, **settings)
        leave_launch()
        if not main:
            return None
        steps = max((e["step"] for e in history if "step" in e), default=0)
        record = {"selection": selection.model_dump(), "data": {lang: str(p) for lang, p in data.items()},
                  "steps": steps, "epochs": None if settings["steps"] else settings["epochs"], "lr": settings["lr"],
                  "batch_size": settings["batch_size"], "grad_accum": settings["grad_accum"], "max_length": max_length,
                  "weight_decay": settings["weight_decay"], "seed": settings["seed"], "engine": engine.describe(),
                  "log_history": history}
        save_model(trained, real, overwrite, tokenizer, extra={"finetune.json": record})
    return Finetuned(Path(out), selection, steps, [e["loss"] for e in history if "loss" in e], history, trained_ids)


def _read_lines(data: dict[str, str | Path]) -> list[str]:
    from moekit._fs import read_small
    from moekit.errors import ConfigError

    lines: list[str] = []
    for lang, path in data.items():
        lines += read_small(path, f"data file for {lang}", ConfigError, limit=4 << 30).splitlines()
    return lines
