"""Run a recipe: load -> (upcycle | LoRA | dense) -> HF Trainer -> final model + evaluation."""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, TrainerState

from moekit._fs import PARTIAL, output, read_small, remove
from moekit.assets import model_inputs, resolve_model
from moekit.checkpoint.card import write_model_card
from moekit.data.instruct import load_instruct_pairs
from moekit.data.parallel import TranslationCollator, load_pairs
from moekit.errors import CheckpointError, ConfigError, OutputExistsError
from moekit.eval.instruct import add_rouge
from moekit.eval.translation import DenseReference, direction_loss, encode_pairs, evaluate_run, write_results
from moekit.eval.plots import plot_curves, plot_usage
from moekit.io import load_dense
from moekit.methods import method
from moekit.train.args import check_training_args, training_args
from moekit.train.progress import TrainProgress
from moekit.train.recipe import RecipeBase, TranslationRecipe
from moekit.train.trainer import MoETrainer


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The model directory's tokenizer, with a pad token (eos) for batching; it must have an eos token."""
    from moekit.io import load_tokenizer as load

    tok = load(path, trust_remote_code)
    if tok is None:
        raise CheckpointError(f"{path} has no tokenizer files; translation and instruction recipes need one")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {path} has no eos token; translation targets need one")
    return tok


def load_data(recipe: TranslationRecipe) -> tuple[list, dict[str, list]]:
    """(training pairs, {direction or task: test pairs}) of a translation or instruction recipe."""
    return load_instruct_pairs(recipe.data) if recipe.task == "instruct" else load_pairs(recipe.data)


def load_base(recipe: TranslationRecipe, path: Path) -> nn.Module:
    dtype = torch.bfloat16 if recipe.model.dtype == "bfloat16" else torch.float32
    return load_dense(path, recipe.model.allow_pickle, recipe.model.trust_remote_code, dtype)


def adapt(recipe, model: nn.Module, tokenizer=None) -> nn.Module:
    """The model the recipe trains, built by its training method (moekit.methods) from the base model
    (`tokenizer`: for router inits from prompts)."""
    return method(recipe.method).adapt(recipe, model, tokenizer).train()


def build_model(recipe: TranslationRecipe, path: Path) -> nn.Module:
    return adapt(recipe, load_base(recipe, path))


def kl_examples(recipe: TranslationRecipe, test: dict[str, list], tok) -> list[dict]:
    """The fixed held-out subset for KL(dense ‖ model): round-robin over directions."""
    d, n = recipe.data, recipe.eval.kl_examples
    pairs = [p for group in zip(*test.values()) for p in group][:n]
    return encode_pairs(pairs, tok, d.template, d.max_length)


def dense_reference(recipe: TranslationRecipe, dense: nn.Module, tok, test, saved: Path | None) -> DenseReference | None:
    """The dense model's log-probs on the KL subset, computed once and kept in the run directory (`saved`:
    the directory of the run being resumed, whose reference is reused)."""
    out = Path(recipe.out)
    if not recipe.eval.kl_examples:
        return None
    ref = (DenseReference.load(saved) if saved is not None and (saved / DenseReference.FILE).is_file() else
           DenseReference.compute(dense, kl_examples(recipe, test, tok), recipe.eval.batch_size))
    if is_main_process():
        ref.save(out)
    return ref


class EvalCallback(TrainerCallback):
    """Every `eval_every` steps: KL(dense ‖ model) and per-direction target loss, logged as
    eval_kl / eval_<lang>_loss (SPRI A.1: KL tracked across training)."""

    def __init__(self, recipe: TranslationRecipe, tok, test: dict[str, list], ref: DenseReference | None):
        self.recipe, self.tok, self.test, self.ref, self.trainer = recipe, tok, test, ref, None

    def on_step_end(self, args, state, control, model=None, **kw):
        every = self.recipe.train.eval_every
        if not every or state.global_step % every or not state.is_world_process_zero:
            return
        d, bs = self.recipe.data, self.recipe.eval.batch_size
        logs = {f"eval_{lang}_loss": direction_loss(model, self.tok, pairs, d.template, d.max_length, bs)
                for lang, pairs in self.test.items()}
        if self.ref is not None:
            logs["eval_kl"] = self.ref.kl(model, bs)
        should_log = control.should_log  # Trainer.log clears it; keep this step's training log
        self.trainer.log(logs)
        control.should_log = should_log


def write_run_files(recipe: TranslationRecipe, trainer, final_out: str) -> None:
    """recipe.yaml (with the run's real `out`), log_history.json (losses, aux metrics) and README.md (the
    trained model's card) in the run directory."""
    out = Path(recipe.out)
    write_model_card(trainer.accelerator.unwrap_model(trainer.model), out,
                     title=f"moekit training run {recipe.name} ({recipe.method}, {trainer.state.global_step} steps)",
                     extra={"recipe": "recipe.yaml (beside this card)", "model": "model/"})
    (out / "recipe.yaml").write_text(yaml.safe_dump({**recipe.model_dump(mode="json"), "out": final_out},
                                                    sort_keys=False))
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))


def finish(recipe: TranslationRecipe, trainer, tok, test, ref, final_out: str) -> dict:
    """Save the final model and evaluate it (main process): results.json/csv and PNG plots in `out`."""
    out = Path(recipe.out)
    save_final(trainer, out)
    if not trainer.is_world_process_zero():
        return {}
    tok.save_pretrained(out / "model")
    write_run_files(recipe, trainer, final_out)
    return report(recipe, trainer.model, tok, test, ref, trainer.state.log_history)


def evaluate(recipe: TranslationRecipe, model, tok, test, ref) -> dict:
    """Every metric of `evaluate_run` with the recipe's settings, plus ROUGE-L and seen/unseen means for
    instruction recipes."""
    d, e = recipe.data, recipe.eval
    results = evaluate_run(model, tok, test, d.template, ref, d.max_length, e.max_new_tokens, e.batch_size,
                           e.generate)
    if recipe.task == "instruct" and e.generate:
        add_rouge(results, test, d.task_names()[1])
    return results


def report(recipe: TranslationRecipe, model, tok, test, ref, log_history) -> dict:
    """`evaluate`, then results.json/csv and plots in the run directory."""
    out = Path(recipe.out)
    results = evaluate(recipe, model, tok, test, ref)
    write_results(results, out)
    plot_curves(log_history, out)
    if results["usage"]:
        plot_usage(results["usage"], out / "usage.png", title=f"{recipe.name}: expert usage on the test sets")
    return results


def make_trainer(recipe, model: nn.Module, dataset, collator, callbacks: list) -> MoETrainer:
    """MoETrainer for a recipe (any task): its method's callbacks, optimizer and losses, and progress
    (TrainProgress)."""
    m = method(recipe.method)
    trainer = MoETrainer(model=model, args=training_args(recipe, Path(recipe.out)), train_dataset=dataset,
                         data_collator=collator, aux=recipe.aux, callbacks=[*callbacks, *m.callbacks(recipe, model)],
                         optimizers=(m.optimizer(recipe, model), None), method=m)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(TrainProgress)
    return trainer


def recipe_inputs(recipe) -> list[Path]:
    """Every local file or directory a recipe reads (base model, BTX branches, data files, speech corpus):
    the run directory may not be, or contain, any of them."""
    d, init = recipe.data, getattr(getattr(recipe, "moe", None), "init", None)
    sources = [] if init is None else init.source_models()
    paths = [*model_inputs(recipe.model.path), *(p for b in sources for p in model_inputs(b))]
    files = [*getattr(d, "train_files", []), *getattr(d, "test_files", []), getattr(d, "corpus", None)]
    return paths + [Path(f) for f in files if f]


def last_checkpoint(run: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (Trainer writes trainer_state.json last)."""
    folder = run / "checkpoints"
    steps = {int(p.name.removeprefix("checkpoint-")): p for p in folder.glob("checkpoint-*")
             if p.name.removeprefix("checkpoint-").isdigit() and (p / "trainer_state.json").is_file()}
    return steps[max(steps)] if steps else None


def check_checkpoint(last: Path) -> None:
    """A checkpoint to resume from has its optimizer state and a readable trainer_state.json."""
    if not (last / "optimizer.pt").is_file():
        raise CheckpointError(f"cannot resume from {last}: it has no optimizer.pt (an incomplete checkpoint)")
    try:
        json.loads(read_small(last / "trainer_state.json", "trainer state", CheckpointError))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"cannot resume from {last}: trainer_state.json is unreadable ({e})") from None


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
    out = Path(recipe.out)
    partial = out.parent / f".{out.name}{PARTIAL}"
    if resume and (partial.exists() or out.exists()):
        last = resume_point(out, partial, overwrite)
    else:
        last = None
    continues = last is not None and last.parent.parent == partial  # the interrupted run goes on in place
    if last is not None and not continues:  # continuing a finished run replaces it
        overwrite = True
    if last is None and partial.exists() and not overwrite and is_main_process():
        raise OutputExistsError(partial, f"{partial} holds an interrupted run of {out} (resume=True continues it)")
    if not is_main_process():
        yield recipe.model_copy(update={"out": str(partial)}), last
        return
    with output(out, inputs, overwrite, partial=True, keep=lambda work: last_checkpoint(work) is not None,
                what="run directory") as work:
        if not continues:  # a fresh start, or resuming from the finished run: begin empty
            for entry in work.iterdir():
                remove(entry)
        yield recipe.model_copy(update={"out": str(work)}), last


def train(recipe: TranslationRecipe, overwrite: bool = False, resume: bool = False, callbacks=(),
          final_out: str | None = None, inputs: list[Path] = ()) -> MoETrainer:
    """Train `recipe` and evaluate the result; with `resume`, continue from the last checkpoint
    (see `run_directory` for where the run lives meanwhile). `final_out`: where the run will finally live, as
    recorded in its recipe.yaml, if not `recipe.out` (`moekit demo` builds its runs inside its own output).
    `inputs`: files read besides the recipe's own (e.g. the recipe file), which `out` may not be or contain."""
    check_training_args(recipe)
    run = _train
    if recipe.task == "text":  # local data through `datasets`
        from moekit.train.text import train_text as run
    with run_directory(recipe, overwrite, resume, [*recipe_inputs(recipe), *inputs]) as (work, last):
        return run(work, last, callbacks, final_out=final_out or recipe.out)


def _train(recipe: TranslationRecipe, last: Path | None, callbacks, final_out: str) -> MoETrainer:
    path = resolve_model(recipe.model.path)
    tok = load_tokenizer(path, recipe.model.trust_remote_code)
    train_pairs, test = load_data(recipe)
    d = recipe.data
    encoded = encode_pairs(train_pairs, tok, d.template, d.max_length)
    dataset = [e for e in encoded if any(label != -100 for label in e["labels"])]  # target left after truncation
    if not dataset:
        raise ConfigError(f"no training example keeps a target token within data.max_length={d.max_length}")
    model = load_base(recipe, path)
    ref = dense_reference(recipe, model, tok, test, None if last is None else last.parent.parent)  # before adapting
    model = adapt(recipe, model, tok)
    evaluator = EvalCallback(recipe, tok, test, ref)
    trainer = make_trainer(recipe, model, dataset, TranslationCollator(tok.pad_token_id), [evaluator, *callbacks])
    evaluator.trainer = trainer
    resume_from(trainer, last)
    trainer.results = finish(recipe, trainer, tok, test, ref, final_out)
    return trainer


def save_final(trainer, out: Path) -> None:
    """The trained model into `out`/model (the method's format: moekit, SIMoE, a LoRA adapter, save_pretrained).
    `out` is the run's own working directory; a `model` folder already there was left by an attempt stopped
    after saving it (e.g. during evaluation) and resumed, and is replaced."""
    if trainer.is_world_process_zero() and (out / "model").exists():
        remove(out / "model")
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
    trainer.train(resume_from_checkpoint=None if last is None else str(last))
