"""ASR recipes (`task: asr`): a real pretrained Whisper (UME upcycling, or full fine-tuning as the FMFT
baseline), a pretrained transformers CTC checkpoint (wav2vec 2.0, HuBERT, WavLM, MMS, ...: `model.kind:
pretrained_ctc`) or a Transformer-encoder CTC model trained from scratch (dense, Switch or Omni-router), on
a speech corpus written by `moekit speech corpus`. Same Trainer, aux losses, freeze schedules and
checkpoints as the translation recipes; evaluation gives WER/CER per language and voice, the
real-time factor and routing statistics (moekit.eval.asr)."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from moekit._fs import write_text_atomic
from moekit.errors import ConfigError
from moekit.eval.plots import plot_curves, plot_usage
from moekit.routing.permutation import mean_loss
from moekit.speech.data import CTCCollator, ProcessorCTCCollator, WhisperCollator, load_split
from moekit.eval.asr import CTCTranscriber, ProcessorCTCTranscriber, WhisperTranscriber, evaluate_asr
from moekit.speech.text import CharVocab, spoken_text
from moekit.training.args import check_training_args
from moekit.training.recipe import ASRRecipe
from moekit.training.common import (adapt, check_base, evaluation_model, make_trainer, recipe_inputs, resume_from,
                                    run_directory, save_final, write_run_files)

VOCAB_FILE = "ctc_vocab.json"


class Speech:
    """What a run needs besides the model: the training collator, the evaluator's transcriber, and how to
    save the tokenizer/feature extractor or CTC vocabulary next to the model."""

    def __init__(self, collator, transcriber, save):
        self.collator, self.transcriber, self.save = collator, transcriber, save


def _whisper(recipe: ASRRecipe) -> tuple[nn.Module, Speech]:
    from transformers import WhisperFeatureExtractor

    from moekit.assets import resolve_model
    from moekit.checkpoint.dense import load_tokenizer
    from moekit.methods.base import load_base

    m = recipe.model
    path = resolve_model(m.path)  # a dense Whisper, or the recipe's upcycled checkpoint of it (trained as it is)
    model, tok = load_base(recipe, path), load_tokenizer(path, m.trust_remote_code)
    if tok is None:
        raise ConfigError(f"{path} has no tokenizer files; a Whisper recipe needs Whisper's tokenizer")
    multi = bool(getattr(model.generation_config, "is_multilingual", False))
    d = recipe.data

    def save(folder: Path) -> None:
        tok.save_pretrained(folder)
        WhisperFeatureExtractor.from_pretrained(path).save_pretrained(folder)

    return model, Speech(WhisperCollator(tok, multi, d.spec_augment, d.seed),
                         WhisperTranscriber(tok, multi, recipe.eval.max_new_tokens), save)


def _ctc(recipe: ASRRecipe, train: list) -> tuple[nn.Module, Speech]:
    from moekit.speech.ctc import CTCConfig, CTCEncoderForASR

    a, d = recipe.model.ctc, recipe.data
    vocab = CharVocab.build(spoken_text(u.text) for u in train)
    torch.manual_seed(recipe.train.seed)
    model = CTCEncoderForASR(CTCConfig(
        input_dim=80 * a.stack, hidden_size=a.hidden_size, num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        intermediate_size=a.intermediate_size, hidden_act=a.act, dropout=a.dropout, vocab_size=len(vocab)))

    def save(folder: Path) -> None:
        (folder / VOCAB_FILE).write_text(vocab.to_json())

    return model, Speech(CTCCollator(vocab, a.stack, d.spec_augment, d.seed), CTCTranscriber(vocab, a.stack), save)


def _pretrained_ctc(recipe: ASRRecipe, train: list) -> tuple[nn.Module, Speech]:
    from moekit.assets import resolve_model
    from moekit.methods.base import load_base

    m = recipe.model
    path = resolve_model(m.path)  # a transformers CTC checkpoint, or the recipe's upcycled checkpoint of it
    processor = _ctc_processor(path, m.trust_remote_code)
    collator = ProcessorCTCCollator(processor)
    collator.check(train)  # before the weights load
    return load_base(recipe, path), Speech(collator, ProcessorCTCTranscriber(processor), processor.save_pretrained)


def _ctc_processor(path: Path, trust_remote_code: bool = False):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} has no processor transformers can load (a CTC checkpoint keeps its feature "
                          f"extractor and tokenizer beside it): {' '.join(str(e).split())[:300]}") from None


def build(recipe: ASRRecipe, train: list) -> tuple[nn.Module, Speech]:
    """The model the recipe trains (Whisper, a transformers CTC checkpoint or a fresh CTC model, adapted by its
    training method, e.g. upcycled for method=moe) and its Speech."""
    kind = recipe.model.kind
    model, speech = (_whisper(recipe) if kind == "whisper" else _pretrained_ctc(recipe, train)
                     if kind == "pretrained_ctc" else _ctc(recipe, train))
    return adapt(recipe, model), speech


class LossCallback(TrainerCallback):
    """Every `eval_every` steps: teacher-forced loss per language on a fixed test subset (eval_<lang>_loss)."""

    def __init__(self, recipe: ASRRecipe, speech: Speech, test: dict):
        n, bs = recipe.eval.loss_per_lang, recipe.eval.batch_size
        self.every, self.trainer = recipe.train.eval_every, None
        self.batches = {lang: [speech.transcriber.batch(u[i:i + bs]) for i in range(0, min(n, len(u)), bs)]
                        for lang, u in test.items()}

    def on_step_end(self, args, state, control, model=None, **kw):
        if not self.every or state.global_step % self.every or not (state.is_world_process_zero or self.trainer.sharded):
            return  # sharded (ZeRO-3, FSDP2, EP): every rank runs the forwards
        was = model.training
        model.eval()
        logs = {f"eval_{lang}_loss": mean_loss(model, b) for lang, b in self.batches.items()}
        model.train(was)
        should_log = control.should_log  # Trainer.log clears it; keep this step's training log
        self.trainer.log(logs)
        control.should_log = should_log


def train_asr(recipe: ASRRecipe, overwrite: bool = False, resume: bool = False, callbacks=(), inputs=()):
    """Train an ASR recipe and evaluate the result (results.json/csv, loss.png, usage.png in `out`); the run
    lives in a working directory until it has finished (moekit.training.common.run_directory)."""
    check_training_args(recipe)
    check_base(recipe)
    with run_directory(recipe, overwrite, resume, [*recipe_inputs(recipe), *inputs]) as (work, last):
        return _train_asr(work, last, callbacks, final_out=recipe.out)


def _train_asr(recipe: ASRRecipe, last: Path | None, callbacks, final_out: str):
    out = Path(recipe.out)
    train, test = load_split(recipe.data)
    model, speech = build(recipe, train)
    losses = LossCallback(recipe, speech, test)
    trainer = make_trainer(recipe, model, train, speech.collator, [losses, *callbacks])
    losses.trainer = trainer
    resume_from(trainer, last)
    save_final(trainer, out)
    if trainer.is_world_process_zero():
        speech.save(out / "model")
        model = evaluation_model(recipe, trainer, out / "model")
        write_run_files(recipe, trainer, final_out, model)
        trainer.results = report(recipe, model, speech, test, trainer.state.log_history)
    return trainer


def report(recipe: ASRRecipe, model: nn.Module, speech: Speech, test: dict, log_history: list[dict]) -> dict:
    e, out = recipe.eval, Path(recipe.out)
    results = evaluate_asr(model, speech.transcriber, test, e.batch_size, e.routing_stack, tuple(e.permutation),
                           e.routing_batches)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(["language", "n", "wer", "cer"])
    w.writerows([lang, r["n"], r["wer"], r["cer"]] for lang, r in results["languages"].items())
    w.writerow(["avg", sum(r["n"] for r in results["languages"].values()), results["avg"]["wer"],
                results["avg"]["cer"]])
    write_text_atomic(out / "results.csv", table.getvalue())
    plot_curves(log_history, out)
    if "routing" in results:
        r = results["routing"]
        plot_usage(dict(zip(r["layers"], r["usage"])), out / "usage.png", title=f"{recipe.name}: expert usage")
    return results


def load_speech(recipe: ASRRecipe, folder: Path) -> Speech:
    """The Speech of a finished run's model directory (for `moekit evaluate`)."""
    if recipe.model.kind == "whisper":
        from transformers import GenerationConfig

        from moekit.checkpoint.dense import load_tokenizer

        tok = load_tokenizer(folder)
        multi = bool(getattr(GenerationConfig.from_pretrained(folder), "is_multilingual", False))
        return Speech(None, WhisperTranscriber(tok, multi, recipe.eval.max_new_tokens), None)
    if recipe.model.kind == "pretrained_ctc":
        return Speech(None, ProcessorCTCTranscriber(_ctc_processor(folder, recipe.model.trust_remote_code)), None)
    if not (folder / VOCAB_FILE).is_file():
        raise ConfigError(f"{folder} has no {VOCAB_FILE} (the CTC model's characters)")
    return Speech(None, CTCTranscriber(CharVocab.from_json((folder / VOCAB_FILE).read_text()),
                                       recipe.model.ctc.stack), None)
