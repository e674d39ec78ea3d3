"""Speech-to-text data for speech-LLM recipes (`task: speech_llm`): English source speech and, per direction, a
target text — a translation (En→XX speech translation, SPRI §3.1) or, for the direction `en` itself, the English
transcript (ASR with the same model and path).

Read as users have it:
  covost    CoVoST 2's release: `covost_v2.en_XX.SPLIT.tsv` (the split files of its get_covost_splits.py; columns
            path, sentence, translation, client_id) in `data.path`, the Common Voice clips they name in `data.clips`
            (default `data.path`/clips). `moekit speech corpus --targets ...` writes this layout too.
  hf        the Hugging Face datasets form, one dataset per direction in `data.path`/en_XX: a `save_to_disk` folder or
            Parquet files SPLIT-*.parquet (fixie-ai/covost2's layout), with an audio column and the text columns.
  europarl  Europarl-ST's release: `en/XX/SPLIT/segments.{lst,en,XX}` (lst: audio id, start, end in seconds) and the
            talks' audio in `en/audios/ID.*`.

Rows that cannot be used (a clip that is missing or does not decode, an empty target) are counted per direction and
reason; with `on_bad: error` (the default) any of them ends the run before training with one line that counts them,
with `on_bad: skip` they are left out and counted in the run's results. The paper's length filters (A.2: utterances
over 15 s, prompts over 512 tokens) leave rows out and count them too. The training rows of every direction are
shuffled together (A.2: dataset-level shuffling, so early batches mix directions).
"""
from __future__ import annotations

import csv
import random
import sys
import wave
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from moekit.config import Config
from moekit.data.parallel import LANG_NAMES
from moekit.errors import ConfigError
from moekit.speech.audio import AudioError, decode, is_wav

# CoVoST 2's En→XX targets and Europarl-ST's that moekit.data.parallel does not name
NAMES = {**LANG_NAMES, "ca": "Catalan", "cy": "Welsh", "et": "Estonian", "mn": "Mongolian", "lv": "Latvian",
         "sl": "Slovenian", "ta": "Tamil", "sv": "Swedish", "nl": "Dutch"}
SOURCE = "en"
BAD = ("missing_clip", "unreadable_audio", "empty_target")
FILTERED = ("over_max_seconds", "over_max_prompt_tokens")


class S2TTDataConfig(Config):
    format: Literal["covost", "hf", "europarl"] = "covost"
    path: str = "covost2"
    clips: str | None = None  # covost: the Common Voice clips folder (default PATH/clips)
    directions: list[str] = Field(default_factory=lambda: ["de"], min_length=1)  # targets; `en`: transcription
    transcripts_from: str | None = None  # transcription alone (directions [en]): the direction whose files hold them
    train_split: str = "train"
    test_split: str = "test"
    train_per_direction: int | None = Field(None, ge=1)  # at most this many training rows per direction
    test_per_direction: int | None = Field(None, ge=1)
    max_seconds: float = Field(15.0, gt=0)  # SPRI A.2: utterances over 15 s are filtered out
    max_prompt_tokens: int = Field(512, ge=1)  # SPRI A.2: prompts over 512 tokens (see moekit.speech.llm)
    on_bad: Literal["error", "skip"] = "error"
    audio_column: str = "audio"  # hf
    source_column: str = "sentence"  # covost, hf: the English transcript
    target_column: str = "translation"  # covost, hf
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> S2TTDataConfig:
        unknown = [d for d in self.directions if d not in NAMES]
        if unknown:
            raise ValueError(f"unknown target languages {unknown}; known: {', '.join(sorted(NAMES))}")
        if len(set(self.directions)) != len(self.directions):
            raise ValueError(f"directions repeat: {self.directions}")
        if self.directions == [SOURCE] and self.transcripts_from in (None, SOURCE):
            raise ValueError("transcription (direction en) reads the English transcripts of a translation "
                             "direction's files: name one besides en, or name it in data.transcripts_from")
        if self.transcripts_from is not None and self.transcripts_from not in NAMES:
            raise ValueError(f"unknown transcripts_from language {self.transcripts_from!r}")
        return self


@dataclass(frozen=True)
class Example:
    id: str
    audio: Path | bytes  # a clip file, or its bytes (hf)
    seconds: float
    target: str
    tgt: str  # target language; SOURCE: a transcript
    source: str = ""  # the English transcript where the data has it (COMET's source)
    src: str = SOURCE
    start: float = 0.0  # europarl: the segment of the talk's audio
    end: float | None = None

    def samples(self):
        """Mono float32 samples at 16 kHz (AudioError if the clip does not decode)."""
        x = decode(self.audio, self.id)
        return x[round(self.start * 16000): None if self.end is None else round(self.end * 16000)]


class Report:
    """Rows read, kept, left out as bad (BAD) or by the length filters (FILTERED), per split and direction."""

    def __init__(self):
        self.counts: dict[str, dict[str, Counter]] = {}
        self.first: dict[str, str] = {}  # reason -> its first row, for the error line

    def add(self, split: str, direction: str, reason: str, where: str = "") -> None:
        self.counts.setdefault(split, {}).setdefault(direction, Counter())[reason] += 1
        self.first.setdefault(reason, where)

    def bad(self) -> Counter:
        return sum((Counter({k: c[k] for k in BAD if c[k]}) for s in self.counts.values() for c in s.values()),
                   Counter())

    def as_dict(self) -> dict:
        return {split: {d: dict(c) for d, c in dirs.items()} for split, dirs in self.counts.items()}


# --------------------------------------------------------------------------------------------------- probing


def probe_seconds(audio: Path | bytes) -> float:
    """The clip's duration from its header (WAV by `wave`, others by soundfile), without decoding it."""
    import io

    src = io.BytesIO(audio) if isinstance(audio, bytes) else str(audio)
    if is_wav(audio):
        with wave.open(src, "rb") as w:
            return w.getnframes() / w.getframerate()
    if "soundfile" not in sys.modules:
        try:
            import soundfile  # noqa: F401
        except ImportError:
            raise AudioError("the clips are not WAV files, and reading other formats needs the soundfile package "
                             "(pip install 'moekit[audio]')") from None
    import soundfile

    return soundfile.info(src).duration


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name longer than the file system allows
        return False


def _row(report: Report, split: str, d: str, where: str, audio: Path | bytes | None, target: str, **kw
         ) -> Example | None:
    """The Example of one row, or None (counted in `report`) if its clip is missing or unreadable or its target
    empty."""
    if audio is None or (isinstance(audio, Path) and not _is_file(audio)):
        report.add(split, d, "missing_clip", f"{where}: clip {audio} not found")
        return None
    if not target.strip():
        report.add(split, d, "empty_target", f"{where}: empty target text")
        return None
    try:
        seconds = probe_seconds(audio)
    except AudioError:
        raise
    except Exception as e:  # noqa: BLE001  (wave, soundfile and the OS raise many types for a bad header)
        report.add(split, d, "unreadable_audio", f"{where}: clip does not read as audio ({type(e).__name__}: {e})")
        return None
    end = kw.pop("end", None)
    if end is not None:
        seconds = end - kw.get("start", 0.0)
    return Example(id=where, audio=audio, seconds=seconds, target=target.strip(), tgt=d, end=end, **kw)


# --------------------------------------------------------------------------------------------------- readers


def _pair(cfg: S2TTDataConfig, d: str) -> str:
    """The translation direction whose files hold direction `d`'s rows (transcription: transcripts_from, else the
    first one listed)."""
    return d if d != SOURCE else cfg.transcripts_from or next(x for x in cfg.directions if x != SOURCE)


def _tsv(path: Path, need: tuple[str, ...]) -> list[dict]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            missing = [c for c in need if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{path} has no column {', '.join(missing)} (CoVoST 2's split files have path, "
                                  "sentence, translation, client_id)")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    for n, r in enumerate(rows, 2):
        if None in r or None in r.values():  # DictReader's marks of a row longer / shorter than the header
            raise ConfigError(f"{path}:{n}: the row has {'more' if None in r else 'fewer'} fields than the header's "
                              f"{len(reader.fieldnames)}")
    return rows


def _clip(clips: Path, name: str, where: str) -> Path:
    """The clip a row names: a relative path inside the clips folder (never absolute, never through '..')."""
    if Path(name).is_absolute() or ".." in Path(name).parts or "\0" in name:
        raise ConfigError(f"{where}: clip path {name[:80]!r} leaves the clips folder {clips}")
    return clips / name


def _covost(cfg: S2TTDataConfig, split: str, d: str, report: Report) -> list[Example]:
    pair = _pair(cfg, d)
    path = Path(cfg.path) / f"covost_v2.{SOURCE}_{pair}.{split}.tsv"
    if not path.is_file():
        raise ConfigError(f"{path} not found (CoVoST 2's split file for {SOURCE}->{pair}, {split})")
    column = cfg.source_column if d == SOURCE else cfg.target_column
    clips = Path(cfg.clips) if cfg.clips else Path(cfg.path) / "clips"
    rows = (_row(report, split, d, f"{path.name}:{n}", _clip(clips, r["path"], f"{path.name}:{n}"), r[column] or "",
                 source=r.get(cfg.source_column) or "") for n, r in enumerate(_tsv(path, ("path", column)), 2))
    return [e for e in rows if e is not None]


def _hf_dataset(cfg: S2TTDataConfig, split: str, pair: str):
    import datasets

    folder = Path(cfg.path) / f"{SOURCE}_{pair}"
    try:
        if (folder / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(folder))
            if split not in ds:
                raise ConfigError(f"{folder} has no split {split!r} (it has {', '.join(ds)})")
            return ds[split]
        files = sorted(str(p) for p in folder.glob(f"{split}*.parquet"))
        if not files:
            raise ConfigError(f"{folder} holds neither a saved dataset (dataset_dict.json) nor {split}*.parquet")
        return datasets.load_dataset("parquet", data_files=files, split="train")
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(f"cannot read the dataset in {folder}: {' '.join(str(e).split())[:300]}") from None


def _hf(cfg: S2TTDataConfig, split: str, d: str, report: Report) -> list[Example]:
    import datasets

    pair = _pair(cfg, d)
    ds = _hf_dataset(cfg, split, pair)
    column = cfg.source_column if d == SOURCE else cfg.target_column
    missing = [c for c in (cfg.audio_column, column) if c not in ds.column_names]
    if missing:
        raise ConfigError(f"the {SOURCE}_{pair} dataset has no column {', '.join(missing)} (it has "
                          f"{', '.join(ds.column_names)}); data.audio_column / data.target_column name them")
    if isinstance(ds.features[cfg.audio_column], datasets.Audio):
        ds = ds.cast_column(cfg.audio_column, datasets.Audio(decode=False))  # bytes: decoded by moekit.speech.audio
    out = []
    for n, r in enumerate(ds):
        a = r[cfg.audio_column] or {}
        audio = a.get("bytes") or (Path(a["path"]) if a.get("path") else None)
        out.append(_row(report, split, d, f"{SOURCE}_{pair}/{split}[{n}]", audio, r[column] or "",
                        source=r.get(cfg.source_column) or ""))
    return [e for e in out if e is not None]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _europarl(cfg: S2TTDataConfig, split: str, d: str, report: Report) -> list[Example]:
    pair = _pair(cfg, d)
    folder = Path(cfg.path) / SOURCE / pair / split
    segs, texts, sources = (_lines(folder / f"segments.{x}") for x in ("lst", d, SOURCE))
    if not len(segs) == len(texts) == len(sources):
        raise ConfigError(f"{folder}: segments.lst, segments.{d} and segments.{SOURCE} differ in length")
    audios = {p.stem: p for p in (Path(cfg.path) / SOURCE / "audios").glob("*.*")}
    out = []
    for n, (seg, text, source) in enumerate(zip(segs, texts, sources), 1):
        parts = seg.split()
        if len(parts) != 3:
            raise ConfigError(f"{folder}/segments.lst:{n}: expected `audio_id start end`, got {seg!r}")
        start, end = float(parts[1]), float(parts[2])
        out.append(_row(report, split, d, f"{folder.name}/segments.lst:{n}", audios.get(parts[0]), text,
                        source=source, start=start, end=end))
    return [e for e in out if e is not None]


READERS = {"covost": _covost, "hf": _hf, "europarl": _europarl}


# --------------------------------------------------------------------------------------------------- loading


def _filtered(rows: list[Example], cfg: S2TTDataConfig, split: str, report: Report,
              prompt_tokens: Callable[[Example], int]) -> list[Example]:
    kept = []
    for e in rows:
        if e.seconds > cfg.max_seconds:
            report.add(split, e.tgt, "over_max_seconds", e.id)
        elif prompt_tokens(e) > cfg.max_prompt_tokens:
            report.add(split, e.tgt, "over_max_prompt_tokens", e.id)
        else:
            kept.append(e)
    return kept


def _check_bad(cfg: S2TTDataConfig, report: Report) -> None:
    bad = report.bad()
    if bad and cfg.on_bad == "error":
        reason = next(iter(bad))
        counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in bad.items())
        n = sum(bad.values())
        raise ConfigError(f"{n} unusable row{'s' * (n > 1)} in {cfg.path} ({counts}), first {report.first[reason]};"
                          " data.on_bad=skip leaves them out and counts them")


def load_s2tt(cfg: S2TTDataConfig, prompt_tokens: Callable[[Example], int]
              ) -> tuple[list[Example], dict[str, list[Example]], Report]:
    """(training rows of every direction shuffled together, {direction: test rows}, the report of what was left out).
    `prompt_tokens(example)`: the length the max_prompt_tokens filter compares (moekit.speech.llm). ConfigError
    (nothing trained) for bad rows under on_bad=error, and for a direction left without rows."""
    report, read = Report(), READERS[cfg.format]
    splits = {s: {d: read(cfg, s, d, report) for d in cfg.directions} for s in (cfg.train_split, cfg.test_split)}
    _check_bad(cfg, report)
    kept = {}
    for split, cap in ((cfg.train_split, cfg.train_per_direction), (cfg.test_split, cfg.test_per_direction)):
        for d, rows in splits[split].items():
            rows = _filtered(rows[:cap], cfg, split, report, prompt_tokens)
            if not rows:
                left = dict(report.counts.get(split, {}).get(d, {}))
                raise ConfigError(f"direction {SOURCE}->{d} has no {split} rows left"
                                  f"{f' (left out: {left})' if left else ''} (data.max_seconds={cfg.max_seconds}, "
                                  f"data.max_prompt_tokens={cfg.max_prompt_tokens})")
            kept.setdefault(split, {})[d] = rows
            report.counts.setdefault(split, {}).setdefault(d, Counter())["kept"] = len(rows)
    train = [e for rows in kept[cfg.train_split].values() for e in rows]
    random.Random(cfg.seed).shuffle(train)  # SPRI A.2: directions mixed from the first batch on
    return train, kept[cfg.test_split], report
