"""Parallel text for En→XX translation with a decoder-only LM.

Each example is `prompt + target + eos`, where the prompt names the target language; only target
tokens are scored (prompt labels = -100). Directions are mixed into one shuffled training set
(SPRI appendix A.2) and each direction keeps its own held-out test split. Sources: the
verse-aligned Bible DB (`moekit.assets`), or the user's JSONL files with {src, tgt, tgt_lang}.
"""
from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import torch
from pydantic import Field, model_validator

from moekit.config import Config
from moekit.errors import ConfigError

T = TypeVar("T")

LANG_NAMES = {
    "en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
    "ru": "Russian", "uk": "Ukrainian", "pl": "Polish", "ro": "Romanian", "tr": "Turkish", "ar": "Arabic",
    "fa": "Persian", "hi": "Hindi", "bn": "Bengali", "sw": "Swahili", "id": "Indonesian", "vi": "Vietnamese",
    "tl": "Tagalog", "ko": "Korean", "zh": "Chinese", "ja": "Japanese",
}
# one translation per language (public-domain ones where the Bible DB has them; see ASSETS.md)
BIBLE_CODE = {"en": "k", "fr": "l", "de": "e", "es": "v", "it": "d", "pt": "a", "ru": "r", "ar": "y", "fa": "p",
              "vi": "7", "tl": "f", "ko": "n", "sw": "h", "uk": "8", "pl": "z", "ro": "u", "tr": "t", "hi": "i",
              "bn": "b", "id": "6", "zh": "c", "ja": "j"}

DEFAULT_TEMPLATE = "Translate from {src_name} to {tgt_name}.\n{src_name}: {src}\n{tgt_name}:"


@dataclass(frozen=True)
class Pair:
    src: str
    tgt: str
    tgt_lang: str
    id: str = ""  # e.g. "40:5:3" (book:chapter:verse) for aligned corpora


class DataConfig(Config):
    source: Literal["bible", "jsonl"] = "bible"
    directions: list[str] = Field(default_factory=lambda: ["fr", "de", "es", "sw"])  # target languages
    train_per_direction: int = Field(512, ge=1)
    test_per_direction: int = Field(64, ge=1)
    books: list[int] | None = None  # Bible books to draw from (1-66); None = all
    train_files: list[str] = Field(default_factory=list)  # jsonl: {src, tgt, tgt_lang} per line
    test_files: list[str] = Field(default_factory=list)
    template: str = DEFAULT_TEMPLATE
    max_length: int = Field(128, ge=8)
    max_src_chars: int = Field(300, ge=10)  # skip very long verses
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        unknown = [d for d in self.directions if d not in LANG_NAMES]
        if unknown:
            raise ValueError(f"unknown target languages {unknown}; known: {', '.join(sorted(LANG_NAMES))}")
        if self.source == "bible" and any(d not in BIBLE_CODE for d in self.directions):
            raise ValueError("no Bible translation for some directions")
        if self.source == "jsonl" and not (self.train_files and self.test_files):
            raise ValueError("source=jsonl needs train_files and test_files")
        check_template(self.template, TEMPLATE_FIELDS, required=("src", "tgt_name"))
        return self


TEMPLATE_FIELDS = ("src_name", "tgt_name", "src")  # what prompt_of fills in


def check_template(template: str, fields: tuple[str, ...], required: tuple[str, ...]) -> None:
    """ValueError for a template that names a field `prompt_of` does not fill, lacks a required one, or is
    not a valid format string (so training cannot fail on it later)."""
    try:
        used = [name for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"template is not a valid format string: {e}") from None
    unknown = sorted({n for n in used if n not in fields})
    if unknown:
        raise ValueError(f"template uses unknown fields {unknown}; it may use {', '.join(fields)} "
                         "(write {{ and }} for literal braces)")
    missing = [f"{{{r}}}" for r in required if r not in used]
    if missing:
        raise ValueError(f"template must contain {', '.join(missing)}")
    try:
        template.format(**dict.fromkeys(fields, "x"))
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"template does not format: {e}") from None


def _bible_pairs(cfg: DataConfig) -> dict[str, list[Pair]]:
    from moekit.assets import bible_verses

    src = {(v.book, v.chapter, v.verse): v.text for v in bible_verses(BIBLE_CODE["en"], cfg.books)}
    out = {}
    for lang in cfg.directions:
        tgt = {(v.book, v.chapter, v.verse): v.text for v in bible_verses(BIBLE_CODE[lang], cfg.books)}
        out[lang] = [Pair(src[k].strip(), tgt[k].strip(), lang, ":".join(map(str, k)))
                     for k in src if k in tgt and tgt[k].strip() and 0 < len(src[k]) <= cfg.max_src_chars]
    return out


def parse_line(raw: bytes, as_json: bool = True):
    """One line of a data file, decoded (and with `as_json`, parsed); ValueError saying what the line is instead:
    "not UTF-8 (byte 0xff at column 4)", "not valid JSON (...)", "not valid JSON: nested deeper than Python reads"."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not as_json:
        return text
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("not valid JSON: nested deeper than Python reads") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e})") from None


def json_lines(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-empty line of the JSON Lines file `path`; a line that is not UTF-8 or
    not JSON is one ConfigError naming file and line."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            if raw.strip():
                try:
                    yield n, parse_line(raw)
                except ValueError as e:
                    raise ConfigError(f"{path}:{n}: {e}") from None


def read_jsonl(files: list[str], fields: str, build: Callable[[dict, str], T]) -> list[T]:
    """`build(record, default_id)` for every non-empty line of the JSONL `files`; a missing file or a line
    that is not a JSON object with `fields` is one ConfigError naming file and line."""
    out = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"data file not found: {path}")
        for n, record in json_lines(path):
            try:
                out.append(build(record, f"{path.name}:{n}"))
            except (KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{n}: expected a JSON object with {fields} ({e})") from None
    return out


def _jsonl_pairs(files: list[str]) -> list[Pair]:
    return read_jsonl(files, "src, tgt, tgt_lang",
                      lambda d, default_id: Pair(d["src"], d["tgt"], d["tgt_lang"], d.get("id", default_id)))


def load_pairs(cfg: DataConfig) -> tuple[list[Pair], dict[str, list[Pair]]]:
    """(train pairs of all directions shuffled together, {direction: test pairs}).

    Bible: the test verses are the same verse ids in every direction (identical content), drawn
    with `seed`, disjoint from the training verses."""
    rng = random.Random(cfg.seed)
    if cfg.source == "jsonl":
        train = [p for p in _jsonl_pairs(cfg.train_files) if p.tgt_lang in cfg.directions]
        test_all = _jsonl_pairs(cfg.test_files)
        test = {d: [p for p in test_all if p.tgt_lang == d][: cfg.test_per_direction] for d in cfg.directions}
    else:
        by_dir = _bible_pairs(cfg)
        ids = sorted(set.intersection(*({p.id for p in v} for v in by_dir.values())))
        rng.shuffle(ids)
        test_ids = set(ids[: cfg.test_per_direction])
        train_ids = set(ids[cfg.test_per_direction: cfg.test_per_direction + cfg.train_per_direction])
        test = {d: [p for p in v if p.id in test_ids] for d, v in by_dir.items()}
        train = [p for v in by_dir.values() for p in v if p.id in train_ids]
    rng.shuffle(train)
    return train, test


def prompt_of(pair: Pair, template: str) -> str:
    return template.format(src_name="English", tgt_name=LANG_NAMES[pair.tgt_lang], src=pair.src)


def encode_pair(pair: Pair, tokenizer, template: str, max_length: int) -> dict[str, list[int]]:
    """input_ids = prompt + " " + target + eos; labels = -100 on the prompt."""
    prompt = tokenizer(prompt_of(pair, template), add_special_tokens=False)["input_ids"]
    target = tokenizer(" " + pair.tgt, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + target)[:max_length]
    labels = ([-100] * len(prompt) + target)[:max_length]
    return {"input_ids": ids, "labels": labels}


class TranslationCollator:
    """Right-pads a batch; padding gets attention_mask 0 and label -100."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), n), self.pad_id)
        labels = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            L = len(b["input_ids"])
            ids[i, :L], labels[i, :L], mask[i, :L] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
