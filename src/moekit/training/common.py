"""What every training task shares (translation and text here, speech in moekit.training.asr): the run directory
(built beside its output, resumable), the tokenizer, the model a recipe's method trains, the Trainer, the final save and
the run files."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import yaml
from torch import nn
from transformers.trainer_callback import PrinterCallback, TrainerState

from moekit._fs import output, partial_path, read_small, remove
from moekit.assets import hub_id, model_inputs
from moekit.checkpoint.card import write_model_card
from moekit.errors import CheckpointError, ConfigError, OutputExistsError
from moekit.methods import method
from moekit.methods.base import load_base
from moekit.training.args import training_args
from moekit.training.parallel import is_main
from moekit.training.progress import TrainProgress
from moekit.training.recipe import RecipeBase, TranslationRecipe
from moekit.training.trainer import MoETrainer


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The model directory's tokenizer, with a pad token (eos) for batching; it must have an eos token."""
    from moekit.checkpoint.dense import load_tokenizer as load

    tok = load(path, trust_remote_code)
    if tok is None:
        raise CheckpointError(f"{path} has no tokenizer files; translation and instruction recipes need one")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {path} has no eos token; translation targets need one")
    return tok


def adapt(recipe, model: nn.Module, tokenizer=None) -> nn.Module:
    """The model the recipe trains, built by its training method (moekit.methods) from the base model
    (`tokenizer`: for router inits from prompts)."""
    return method(recipe.method).adapt(recipe, model, tokenizer).train()


def check_base(recipe) -> None:
    """A local model.path the recipe's method cannot start from, refused before any work (TrainingMethod.prepared:
    e.g. a checkpoint upcycled with another MoE spec than the recipe's). A CTC recipe has none (trained from scratch)."""
    if recipe.model.path is not None and Path(recipe.model.path).is_dir():
        method(recipe.method).prepared(recipe, Path(recipe.model.path))


def build_model(recipe: TranslationRecipe, path: Path) -> nn.Module:
    return adapt(recipe, load_base(recipe, path))


def evaluation_model(recipe, trainer, folder: Path) -> nn.Module:
    """The trained model to evaluate on the main process: the Trainer's own, or where no rank holds it whole
    (ZeRO-3, FSDP2, EP) the one just saved in `folder`, loaded on this process's device. After a sharded run the
    main process is alone: transformers forgets the ZeRO-3 config, so that the model builds whole and generate
    does not wait for the ranks that have left (its synced_gpus)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if not getattr(trainer, "sharded", False):
        return trainer.model
    unset_hf_deepspeed_config()
    return method(recipe.method).load_trained(recipe, folder).to(trainer.args.device)


def write_run_files(recipe: TranslationRecipe, trainer, final_out: str, model: nn.Module | None = None) -> None:
    """recipe.yaml (with the run's real `out`), log_history.json (losses, aux metrics), engine.json (the engine and
    the parameters each process held: moekit.training.parallel.engine_record) and README.md (the
    trained model's card; `model`: the trained model if not the Trainer's) in the run directory."""
    out = Path(recipe.out)
    write_model_card(model if model is not None else trainer.accelerator.unwrap_model(trainer.model), out,
                     title=f"moekit training run {recipe.name} ({recipe.method}, {trainer.state.global_step} steps)",
                     extra={"recipe": "recipe.yaml (beside this card)", "model": "model/"},
                     base_model=hub_id(recipe.model.path))
    (out / "recipe.yaml").write_text(yaml.safe_dump({**recipe.model_dump(mode="json"), "out": final_out},
                                                    sort_keys=False))
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    if getattr(trainer, "engine_record", None):
        (out / "engine.json").write_text(json.dumps(trainer.engine_record, indent=1))


def make_trainer(recipe, model: nn.Module, dataset, collator, callbacks: list) -> MoETrainer:
    """MoETrainer for a recipe (any task): its method's callbacks, optimizer and losses, and progress
    (TrainProgress); the model prepared for the run's engine (moekit.training.parallel: sharded by transformers' FSDP2
    or EP, or its MoE blocks declared ZeRO-3 leaves) before the optimizer sees its parameters."""
    from moekit.training.args import engine_of
    from moekit.training.parallel import distribute, zero3_leaves

    m, engine = method(recipe.method), engine_of(recipe)
    if engine.by_transformers:
        distribute(model, engine, m.fsdp_units(model))
    elif engine.zero == 3:
        zero3_leaves(model, m.zero3_units(model))
    trainer = MoETrainer(model=model, args=training_args(recipe, Path(recipe.out)), train_dataset=dataset,
                         data_collator=collator, aux=recipe.aux, callbacks=[*callbacks, *m.callbacks(recipe, model)],
                         optimizers=(m.optimizer(recipe, model), None), method=m, engine=engine)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(TrainProgress)
    return trainer


def recipe_inputs(recipe) -> list[Path]:
    """Every local file or directory a recipe reads (base model, BTX branches, data files, speech corpus):
    the run directory may not be, or contain, any of them."""
    d, init = recipe.data, getattr(getattr(recipe, "moe", None), "init", None)
    sources = [] if init is None else init.source_models()
    paths = [*model_inputs(recipe.model.path), *(p for b in sources for p in model_inputs(b))]
    files = [*getattr(d, "train_files", []), *getattr(d, "test_files", []), getattr(d, "corpus", None),
             *(getattr(d, k, None) for k in ("path", "clips")), getattr(recipe.eval, "comet", None)]  # speech_llm
    return paths + [Path(f) for f in files if f]


def last_checkpoint(run: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (Trainer writes trainer_state.json last)."""
    folder = run / "checkpoints"
    steps = {int(p.name.removeprefix("checkpoint-")): p for p in folder.glob("checkpoint-*")
             if p.name.removeprefix("checkpoint-").isdigit() and (p / "trainer_state.json").is_file()}
    return steps[max(steps)] if steps else None


def check_checkpoint(last: Path) -> None:
    """A checkpoint to resume from has a readable trainer_state.json and its optimizer state: the Trainer's
    optimizer.pt, or under DeepSpeed its `global_step<N>/` folder with one optimizer partition per process of this
    launch (DeepSpeed resumes a ZeRO checkpoint on as many processes as wrote it)."""
    from moekit.training.parallel import world_size

    try:
        state = json.loads(read_small(last / "trainer_state.json", "trainer state", CheckpointError))
        step = int(state["global_step"])
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot resume from {last}: trainer_state.json is unreadable ({e})") from None
    if (last / "optimizer.pt").is_file():
        return
    zero = last / f"global_step{step}"
    if not zero.is_dir():
        raise CheckpointError(f"cannot resume from {last}: it has no optimizer.pt (an incomplete checkpoint)")
    parts, n = len(list(zero.glob("*optim_states.pt"))), world_size()
    if parts != n:
        raise CheckpointError(f"cannot resume from {last}: its DeepSpeed optimizer state has {parts} partitions "
                              f"(in {zero.name}), this launch {n} processes")


def resume_point(out: Path, partial: Path, overwrite: bool) -> Path | None:
    """The checkpoint `--resume` continues from: the interrupted run's newest, else the finished run's;
    checked before any work. None (start over) when there is none and `overwrite` allows it, e.g. a run
    stopped before its first checkpoint."""
    last = last_checkpoint(partial) or last_checkpoint(out)
    if last is None:
        if overwrite:
            return None
        where = partial if partial.exists() else out
        raise CheckpointError(f"nothing to resume: {where} has no complete checkpoint (train.save_every saves "
                              "them); overwrite=True starts the run over")
    check_checkpoint(last)
    return last


@contextlib.contextmanager
def run_directory(recipe, overwrite: bool, resume: bool, inputs: list[Path]) -> Iterator[tuple[RecipeBase, Path | None]]:
    """(the recipe pointed at its working directory, the checkpoint to resume from or None).

    A run is built in `.NAME.moekit-partial` beside `out` and renamed to `out` only when it has finished, so
    `--overwrite` keeps the old run until the new one is complete. If the run stops early (error, Ctrl-C,
    SIGTERM) after saving a checkpoint, the partial directory is kept and `--resume` continues it; `--resume`
    on a finished run continues from its last checkpoint and replaces it when done. Only the main process
    (rank 0) locks and renames; the other ranks of a multi-process run use the same working directory.
    """
    from moekit.training.args import engine_of
    from moekit.training.parallel import check_launch

    check_launch()
    out = Path(recipe.out)
    partial = partial_path(out)
    if resume and engine_of(recipe).by_transformers:
        raise ConfigError("a run under train.fsdp or train.expert_parallel cannot resume: transformers checkpoints a "
                          "model it shards without its optimizer state (its checkpoints hold the model only)")
    if resume and (partial.exists() or out.exists()):
        last = resume_point(out, partial, overwrite)
    else:
        last = None
    continues = last is not None and last.parent.parent == partial  # the interrupted run goes on in place
    if last is not None and not continues:  # continuing a finished run replaces it
        overwrite = True
    if last is None and partial.exists() and not overwrite and is_main():
        raise OutputExistsError(partial, f"{partial} holds an interrupted run of {out} (resume=True continues it)")
    if not is_main():
        yield recipe.model_copy(update={"out": str(partial)}), last
        return
    with output(out, inputs, overwrite, partial=True, keep=lambda work: last_checkpoint(work) is not None,
                what="run directory") as work:
        if not continues:  # a fresh start, or resuming from the finished run: begin empty
            for entry in work.iterdir():
                remove(entry)
        yield recipe.model_copy(update={"out": str(work)}), last


def save_final(trainer, out: Path) -> None:
    """The trained model into `out`/model (the method's format: moekit, SIMoE, a LoRA adapter, save_pretrained).
    `out` is the run's own working directory; a `model` folder already there was left by an attempt stopped
    after saving it (e.g. during evaluation) and resumed, and is replaced."""
    if trainer.is_world_process_zero() and (out / "model").exists():
        remove(out / "model")
    if trainer.is_deepspeed_enabled and trainer.deepspeed is None:  # a finished run resumed: no engine was made,
        trainer._save(str(out / "model"))  # the model loaded whole on every process (Trainer.save_model's own path)
        return
    trainer.save_model(str(out / "model"))


def resume_from(trainer, last: Path | None) -> None:
    """trainer.train, continuing from checkpoint `last` (checked by `resume_point`; MoETrainer turns failures
    to load its tensors into one CheckpointError). A checkpoint at max_steps (a finished run resumed) is loaded,
    not trained on: transformers' loop would take one more optimizer step before checking max_steps."""
    if last is not None:
        state = TrainerState.load_from_json(str(last / "trainer_state.json"))
        if state.global_step >= trainer.args.max_steps:
            trainer._load_from_checkpoint(str(last))
            trainer.state = state
            return
    from moekit.training.parallel import lost_process

    with lost_process(Path(trainer.args.output_dir).parent, last_checkpoint):
        trainer.train(resume_from_checkpoint=None if last is None else str(last))
