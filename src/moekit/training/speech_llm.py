"""Speech-LLM recipes (`task: speech_llm`): a speech-LLM (moekit.speech.llm: Qwen3-ASR as in SPRI §3.2, Qwen2-Audio)
fine-tuned on speech translation and/or transcription data as users have it (moekit.speech.s2tt: CoVoST 2, the
Hugging Face datasets form, Europarl-ST), with any method (moe: upcycled, e.g. SPRI with its two-stage schedule;
dense: the fine-tuning baseline). Its decoder's FFNs are the only modules upcycling changes (the audio encoder and
adapter hold no decoder FFN); model.freeze_audio keeps those two frozen in every stage. Evaluation:
moekit.eval.s2tt. The run directory holds the trained model with its processor (loadable by plain transformers
for method=dense, by moekit for an MoE), results.json/csv, data.json (rows read, kept and left out), plots."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from transformers import TrainerCallback

from moekit._fs import write_text_atomic
from moekit.assets import resolve_model
from moekit.checkpoint.dense import load_config
from moekit.eval.plots import plot_curves, plot_usage
from moekit.eval.s2tt import CSV_COLUMNS, batches, check_comet, evaluate_speech_llm, result_rows
from moekit.eval.usage import inference
from moekit.methods.base import load_base
from moekit.routing.permutation import mean_loss
from moekit.speech.llm import Family, SpeechLLMInputs, audio_paths, family_of, load_processor
from moekit.speech.s2tt import load_s2tt
from moekit.training.args import check_training_args
from moekit.training.common import (adapt, evaluation_model, make_trainer, recipe_inputs, resume_from, run_directory,
                                 save_final, write_run_files)
from moekit.training.recipe import SpeechLLMRecipe


class LossCallback(TrainerCallback):
    """Every `eval_every` steps: teacher-forced target loss per direction on a fixed test subset (eval_<d>_loss)."""

    def __init__(self, recipe: SpeechLLMRecipe, inputs: SpeechLLMInputs, test: dict):
        self.every, self.trainer, self.inputs, self.bs = recipe.train.eval_every, None, inputs, recipe.eval.batch_size
        self.rows = {d: rows[:recipe.eval.loss_per_direction] for d, rows in test.items()}

    def on_step_end(self, args, state, control, model=None, **kw):
        if not self.every or state.global_step % self.every or not (state.is_world_process_zero or self.trainer.sharded):
            return  # sharded (ZeRO-3, FSDP2, EP): every rank runs the forwards
        with inference(model):
            logs = {f"eval_{d}_loss": mean_loss(model, batches(self.inputs, rows, self.bs)) for d, rows in self.rows.items()}
        should_log = control.should_log  # Trainer.log clears it; keep this step's training log
        self.trainer.log(logs)
        control.should_log = should_log


def train_speech_llm(recipe: SpeechLLMRecipe, overwrite: bool = False, resume: bool = False, callbacks=(), inputs=()):
    """Train a speech-LLM recipe and evaluate the result; everything that can be checked (the model is a speech-LLM,
    its processor, the data and its bad rows, COMET) is checked before the run directory is made."""
    check_training_args(recipe)
    path = resolve_model(recipe.model.path)
    prepared = (path, *prepare(recipe, path))
    with run_directory(recipe, overwrite, resume, [*recipe_inputs(recipe), *inputs]) as (work, last):
        return _train(work, last, prepared, callbacks, final_out=recipe.out)


def prepare(recipe: SpeechLLMRecipe, folder: Path):
    """(family, SpeechLLMInputs, training rows, test rows, data report) for the model in `folder`: nothing loaded but
    its config and processor, and the data."""
    family, inputs = model_inputs(recipe, folder)
    if recipe.eval.generate:
        check_comet(recipe.eval.comet)
    return (family, inputs, *load_s2tt(recipe.data, inputs.prompt_tokens))


def model_inputs(recipe: SpeechLLMRecipe, folder: Path) -> tuple[Family, SpeechLLMInputs]:
    """The speech-LLM family of the model in `folder` and its SpeechLLMInputs (its config and processor read)."""
    m = recipe.model
    family = family_of(load_config(folder, m.trust_remote_code), str(folder))
    return family, SpeechLLMInputs(load_processor(folder, m.trust_remote_code), family, m.instruction)


def evaluate_run(recipe: SpeechLLMRecipe, run_dir: Path, device: str) -> dict:
    """Evaluate a finished run's model again (`moekit evaluate`), writing its results and plots anew."""
    from moekit.methods import method

    folder = run_dir / "model"
    _, inputs, _, test, _ = prepare(recipe, folder)
    log = run_dir / "log_history.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    model = method(recipe.method).load_trained(recipe, folder).to(device)
    return report(recipe, model, inputs, test, history)


def audio_frozen(recipe: SpeechLLMRecipe, model, family) -> SpeechLLMRecipe:
    """The recipe with the model's audio encoder and adapter under freeze.frozen where model.freeze_audio says."""
    if not recipe.model.freeze_audio:
        return recipe
    return recipe.model_copy(update={"freeze": recipe.freeze.model_copy(update={
        "frozen": [*recipe.freeze.frozen, *audio_paths(model, family)]})})


def plan_setting(recipe: SpeechLLMRecipe, model, folder: Path) -> tuple[SpeechLLMRecipe, int, list[str]]:
    """What the dry run (moekit.training.plan) needs besides the model it would train (`model`, on the meta device):
    the recipe with the audio modules frozen as in training (`audio_frozen`), the longest decoder sequence the data
    filters let through (data.max_prompt_tokens, the audio placeholder expanded to a clip of data.max_seconds), and
    a note on the audio encoder and adapter, whose parameters the plan counts and whose activations it does not."""
    m, d = recipe.model, recipe.data
    family, inputs = model_inputs(recipe, folder)
    audio = audio_paths(model, family)
    n = sum(p.numel() for path in audio for p in model.get_submodule(path).parameters())
    frames = inputs.audio_tokens(d.max_seconds)
    notes = [f"sequence: at most {d.max_prompt_tokens - 1 + frames} decoder tokens, data.max_prompt_tokens="
             f"{d.max_prompt_tokens} with the audio placeholder expanded to {frames} audio tokens for a clip of "
             f"data.max_seconds={d.max_seconds:g}",
             f"audio encoder and adapter ({', '.join(audio)}): {n:,} parameters, in the counts above "
             f"({'frozen: model.freeze_audio' if m.freeze_audio else 'trained as the stages say'}); their activations "
             "are not estimated (the per-device totals leave them out)"]
    return audio_frozen(recipe, model, family), d.max_prompt_tokens - 1 + frames, notes


def _train(recipe: SpeechLLMRecipe, last: Path | None, prepared, callbacks, final_out: str):
    path, family, inputs, train, test, data_report = prepared
    out = Path(recipe.out)
    model = load_base(recipe, path)
    recipe = audio_frozen(recipe, model, family)
    model = adapt(recipe, model)
    losses = LossCallback(recipe, inputs, test)
    trainer = make_trainer(recipe, model, train, inputs, [losses, *callbacks])
    losses.trainer = trainer
    resume_from(trainer, last)
    save_final(trainer, out)
    trainer.results = {}
    if trainer.is_world_process_zero():
        inputs.processor.save_pretrained(out / "model")
        model = evaluation_model(recipe, trainer, out / "model")
        write_run_files(recipe, trainer, final_out, model)
        write_text_atomic(out / "data.json", json.dumps(data_report.as_dict(), indent=2) + "\n")
        trainer.results = report(recipe, model, inputs, test, trainer.state.log_history)
    return trainer


def report(recipe: SpeechLLMRecipe, model, inputs: SpeechLLMInputs, test: dict, log_history: list[dict]) -> dict:
    """evaluate_speech_llm with the recipe's settings; results.json/csv, loss.png and usage.png in the run."""
    e, out = recipe.eval, Path(recipe.out)
    results = evaluate_speech_llm(model, inputs, test, e.batch_size, e.max_new_tokens, e.generate, e.comet,
                                  e.comet_batch_size)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    table = io.StringIO()
    w = csv.DictWriter(table, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(result_rows(results))
    write_text_atomic(out / "results.csv", table.getvalue())
    plot_curves(log_history, out)
    if results["usage"]:
        plot_usage(results["usage"], out / "usage.png", title=f"{recipe.name}: expert usage on the test sets")
    return results
