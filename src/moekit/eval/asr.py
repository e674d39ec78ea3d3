"""ASR evaluation: greedy transcripts (CTC best path; Whisper `generate` with language and task set),
WER/CER after Whisper's normalizer per language, voice family and voice, the real-time factor, and
for MoE models the routing statistics of Omni-router (Gu et al. 2025): Cramér's V between adjacent
layers' top-1 choices (Figs. 3-4), per-token routing entropy (Fig. 5) and the expert-permutation test
(Fig. 6)."""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from moekit.routing.sites import param_counts
from moekit.moe.layer import moe_layers
from moekit.progress import report
from moekit.routing.capture import RoutingCapture
from moekit.routing.permutation import permutation_test, permuted
from moekit.routing.sites import find_sites
from moekit.routing.stats import adjacent_association, entropy, expert_usage, token_routing_entropy
from moekit.speech.corpus import Utterance
from moekit.speech.data import CTCCollator, ProcessorCTCCollator, WhisperCollator
from moekit.speech.text import CharVocab, error_rates


class CTCTranscriber:
    """Best-path decoding of a CTC model (Graves et al. 2006): argmax per frame, repeats collapsed, blanks dropped."""

    def __init__(self, vocab: CharVocab, stack: int = 4):
        self.vocab, self.batch = vocab, CTCCollator(vocab, stack)

    @torch.no_grad()
    def transcribe(self, model: nn.Module, utts: list[Utterance]) -> list[str]:
        b = self.batch(utts)
        feats, mask = b["input_features"].to(model.device), b["attention_mask"].to(model.device)
        best = model(input_features=feats, attention_mask=mask).logits.argmax(-1).cpu()  # (B, T')
        return [self.vocab.decode_ctc(row[:n].tolist()) for row, n in zip(best, b["attention_mask"].sum(-1))]

    blank = 0  # CharVocab's blank id

    @staticmethod
    def frame_mask(batch: dict, model: nn.Module) -> torch.Tensor:
        return batch["attention_mask"]  # (B, T')

    @staticmethod
    def frame_tokens(out) -> torch.Tensor:
        """(B, T') each frame's best-path CTC label (Fig. 5's tokens)."""
        return out.logits.argmax(-1).cpu()


class ProcessorCTCTranscriber:
    """Best-path decoding of a transformers CTC checkpoint (wav2vec 2.0 and its kin, Parakeet): argmax per frame
    over the frames of each utterance, then its tokenizer's CTC decoding (repeats grouped, its pad token as the blank,
    word delimiters or word pieces joined into words)."""

    def __init__(self, processor):
        self.batch = ProcessorCTCCollator(processor)
        self.tok = processor.tokenizer
        self.blank = self.tok.pad_token_id

    @torch.no_grad()
    def transcribe(self, model: nn.Module, utts: list[Utterance]) -> list[str]:
        b = self.batch(utts)
        del b["labels"]
        best = model(**{k: v.to(model.device) for k, v in b.items()}).logits.argmax(-1).cpu()  # (B, T')
        lengths = self.frame_mask(b, model).sum(-1)
        return [self.tok.decode(row[:n].tolist()).strip() for row, n in zip(best, lengths)]

    @staticmethod
    def frame_mask(batch: dict, model: nn.Module) -> torch.Tensor:
        """(B, T') the encoder frames of each utterance, from its samples (or feature frames) by the model's own
        length rule (wav2vec 2.0's feature encoder, or Parakeet's subsampling); without an attention mask
        (wav2vec 2.0 base's feature extractor returns none: its input is zero-padded) every frame counts."""
        x = batch.get("input_values", batch.get("input_features"))
        B, T = x.shape[:2]
        lengths = batch["attention_mask"].sum(-1) if "attention_mask" in batch else torch.full((B,), T)
        rule = getattr(model, "_get_feat_extract_output_lengths", None) or model._get_subsampling_output_length
        frames, total = rule(lengths), int(rule(torch.tensor([T]))[0])  # (B,), T'
        return (torch.arange(total)[None, :] < frames[:, None]).long()

    frame_tokens = staticmethod(CTCTranscriber.frame_tokens)


class WhisperTranscriber:
    """Greedy `generate` (no sampling, one beam); multilingual models get language and task="transcribe"."""

    def __init__(self, tokenizer, multilingual: bool, max_new_tokens: int = 96):
        self.tok, self.multilingual, self.max_new_tokens = tokenizer, multilingual, max_new_tokens
        self.batch = WhisperCollator(tokenizer, multilingual)

    @torch.no_grad()
    def transcribe(self, model: nn.Module, utts: list[Utterance]) -> list[str]:
        feats = self.batch(utts)["input_features"].to(model.device)  # (B, 80, 3000)
        langs = {u.lang for u in utts}
        kw = {"language": langs.pop(), "task": "transcribe"} if self.multilingual and len(langs) == 1 else {}
        out = model.generate(input_features=feats, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens,
                             **kw)
        return [t.strip() for t in self.tok.batch_decode(out, skip_special_tokens=True)]

    blank = -1

    @staticmethod
    def frame_tokens(out) -> None:
        return None  # encoder frames carry no token

    @staticmethod
    def frame_mask(batch: dict, model: nn.Module) -> torch.Tensor:
        """Every encoder position is real: Whisper hears 30 s windows, padded with silence."""
        return torch.ones(batch["input_features"].shape[0], model.config.max_source_positions, dtype=torch.long)


def _chunks(items: list, n: int) -> list[list]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _pool(rows: list[dict]) -> dict:
    """Corpus-level rates over several `error_rates` results (edits summed, references summed)."""
    words, chars = sum(r["words"] for r in rows), sum(r["chars"] for r in rows)
    return {"wer": sum(r["wer"] * max(r["words"], 1) for r in rows) / max(words, 1),
            "cer": sum(r["cer"] * max(r["chars"], 1) for r in rows) / max(chars, 1),
            "n": sum(r["n"] for r in rows), "words": words, "chars": chars}


def transcribe_all(model, transcriber, test: dict[str, list[Utterance]], batch_size: int) -> tuple[dict, float]:
    """({language: hypotheses}, decoding seconds); one language per batch (Whisper's language token). Progress:
    "transcribing" per batch (moekit.progress)."""
    was = model.training
    model.eval()
    t0, hyps = time.perf_counter(), {}
    try:
        for lang, utts in test.items():
            hyps[lang] = []
            for chunk in _chunks(utts, batch_size):
                hyps[lang] += transcriber.transcribe(model, chunk)
                report("transcribing", len(hyps[lang]), len(utts), lang)
    finally:
        model.train(was)
    return hyps, time.perf_counter() - t0


def error_table(test: dict[str, list[Utterance]], hyps: dict[str, list[str]]) -> dict:
    """WER/CER per language, unweighted mean over languages ("avg"), and pooled per voice family and voice."""
    per_lang = {lang: error_rates([u.text for u in utts], hyps[lang], lang) for lang, utts in test.items()}
    groups: dict[str, dict[str, list[dict]]] = {"families": defaultdict(list), "voices": defaultdict(list)}
    for lang, utts in test.items():
        for u, h in zip(utts, hyps[lang]):
            row = error_rates([u.text], [h], lang)
            groups["families"][u.family].append(row)
            groups["voices"][u.voice].append(row)
    return {"languages": per_lang,
            "avg": {k: sum(r[k] for r in per_lang.values()) / len(per_lang) for k in ("wer", "cer")},
            **{name: {key: _pool(rows) for key, rows in g.items()} for name, g in groups.items()}}


@torch.no_grad()
def routing_report(model: nn.Module, transcriber, batches: list[dict], stack: str | None, ps: list[float],
                   seed: int = 0) -> dict:
    """Over teacher-forced `batches`, for the encoder MoE layers matching `stack`: adjacent-layer Cramér's V
    (Omni-router Figs. 3-4), per-layer usage entropy, and per-token routing entropy of the 100 most frequent
    tokens (Fig. 5; a CTC frame's token is its best-path label, blanks left out; Whisper's encoder frames
    have none, so there it is None); and over every MoE layer the permutation test's loss change (the
    teacher-forced companion of Fig. 6's WER change)."""
    model.eval()
    with RoutingCapture(model, layers=stack) as cap:
        for b in batches:
            out = model(**{k: v.to(model.device) for k, v in b.items()})
            cap.record(transcriber.frame_tokens(out), transcriber.frame_mask(b, model), language="all")
    trace = cap.trace()
    v, _ = adjacent_association(trace)
    usage = expert_usage(trace)  # (L, E)
    tokens, token_h = token_routing_entropy(trace, 100, exclude=(-1, transcriber.blank))
    perm = permutation_test(model, batches, ps, seed=seed)
    return {"layers": trace.layers, "cramers_v": v.tolist(), "usage": usage.tolist(),
            "usage_entropy": entropy(usage).tolist(),
            "token_entropy": token_h.mean(1).tolist() if len(tokens) else None, "token_entropy_tokens": len(tokens),
            "permutation": {"base": perm.base, "deltas": {str(p): d for p, d in perm.deltas.items()}}}


def permuted_wer(model: nn.Module, transcriber, test: dict[str, list[Utterance]], batch_size: int,
                 ps: list[float], seed: int = 0) -> dict[str, float]:
    """Omni-router Fig. 6: the relative WER change (%) when each token's experts are replaced by random ones
    with probability p, {p: 100 · (WER_p − WER) / WER} on `test` (greedy decoding)."""
    base = error_table(test, transcribe_all(model, transcriber, test, batch_size)[0])["avg"]["wer"]
    out = {}
    for p in ps:
        with permuted(model, p, seed):
            wer = error_table(test, transcribe_all(model, transcriber, test, batch_size)[0])["avg"]["wer"]
        out[str(p)] = 100 * (wer - base) / base if base > 0 else float("nan")
    return out


def evaluate_asr(model: nn.Module, transcriber, test: dict[str, list[Utterance]], batch_size: int = 8,
                 routing_stack: str | None = None, ps: tuple[float, ...] = (0.1, 0.5), routing_batches: int = 4) -> dict:
    """Every ASR metric of a model on `test`: error rates (see `error_table`), real-time factor (decoding
    seconds / audio seconds, features included), total/active params, the transcripts, and for MoE models
    `routing_report` and `permuted_wer` on the first `routing_batches` batches of each language, over the MoE layers
    matching `routing_stack` (default: the encoder's for encoder-decoder models such as Whisper, whose
    decoder routes a different number of tokens than the encoder has frames)."""
    if routing_stack is None and getattr(model.config, "is_encoder_decoder", False):
        routing_stack = "encoder"
    hyps, seconds = transcribe_all(model, transcriber, test, batch_size)
    audio = sum(u.seconds for utts in test.values() for u in utts)
    total, active = param_counts(model)
    out = {**error_table(test, hyps), "rtf": seconds / audio, "decode_seconds": seconds, "audio_seconds": audio,
           "params": {"total": total, "active": active},
           "transcripts": {lang: [{"id": u.id, "voice": u.voice, "ref": u.text, "hyp": h}
                                  for u, h in zip(utts, hyps[lang])] for lang, utts in test.items()}}
    if moe_layers(model) and find_sites(model, routing_stack):
        subset = {lang: [u for c in _chunks(utts, batch_size)[:routing_batches] for u in c]
                  for lang, utts in test.items()}
        batches = [transcriber.batch(c) for utts in subset.values() for c in _chunks(utts, batch_size)]
        out["routing"] = routing_report(model, transcriber, batches, routing_stack, list(ps))
        out["routing"]["wer_change"] = permuted_wer(model, transcriber, subset, batch_size, list(ps))
    return out
