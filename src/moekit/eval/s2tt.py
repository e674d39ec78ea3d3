"""Evaluation of speech-LLM recipes (`task: speech_llm`), per direction and averaged over the translation directions.

BLEU as Qwen2-Audio's evaluation computes it (QwenLM/Qwen2-Audio eval_audio/evaluate_st.py, read for this): greedy
outputs decoded with skip_special_tokens and no clean-up, `sacrebleu.corpus_bleu(hyps, [refs])` per direction with
tokenize "ja-mecab" for Japanese, "zh" for Chinese and "13a" for every other target (moekit.eval.translation's
bleu_chrf, whose table agrees on every CoVoST 2 target; Japanese needs `moekit[cjk]`); chrF (chrF2) beside it.
COMET (SPRI §3.1: Unbabel/wmt22-comet-da, system score ×100) where eval.comet names a local checkpoint and
`unbabel-comet` is installed (`moekit[comet]`); otherwise the results say "not computed", never a number.
Transcription (direction en) is scored with WER/CER (jiwer) instead. Per direction also the teacher-forced loss on
the target tokens; per run expert usage (teacher-forced on the test rows, audio included), diversity, parameters.
Per test row also its own scores ("per_item": sacreBLEU's sentence BLEU and chrF, or WER and CER), so that two runs
can be compared item by item (bench/spri_s2tt.py commits them); the corpus-level scores do not depend on them.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch import nn

from moekit.errors import ConfigError
from moekit.eval.translation import bleu_chrf, bleu_tokenizer, model_fields, sentence_bleu_chrf
from moekit.eval.usage import inference, usage_counts
from moekit.progress import report
from moekit.routing.permutation import mean_loss
from moekit.speech.llm import SpeechLLMInputs
from moekit.speech.s2tt import SOURCE, Example

NOT_COMPUTED = "not computed"
CSV_COLUMNS = ("direction", "n", "bleu", "chrf", "comet", "wer", "cer", "loss")


def batches(inputs: SpeechLLMInputs, rows: list[Example], batch_size: int) -> Iterator[dict]:
    """Teacher-forced training-form batches of `rows`."""
    return (inputs(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size))


def outputs(model: nn.Module, inputs: SpeechLLMInputs, rows: list[Example], batch_size: int,
            max_new_tokens: int) -> list[str]:
    """Greedy outputs for `rows`, batched (progress: "generating")."""
    out = []
    with inference(model):
        for i in range(0, len(rows), batch_size):
            out += inputs.generate(model, rows[i:i + batch_size], max_new_tokens)
            report("generating", len(out), len(rows))
    return out


def check_comet(path: str | None) -> Path | None:
    """The COMET checkpoint file of eval.comet (a folder with checkpoints/model.ckpt, or the .ckpt), checked before
    any work; None when COMET is not asked for."""
    if path is None:
        return None
    ckpt = Path(path) / "checkpoints" / "model.ckpt" if Path(path).is_dir() else Path(path)
    if not ckpt.is_file():
        raise ConfigError(f"eval.comet: {ckpt} not found (a local Unbabel/wmt22-comet-da download holds "
                          "checkpoints/model.ckpt)")
    try:
        import comet  # noqa: F401
    except ImportError:
        raise ConfigError("eval.comet needs the unbabel-comet package (pip install 'moekit[comet]')") from None
    return ckpt


def comet_score(ckpt: Path, rows: list[Example], hyps: list[str], batch_size: int) -> float:
    """COMET system score ×100 of `hyps` against the rows' targets, with their English transcripts as sources."""
    from comet import load_from_checkpoint

    model = load_from_checkpoint(str(ckpt))
    data = [{"src": e.source, "mt": h, "ref": e.target} for e, h in zip(rows, hyps)]
    return 100 * float(model.predict(data, batch_size=batch_size, gpus=0, progress_bar=False).system_score)


def _scores(rows: list[Example], hyps: list[str], comet: Path | None, batch_size: int) -> tuple[dict, dict]:
    """One direction's corpus-level scores and its per-item ones (a list per metric, in row order)."""
    refs = [e.target for e in rows]
    if rows[0].tgt == SOURCE:
        import jiwer

        return ({"wer": jiwer.wer(refs, hyps), "cer": jiwer.cer(refs, hyps)},
                {"wer": [jiwer.wer(r, h) for r, h in zip(refs, hyps)],
                 "cer": [jiwer.cer(r, h) for r, h in zip(refs, hyps)]})
    bleu, chrf = bleu_chrf(hyps, refs, rows[0].tgt)
    return ({"bleu": bleu, "chrf": chrf,
             "comet": NOT_COMPUTED if comet is None else comet_score(comet, rows, hyps, batch_size)},
            sentence_bleu_chrf(hyps, refs, rows[0].tgt))


def _average(directions: dict[str, dict]) -> dict:
    keys = ("bleu", "chrf", "comet", "loss")
    rows = [r for d, r in directions.items() if d != SOURCE]
    avg = {k: sum(r[k] for r in rows) / len(rows) for k in keys
           if rows and all(isinstance(r.get(k), float) for r in rows)}
    if rows and any(r.get("comet") == NOT_COMPUTED for r in rows):
        avg["comet"] = NOT_COMPUTED
    return avg


def evaluate_speech_llm(model: nn.Module, inputs: SpeechLLMInputs, test: dict[str, list[Example]],
                        batch_size: int = 8, max_new_tokens: int = 256, generate: bool = True,
                        comet: str | None = None, comet_batch_size: int = 16) -> dict:
    """Every metric of a speech-LLM run (see the module doc): {"directions": {d: {n, loss, bleu, chrf, comet | wer,
    cer}}, "avg" (translation directions), "usage", "usage_by_direction", "diversity", "diversity_init", "params",
    "bleu_tokenize", "outputs", "per_item": {d: {metric: one score per test row, in row order}} (sentence BLEU and
    chrF, or WER and CER, of each row alone: what a paired comparison of two runs over the test items needs)}."""
    ckpt = check_comet(comet) if generate else None
    tokenize = {d: bleu_tokenizer(d) for d in test if d != SOURCE} if generate else {}  # fail before the work
    directions, outs, counts, items = {}, {}, {}, {}
    for d, rows in test.items():
        directions[d] = {"n": len(rows)}
        with inference(model):
            directions[d]["loss"] = mean_loss(model, batches(inputs, rows, batch_size))
        counts[d] = usage_counts(model, batches(inputs, rows, batch_size))
        if generate:
            outs[d] = outputs(model, inputs, rows, batch_size, max_new_tokens)
            corpus, items[d] = _scores(rows, outs[d], ckpt, comet_batch_size)
            directions[d].update(corpus)
    return {"directions": directions, "avg": _average(directions), **model_fields(model, counts, tokenize),
            "outputs": outs, "per_item": items}


def result_rows(results: dict) -> list[dict]:
    """One row per direction and the "avg" row (CSV_COLUMNS)."""
    return [{"direction": d, **r} for d, r in [*results["directions"].items(), ("avg", results["avg"])]]
