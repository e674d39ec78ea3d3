"""ASR training data: a speech corpus's manifest (moekit speech corpus) split by language, and the
collators that turn utterances into Whisper, CTC or a transformers CTC checkpoint's inputs (features computed on
the fly, SpecAugment on training batches only)."""
from __future__ import annotations

import random
from pathlib import Path

import torch
from pydantic import Field

from moekit.config import Config
from moekit.errors import ConfigError
from moekit.speech.corpus import Utterance, read_manifest
from moekit.speech.features import log_mel, spec_augment, stack_frames
from moekit.speech.text import CharVocab, spoken_text
from moekit.speech.tts import SAMPLE_RATE, load_audio


class SpecAugmentConfig(Config):
    """SpecAugment (Park et al. 2019) on log-mel training features: frequency and time masks."""

    freq_masks: int = Field(2, ge=0)
    freq_width: int = Field(27, ge=0)
    time_masks: int = Field(2, ge=0)
    time_width: int = Field(100, ge=0)  # frames (10 ms)
    time_width_ratio: float = Field(0.05, ge=0.0, le=1.0)  # cap: this share of the utterance (Park et al. 2020)


class ASRDataConfig(Config):
    corpus: str = "corpus"  # directory written by `moekit speech corpus` (manifest.jsonl)
    langs: list[str] | None = None  # None: every language of the manifest
    train_per_lang: int | None = Field(None, ge=1)  # at most this many training utterances per language
    test_per_lang: int | None = Field(None, ge=1)  # at most this many test utterances per language
    spec_augment: SpecAugmentConfig | None = SpecAugmentConfig()
    seed: int = 0


def load_split(cfg: ASRDataConfig) -> tuple[list[Utterance], dict[str, list[Utterance]]]:
    """(training utterances of every language, shuffled together; {language: test utterances})."""
    utts = read_manifest(Path(cfg.corpus))
    langs = cfg.langs or sorted({u.lang for u in utts})
    missing = [lang for lang in langs if not any(u.lang == lang for u in utts)]
    if missing:
        raise ConfigError(f"corpus {cfg.corpus} has no utterances in {missing}")
    train, test = [], {}
    for lang in langs:
        tr = [u for u in utts if u.lang == lang and u.split == "train"]
        te = [u for u in utts if u.lang == lang and u.split == "test"]
        if not tr or not te:
            raise ConfigError(f"corpus {cfg.corpus}: language {lang} needs train and test utterances")
        train += tr[: cfg.train_per_lang]
        test[lang] = te[: cfg.test_per_lang]
    random.Random(cfg.seed).shuffle(train)
    return train, test


def _pad_labels(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(1, *map(len, rows))), -100)  # (B, L)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


class WhisperCollator:
    """Utterances -> {input_features (B, 80, 3000), labels (B, L)} for WhisperForConditionalGeneration.

    labels = prefix (language and task tokens for multilingual models, then <|notimestamps|>) +
    " " + transcript + <|endoftext|>; the model prepends <|startoftranscript|> when shifting them
    right, as in Whisper's training format (Radford et al. 2022, Fig. 1)."""

    def __init__(self, tokenizer, multilingual: bool, augment: SpecAugmentConfig | None = None, seed: int = 0):
        self.tok, self.multilingual, self.augment = tokenizer, multilingual, augment
        self.gen = torch.Generator().manual_seed(seed)

    def prefix(self, lang: str) -> list[int]:
        names = ([f"<|{lang}|>", "<|transcribe|>"] if self.multilingual else []) + ["<|notimestamps|>"]
        ids = self.tok.convert_tokens_to_ids(names)
        if any(i is None or i == self.tok.unk_token_id for i in ids):
            raise ConfigError(f"the Whisper tokenizer lacks one of {names}")
        return ids

    def labels(self, u: Utterance) -> list[int]:
        text = self.tok(" " + u.text.strip(), add_special_tokens=False)["input_ids"]
        return self.prefix(u.lang) + text + [self.tok.eos_token_id]

    def __call__(self, batch: list[Utterance]) -> dict[str, torch.Tensor]:
        feats, lengths = log_mel([load_audio(u.audio) for u in batch], pad_to_30s=True)  # (B, 3000, 80)
        if self.augment is not None:
            feats = spec_augment(feats, lengths, self.gen, **self.augment.model_dump())
        return {"input_features": feats.transpose(1, 2).contiguous(),  # (B, 80, 3000)
                "labels": _pad_labels([self.labels(u) for u in batch])}


class CTCCollator:
    """Utterances -> {input_features (B, T/4, 320), attention_mask (B, T/4), labels (B, L)}: log-mel frames
    stacked ×4 (Omni-router §5.3), characters of the normalized transcript as labels (blank = 0)."""

    def __init__(self, vocab: CharVocab, stack: int = 4, augment: SpecAugmentConfig | None = None, seed: int = 0):
        self.vocab, self.stack, self.augment = vocab, stack, augment
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, batch: list[Utterance]) -> dict[str, torch.Tensor]:
        feats, lengths = log_mel([load_audio(u.audio) for u in batch], pad_to_30s=False)  # (B, T, 80), (B,)
        if self.augment is not None:
            feats = spec_augment(feats, lengths, self.gen, **self.augment.model_dump())
        feats, lengths = stack_frames(feats, lengths, self.stack)  # (B, T', 320), (B,)
        mask = (torch.arange(feats.shape[1])[None, :] < lengths[:, None]).long()  # (B, T')
        labels = _pad_labels([self.vocab.encode(spoken_text(u.text)) for u in batch])
        return {"input_features": feats, "attention_mask": mask, "labels": labels}


class ProcessorCTCCollator:
    """Utterances -> a transformers CTC checkpoint's inputs as its own processor makes them (wav2vec 2.0's
    Wav2Vec2Processor and its kin's: raw 16 kHz audio normalized as its feature extractor does, or Wav2Vec2-BERT's
    log-mel features; Parakeet's log-mel features; an attention mask only where its feature extractor returns one, as
    wav2vec 2.0 base's does not) and labels (B, L): the transcript (spoken_text) as its CTC tokenizer encodes it
    (characters with spaces as the word delimiter: Wav2Vec2CTCTokenizer; word pieces: ParakeetTokenizer), upper-cased
    where its vocabulary has no lower-case letter (facebook/wav2vec2-base-960h's), padding -100. Both tokenizers decode
    CTC themselves (repeats grouped, their pad token as the blank)."""

    def __init__(self, processor):
        import transformers as tf

        tok, fe = getattr(processor, "tokenizer", None), getattr(processor, "feature_extractor", None)
        if not isinstance(tok, (tf.Wav2Vec2CTCTokenizer, tf.ParakeetTokenizer)) or fe is None:
            raise ConfigError(f"model.kind=pretrained_ctc reads checkpoints whose processor has a feature extractor "
                              f"and a CTC tokenizer (Wav2Vec2CTCTokenizer: wav2vec 2.0, HuBERT, WavLM, MMS, ...; "
                              f"ParakeetTokenizer: Parakeet CTC); this one has {type(tok).__name__}. Train other CTC "
                              "models (LASR, ...) from Python with moekit.MoETrainer")
        if getattr(fe, "sampling_rate", SAMPLE_RATE) != SAMPLE_RATE:
            raise ConfigError(f"the checkpoint's feature extractor takes {fe.sampling_rate} Hz audio; the corpus is "
                              f"{SAMPLE_RATE} Hz")
        self.processor, self.tok = processor, tok
        self.upper = not any(t.islower() for t in tok.get_vocab() if len(t) == 1)

    def text(self, u: Utterance) -> str:
        text = spoken_text(u.text)
        return text.upper() if self.upper else text

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def check(self, utts: list[Utterance]) -> None:
        """Refused: transcripts with characters the vocabulary lacks (they would train as its unknown token)."""
        chars = sorted({c for u in utts for c in self.text(u) if c != " "})
        missing = [c for c in chars if self.tok.unk_token_id in self.encode(c)]
        if missing:
            raise ConfigError(f"the checkpoint's CTC vocabulary lacks {len(missing)} character(s) of the transcripts "
                              f"({' '.join(missing[:20])}); choose a checkpoint whose vocabulary covers the corpus's "
                              "languages")

    def __call__(self, batch: list[Utterance]) -> dict[str, torch.Tensor]:
        out = dict(self.processor.feature_extractor([load_audio(u.audio) for u in batch], sampling_rate=SAMPLE_RATE,
                                                    padding=True, return_tensors="pt"))
        out["labels"] = _pad_labels([self.encode(self.text(u)) for u in batch])
        return out
