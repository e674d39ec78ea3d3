"""Run a recipe: load -> (upcycle | LoRA | dense) -> HF Trainer -> final model + evaluation."""
from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import TrainerCallback

from moekit.assets import resolve_model
from moekit.data.instruct import load_instruct_pairs
from moekit.data.parallel import TranslationCollator, load_pairs
from moekit.errors import ConfigError
from moekit.eval.instruct import add_rouge
from moekit.eval.translation import DenseReference, direction_loss, encode_pairs, evaluate_run, write_results
from moekit.eval.plots import plot_curves, plot_usage
from moekit.methods.base import load_base
from moekit.training.args import check_training_args
from moekit.training.parallel import is_main
from moekit.training.recipe import SpeechLLMRecipe, TextRecipe, TranslationRecipe
from moekit.training.trainer import MoETrainer
from moekit.training.common import (adapt, check_base, evaluation_model, load_tokenizer, make_trainer, recipe_inputs,
                                 resume_from, run_directory, save_final, write_run_files)


def load_data(recipe: TranslationRecipe) -> tuple[list, dict[str, list]]:
    """(training pairs, {direction or task: test pairs}) of a translation or instruction recipe."""
    return load_instruct_pairs(recipe.data) if recipe.task == "instruct" else load_pairs(recipe.data)


def kl_examples(recipe: TranslationRecipe, test: dict[str, list], tok) -> list[dict]:
    """The fixed held-out subset for KL(dense ‖ model): round-robin over directions."""
    d, n = recipe.data, recipe.eval.kl_examples
    pairs = [p for group in zip(*test.values()) for p in group][:n]
    return encode_pairs(pairs, tok, d.template, d.max_length)


def dense_reference(recipe: TranslationRecipe, dense: nn.Module, tok, test, saved: Path | None) -> DenseReference | None:
    """The dense model's log-probs on the KL subset, computed once and kept in the run directory (`saved`:
    the directory of the run being resumed, whose reference is reused). `dense` is the model as loaded: for a run
    from an upcycled checkpoint (moekit.methods.moe.MoE.prepared), the checkpoint, the dense model not being at hand."""
    out = Path(recipe.out)
    if not recipe.eval.kl_examples:
        return None
    ref = (DenseReference.load(saved) if saved is not None and (saved / DenseReference.FILE).is_file() else
           DenseReference.compute(dense, kl_examples(recipe, test, tok), recipe.eval.batch_size))
    if is_main():
        ref.save(out)
    return ref


class EvalCallback(TrainerCallback):
    """Every `eval_every` steps: KL(dense ‖ model) and per-direction target loss, logged as
    eval_kl / eval_<lang>_loss (SPRI A.1: KL tracked across training)."""

    def __init__(self, recipe: TranslationRecipe, tok, test: dict[str, list], ref: DenseReference | None):
        self.recipe, self.tok, self.test, self.ref, self.trainer = recipe, tok, test, ref, None

    def on_step_end(self, args, state, control, model=None, **kw):
        every = self.recipe.train.eval_every
        if not every or state.global_step % every or not (state.is_world_process_zero or self.trainer.sharded):
            return  # sharded (ZeRO-3, FSDP2, EP): every rank runs the forwards, whose collectives need them all
        d, bs = self.recipe.data, self.recipe.eval.batch_size
        logs = {f"eval_{lang}_loss": direction_loss(model, self.tok, pairs, d.template, d.max_length, bs)
                for lang, pairs in self.test.items()}
        if self.ref is not None:
            logs["eval_kl"] = self.ref.kl(model, bs)
        should_log = control.should_log  # Trainer.log clears it; keep this step's training log
        self.trainer.log(logs)
        control.should_log = should_log


def finish(recipe: TranslationRecipe, trainer, tok, test, ref, final_out: str) -> dict:
    """Save the final model and evaluate it (main process; from the saved model where no rank holds it whole):
    results.json/csv and PNG plots in `out`."""
    out = Path(recipe.out)
    save_final(trainer, out)
    if not trainer.is_world_process_zero():
        return {}
    tok.save_pretrained(out / "model")
    model = evaluation_model(recipe, trainer, out / "model")
    write_run_files(recipe, trainer, final_out, model)
    return report(recipe, model, tok, test, ref, trainer.state.log_history)


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


def train(recipe: TranslationRecipe | TextRecipe | SpeechLLMRecipe, overwrite: bool = False, resume: bool = False, callbacks=(),
          final_out: str | None = None, inputs: list[Path] = ()) -> MoETrainer:
    """Train `recipe` (any task but asr: moekit.training.asr.train_asr; moekit.train takes every task) and
    evaluate the result; with `resume`, continue from the last checkpoint
    (see `run_directory` for where the run lives meanwhile). `final_out`: where the run will finally live, as
    recorded in its recipe.yaml, if not `recipe.out` (`moekit demo` builds its runs inside its own output).
    `inputs`: files read besides the recipe's own (e.g. the recipe file), which `out` may not be or contain.
    `recipe.model.path`: the base model, or for method=moe also its checkpoint upcycled as the recipe says."""
    check_base(recipe)
    if recipe.task == "speech_llm":  # checks its data before it makes the run directory
        from moekit.training.speech_llm import train_speech_llm

        return train_speech_llm(recipe, overwrite, resume, callbacks, inputs)
    check_training_args(recipe)
    run = _train
    if recipe.task == "text":  # local data through `datasets`
        from moekit.training.text import train_text as run
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


