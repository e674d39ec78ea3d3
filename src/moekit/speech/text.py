"""Transcript normalization (Whisper's), WER/CER, and the character vocabulary of CTC models."""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import jiwer

from moekit.errors import ConfigError


@lru_cache(maxsize=None)
def _normalizer(english: bool):
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    # EnglishTextNormalizer's spelling map (British -> American) ships with Whisper checkpoints, not
    # with transformers: {} keeps spellings as they are.
    return EnglishTextNormalizer({}) if english else BasicTextNormalizer(remove_diacritics=False)


def normalize(text: str, lang: str) -> str:
    """Whisper's text normalization (Radford et al. 2022, appendix C) as transformers ships it:
    EnglishTextNormalizer for "en" (lower case, no punctuation, numbers as digits, "mr" -> "mister",
    ...), BasicTextNormalizer otherwise (lower case, symbols and punctuation to spaces, diacritics
    kept). Both drop spans in brackets or parentheses. Runs of spaces become one; no outer spaces."""
    return " ".join(_normalizer(lang == "en")(text).split())


def spoken_text(text: str) -> str:
    """CTC targets: what is said, as words, in every language — BasicTextNormalizer (lower case,
    punctuation to spaces, diacritics kept), not the English one, which writes "one" as "1"."""
    return " ".join(_normalizer(False)(text).split())


def _edits(out) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference length) of a jiwer alignment."""
    return out.substitutions + out.deletions + out.insertions, out.substitutions + out.deletions + out.hits


def error_rates(refs: Sequence[str], hyps: Sequence[str], lang: str) -> dict:
    """Corpus-level word and character error rates after `normalize(., lang)`: total edits (S + D +
    I) over total reference words (chars, counting the spaces between words). A reference that is
    empty after normalization contributes its hypothesis as insertions; the denominator is at least
    1, so an all-empty reference set gives the number of inserted words (chars) instead of a
    division by zero. Returns {wer, cer, n (pairs), words, chars (reference totals)}."""
    if len(refs) != len(hyps):
        raise ConfigError(f"{len(refs)} references but {len(hyps)} hypotheses")
    refs = [normalize(r, lang) for r in refs]
    hyps = [normalize(h, lang) for h in hyps]
    if not refs:
        return {"wer": 0.0, "cer": 0.0, "n": 0, "words": 0, "chars": 0}
    word_edits, words = _edits(jiwer.process_words(refs, hyps))
    char_edits, chars = _edits(jiwer.process_characters(refs, hyps))
    return {"wer": word_edits / max(words, 1), "cer": char_edits / max(chars, 1), "n": len(refs),
            "words": words, "chars": chars}


@dataclass(frozen=True)
class CharVocab:
    """Characters of normalized transcripts as CTC labels (Graves et al. 2006): id 0 is the blank,
    id 1 the word separator (a space, shown as "|"), then the characters in sorted order.
    `encode` drops characters that are not in the vocabulary (build it over all the texts a model
    will be trained on: normalized training transcripts of every language)."""

    chars: tuple[str, ...]  # id 2 + i -> chars[i]

    BLANK = 0
    SPACE = 1

    @classmethod
    def build(cls, texts: Iterable[str]) -> CharVocab:
        """The vocabulary of the characters in `texts` (already normalized, see `normalize`)."""
        return cls(tuple(sorted({c for t in texts for c in t if not c.isspace()})))

    def __len__(self) -> int:
        return 2 + len(self.chars)

    def _ids(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars, 2)}

    def encode(self, text: str) -> list[int]:
        """Label ids of `text`: words joined by SPACE, unknown characters dropped."""
        ids, table = [], self._ids()
        for word in text.split():
            known = [table[c] for c in word if c in table]
            if known:
                ids += ([self.SPACE] if ids else []) + known
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of label ids (blanks dropped, SPACE -> " ", runs of spaces collapsed)."""
        out = [" " if i == self.SPACE else self.chars[i - 2] for i in map(int, ids) if i != self.BLANK]
        return " ".join("".join(out).split())

    def decode_ctc(self, ids: Iterable[int]) -> str:
        """Best-path CTC decoding of per-frame ids: merge repeated ids, then drop blanks (so "aa"
        needs a blank between the two "a" frames)."""
        collapsed, prev = [], None
        for i in map(int, ids):
            if i != prev:
                collapsed.append(i)
            prev = i
        return self.decode(collapsed)

    def to_json(self) -> str:
        return json.dumps({"blank": "<blank>", "space": "|", "chars": list(self.chars)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> CharVocab:
        try:
            chars = json.loads(text)["chars"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"not a CharVocab JSON object with a 'chars' list: {e}") from None
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 and not c.isspace()
                                                  for c in chars) or len(set(chars)) != len(chars):
            raise ConfigError("CharVocab 'chars' must be distinct single non-space characters")
        return cls(tuple(chars))
