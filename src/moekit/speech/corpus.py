"""Synthetic multilingual speech corpora: texts (verse-aligned Bible or the user's files) spoken by
espeak-ng voices, with held-out texts and held-out voices for testing.

A corpus directory holds
  manifest.jsonl            one JSON object per utterance: id, audio (relative path), text, text_id,
                            lang, voice (Voice.id), family ("espeak-ng" | "flite"), split
                            ("train" | "test"), seconds
  audio/<lang>/<id>.wav     16 kHz mono 16-bit PCM
  corpus.json               the config, utterance counts, voices and total hours
With `targets` (speech translation, Bible texts only) it also holds the English speech as CoVoST 2's release
lays it out, read by speech-LLM recipes (moekit.speech.s2tt, data.format covost, data.clips CORPUS/audio/en):
  covost_v2.en_XX.{train,test}.tsv   per target: path (the clip in audio/en), sentence, translation (the same verse
                                     in XX), client_id (the voice)
"""
from __future__ import annotations

import json
import random
import re
import wave
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import Field, model_validator

from moekit.config import Config
from moekit.data.parallel import BIBLE_CODE, LANG_NAMES, json_lines
from moekit.errors import ConfigError
from moekit._fs import output, reserve
from moekit.progress import report
from moekit.speech.tts import ESPEAK_LANG, SAMPLE_RATE, Voice, flite_voices, max_voices, require, synthesize, \
    voices_for

FIELDS = ("id", "audio", "text", "text_id", "lang", "voice", "family", "split", "seconds")


class CorpusConfig(Config):
    """What to synthesize. Texts come from the verse-aligned Bible DB (`moekit.assets`) unless
    `texts` maps every language to a UTF-8 file with one sentence per line."""

    langs: list[str] = Field(min_length=1)
    voices: int = Field(4, ge=1)  # training voices per language
    test_voices: int = Field(1, ge=1)  # held-out voices per language (never used for training)
    train_per_lang: int = Field(200, ge=1)
    test_per_lang: int = Field(50, ge=1)
    texts: dict[str, str] = Field(default_factory=dict)  # LANG -> text file; empty = Bible
    books: list[int] | None = None  # Bible books to draw from (1 = Genesis ... 66); None = all
    max_chars: int = Field(200, ge=10)  # longer texts are skipped
    flite_test: bool = False  # English: also speak the test texts with flite (a voice family unseen in training)
    targets: list[str] = Field(default_factory=list)  # speech translation: the verses in these languages (langs: en)
    seed: int = 0
    workers: int = Field(2, ge=1)  # parallel synthesis processes

    @model_validator(mode="after")
    def _check(self) -> CorpusConfig:
        unknown = [lang for lang in self.langs if lang not in LANG_NAMES]
        if unknown:
            raise ValueError(f"unknown languages {unknown}; known: {', '.join(sorted(LANG_NAMES))}")
        if len(set(self.langs)) != len(self.langs):
            raise ValueError(f"languages repeat: {self.langs}")
        unvoiced = [lang for lang in self.langs if lang not in ESPEAK_LANG]
        if unvoiced:
            raise ValueError(f"no espeak-ng voice for {unvoiced}; voiced: {', '.join(sorted(ESPEAK_LANG))}")
        if self.voices + self.test_voices > max_voices():
            raise ValueError(f"voices + test_voices must be at most {max_voices()}")
        if self.targets and (self.langs != ["en"] or self.texts or self.flite_test or "en" in self.targets
                             or any(t not in BIBLE_CODE for t in self.targets)):
            raise ValueError("targets (speech translation) speak English Bible verses: langs en alone, Bible targets "
                             f"other than en ({', '.join(sorted(BIBLE_CODE))}), no texts files, no flite_test")
        if self.flite_test and "en" not in self.langs:
            raise ValueError("flite_test speaks English test texts: add en to langs")
        if any(not 1 <= b <= 66 for b in self.books or []):
            raise ValueError("books are numbered 1 (Genesis) to 66 (Revelation)")
        if self.texts:
            self._check_files()
        elif any(lang not in BIBLE_CODE for lang in self.langs):
            raise ValueError(f"no Bible translation for {[x for x in self.langs if x not in BIBLE_CODE]}")
        return self

    def inputs(self) -> list[Path]:
        """The files the corpus reads (the output may not be or contain them)."""
        return [Path(f) for f in self.texts.values()]

    def _check_files(self) -> None:
        if set(self.texts) != set(self.langs):
            raise ValueError(f"texts must give one file for each language {self.langs}, got {sorted(self.texts)}")
        missing = [f for f in self.texts.values() if not Path(f).is_file()]
        if missing:
            raise ValueError(f"text files not found: {missing}")


@dataclass(frozen=True)
class Utterance:
    id: str
    audio: Path  # absolute
    text: str
    text_id: str  # e.g. "40:5:3" (book:chapter:verse, the same content in every language) or "file.txt:12"
    lang: str
    voice: str  # Voice.id
    family: str  # "espeak-ng" | "flite"
    split: str  # "train" | "test"
    seconds: float


class _Job(NamedTuple):
    id: str
    lang: str
    split: str
    text_id: str
    text: str
    voice: Voice


def clean(text: str) -> str:
    """Brackets removed (their content kept: it is spoken, and Whisper's normalizers would drop a
    bracketed span from the reference), whitespace collapsed."""
    return " ".join(re.sub(r"[()\[\]{}<>]", " ", text).split())


def _bible_texts(cfg: CorpusConfig) -> dict[str, list[tuple[str, str]]]:
    from moekit.assets import bible_verses

    return {lang: [(f"{v.book}:{v.chapter}:{v.verse}", v.text) for v in bible_verses(BIBLE_CODE[lang], cfg.books)]
            for lang in [*cfg.langs, *cfg.targets]}


def _file_texts(cfg: CorpusConfig) -> dict[str, list[tuple[str, str]]]:
    out = {}
    for lang, name in cfg.texts.items():
        path = Path(name)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read texts from {path}: {e}") from None
        out[lang] = [(f"{path.name}:{n}", line) for n, line in enumerate(lines, 1)]
    return out


def _usable(texts: list[tuple[str, str]], max_chars: int) -> dict[str, str]:
    """text_id -> cleaned text, for non-empty texts of at most max_chars; a repeated text is kept only
    at its first occurrence (so held-out texts never reappear in training)."""
    out, seen = {}, set()
    for tid, text in texts:
        text = clean(text)
        if text and len(text) <= max_chars and text not in seen:
            out[tid] = text
            seen.add(text)
    return out


def split_texts(cfg: CorpusConfig) -> dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]]:
    """{lang: (train, test)} lists of (text_id, text), disjoint, drawn with `seed`. Bible texts use the
    same verse ids in every language (aligned content); text files are drawn per language."""
    raw = _file_texts(cfg) if cfg.texts else _bible_texts(cfg)
    usable = {lang: _usable(texts, cfg.max_chars) for lang, texts in raw.items()}
    if not cfg.texts:  # aligned: only verses usable in every language
        common = [tid for tid in usable[cfg.langs[0]] if all(tid in u for u in usable.values())]
        usable = {lang: {tid: u[tid] for tid in common} for lang, u in usable.items()}
    need, out = cfg.train_per_lang + cfg.test_per_lang, {}
    for lang in cfg.langs:
        items = list(usable[lang].items())
        if len(items) < need:
            raise ConfigError(f"{lang}: only {len(items)} distinct texts of at most {cfg.max_chars} characters, "
                              f"need {need} (train_per_lang + test_per_lang)")
        random.Random(cfg.seed).shuffle(items)  # same order for aligned ids in every language
        out[lang] = (items[cfg.test_per_lang:need], items[:cfg.test_per_lang])
    return out


def target_texts(cfg: CorpusConfig) -> dict[str, dict[str, str]]:
    """{target: {verse id: the verse in the target}} (speech translation)."""
    raw = _bible_texts(cfg)
    return {t: _usable(raw[t], cfg.max_chars) for t in cfg.targets}


def _write_covost(cfg: CorpusConfig, rows: list[dict], root: Path) -> None:
    for t, verses in target_texts(cfg).items():
        for split in ("train", "test"):
            lines = ["path\tsentence\ttranslation\tclient_id", *(
                f"{Path(r['audio']).name}\t{r['text']}\t{verses[r['text_id']]}\t{r['voice']}"
                for r in rows if r["split"] == split)]
            (root / f"covost_v2.en_{t}.{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def plan(cfg: CorpusConfig) -> list[_Job]:
    """Every utterance to synthesize: training texts by the training voices, test texts by the
    held-out voices (and, with flite_test, English test texts by flite voices), round robin."""
    jobs = []
    for lang, (train, test) in split_texts(cfg).items():
        voices = voices_for(lang, cfg.voices + cfg.test_voices, cfg.seed)
        groups = [("train", train, voices[:cfg.voices]), ("test", test, voices[cfg.voices:])]
        if cfg.flite_test and lang == "en":
            groups.append(("flite", test, flite_voices()))
        for name, texts, vs in groups:
            jobs += [_Job(f"{lang}-{name}-{i:05d}", lang, "test" if name == "flite" else name, tid, text,
                          vs[i % len(vs)]) for i, (tid, text) in enumerate(texts)]
    return jobs


def _synthesize_all(jobs: list[_Job], root: Path, workers: int) -> None:
    for lang in {j.lang for j in jobs}:
        (root / "audio" / lang).mkdir(parents=True)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(synthesize, j.text, j.voice, root / _audio(j)) for j in jobs]
        for done, f in enumerate(as_completed(futures), 1):
            f.result()
            report("synthesizing", done, len(jobs))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _audio(job: _Job) -> str:
    return f"audio/{job.lang}/{job.id}.wav"


def _seconds(path: Path) -> float:
    with wave.open(str(path), "rb") as w:
        return w.getnframes() / SAMPLE_RATE


def _summary(cfg: CorpusConfig, rows: list[dict]) -> dict:
    counts, voices = {}, {}
    for r in rows:
        key = "flite_test" if r["family"] == "flite" else r["split"]
        counts.setdefault(r["lang"], {}).setdefault(key, 0)
        counts[r["lang"]][key] += 1
        voices.setdefault(r["lang"], {}).setdefault(key, [])
        if r["voice"] not in voices[r["lang"]][key]:
            voices[r["lang"]][key].append(r["voice"])
    return {"config": cfg.model_dump(mode="json"), "utterances": len(rows),
            "hours": sum(r["seconds"] for r in rows) / 3600, "counts": counts, "voices": voices}


def build_corpus(cfg: CorpusConfig | dict[str, Any], out: str | Path, overwrite: bool = False) -> Path:
    """Synthesize a multilingual speech corpus with espeak-ng (and flite) voices (`moekit speech corpus`).

    Writes manifest.jsonl, audio/<lang>/*.wav (16 kHz) and corpus.json into `out`, atomically (nothing is left on
    failure). Test utterances use held-out texts and held-out voices. Everything that can be checked (output
    directory, programs, texts) is checked before synthesis starts. Progress: "synthesizing" per utterance
    (moekit.progress). Deterministic in `cfg`.

    Args:
        cfg: What to synthesize: a CorpusConfig, or its fields as a dict (e.g. {"langs": ["en", "fr"]}; the other
            fields default as the command's options do).
        out: The output directory.
        overwrite: Replace a non-empty `out`.

    Returns:
        The corpus directory (`read_manifest` lists its utterances).

    Raises:
        ConfigError: Invalid settings, an unknown language, missing texts or programs (espeak-ng, sox, flite).
        OutputExistsError: `out` is not empty and `overwrite` is False.

    Example:
        >>> moekit.speech.build_corpus({"langs": ["en", "fr"], "voices": 2}, "corpus")  # doctest: +SKIP
    """
    from moekit.config import validate

    cfg = cfg if isinstance(cfg, CorpusConfig) else validate(CorpusConfig, cfg, source="speech corpus settings")
    with reserve(out, cfg.inputs(), overwrite):
        for binary in ("espeak-ng", "sox", *(["flite"] if cfg.flite_test else [])):
            require(binary)
        jobs = plan(cfg)
        return _build(cfg, jobs, out)


def _build(cfg: CorpusConfig, jobs: list, out: str | Path) -> Path:
    with output(out) as tmp:
        _synthesize_all(jobs, tmp, cfg.workers)
        rows = [{"id": j.id, "audio": _audio(j), "text": j.text, "text_id": j.text_id, "lang": j.lang,
                 "voice": j.voice.id, "family": j.voice.engine, "split": j.split,
                 "seconds": _seconds(tmp / _audio(j))} for j in jobs]
        (tmp / "manifest.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                            encoding="utf-8")
        if cfg.targets:
            _write_covost(cfg, rows, tmp)
        (tmp / "corpus.json").write_text(json.dumps(_summary(cfg, rows), indent=2, ensure_ascii=False),
                                         encoding="utf-8")
    return Path(out)


def read_manifest(path: str | Path) -> list[Utterance]:
    """The utterances of a corpus directory or its manifest.jsonl, audio paths made absolute."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.jsonl"
    try:
        records = list(json_lines(path))
    except OSError as e:
        raise ConfigError(f"cannot read manifest {path}: {e}") from None
    root = path.parent.resolve()
    return [_utterance(d, root, f"{path}:{n}") for n, d in records]


def _utterance(d, root: Path, where: str) -> Utterance:
    if not isinstance(d, dict) or set(FIELDS) - set(d):
        missing = sorted(set(FIELDS) - set(d)) if isinstance(d, dict) else list(FIELDS)
        raise ConfigError(f"{where}: expected a JSON object with {', '.join(FIELDS)}; missing {', '.join(missing)}")
    if not isinstance(d["seconds"], (int, float)) or d["split"] not in ("train", "test"):
        raise ConfigError(f"{where}: seconds must be a number and split train or test")
    return Utterance(**{k: str(d[k]) for k in FIELDS if k not in ("audio", "seconds")},
                     audio=root / str(d["audio"]), seconds=float(d["seconds"]))
