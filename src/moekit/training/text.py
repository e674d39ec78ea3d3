"""Text recipes (`task: text`): causal-LM training on local data read through `datasets` (moekit.data.hf:
raw text packed into blocks, Alpaca instructions, chat conversations, translation records), with any method
(moe, dense, lora, simoe). Evaluation: held-out loss and perplexity over the labelled tokens of the test split
(logged as eval_loss every train.eval_every steps, and at the end; moekit.eval.text), expert usage and diversity
for MoE models, parameter counts."""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from moekit.assets import resolve_model
from moekit.data.hf import load_text_data
from moekit.data.parallel import TranslationCollator
from moekit.eval.text import report_text
from moekit.eval.translation import examples_loss
from moekit.training.recipe import TextRecipe
from moekit.methods.base import load_base
from moekit.training.common import (adapt, evaluation_model, load_tokenizer, make_trainer, resume_from, save_final,
                                 write_run_files)


class LossCallback(TrainerCallback):
    """Every `eval_every` steps: the held-out loss, logged as eval_loss (main process)."""

    def __init__(self, recipe: TextRecipe, test: list[dict]):
        self.recipe, self.test, self.trainer = recipe, test, None

    def on_step_end(self, args, state, control, model=None, **kw):
        every = self.recipe.train.eval_every
        if not every or state.global_step % every or not (state.is_world_process_zero or self.trainer.sharded):
            return  # sharded (ZeRO-3, FSDP2, EP): every rank runs the forwards
        should_log = control.should_log  # Trainer.log clears it; keep this step's training log
        self.trainer.log({"eval_loss": examples_loss(model, self.test, self.recipe.eval.batch_size)})
        control.should_log = should_log


def train_text(recipe: TextRecipe, last: Path | None, callbacks, final_out: str):
    """Train a text recipe inside its run directory (moekit.training.run.train) and evaluate it."""
    out = Path(recipe.out)
    path = resolve_model(recipe.model.path)
    tok = load_tokenizer(path, recipe.model.trust_remote_code)
    train, test = load_text_data(recipe.data, tok)
    model = adapt(recipe, load_base(recipe, path), tok)
    losses = LossCallback(recipe, test)
    trainer = make_trainer(recipe, model, train, TranslationCollator(tok.pad_token_id), [losses, *callbacks])
    losses.trainer = trainer
    resume_from(trainer, last)
    save_final(trainer, out)
    trainer.results = {}
    if trainer.is_world_process_zero():
        tok.save_pretrained(out / "model")
        model = evaluation_model(recipe, trainer, out / "model")
        write_run_files(recipe, trainer, final_out, model)
        trainer.results = report_text(recipe, model, test, trainer.state.log_history)
    return trainer
