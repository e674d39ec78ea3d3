"""Speech synthesis with the Debian engines espeak-ng (multilingual) and flite (English), resampled
by sox to 16 kHz mono 16-bit PCM WAV, and WAV loading with the standard library.

Text goes to the engines through a temporary file, never through a shell or as an argument (so a
text starting with "-" is spoken, not parsed as an option).
"""
from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from moekit.errors import ConfigError, ToolError

SAMPLE_RATE = 16_000
# language (moekit.data.parallel.LANG_NAMES code) -> espeak-ng voice. Not ja/zh: espeak-ng spells out
# kanji and many hanzi letter by letter; not tl: espeak-ng has no Tagalog voice.
ESPEAK_LANG = {
    "en": "en-us", "fr": "fr-fr", "de": "de", "es": "es", "it": "it", "pt": "pt", "ru": "ru", "uk": "uk",
    "pl": "pl", "ro": "ro", "tr": "tr", "ar": "ar", "fa": "fa", "hi": "hi", "bn": "bn", "sw": "sw", "id": "id",
    "vi": "vi", "ko": "ko",
}
# espeak-ng's human-sounding variants (the others are robots, whispers, croaks, ...)
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
SPEEDS = (130, 140, 150, 160, 170, 180)  # words per minute (espeak-ng's default is 175)
PITCHES = (30, 40, 50, 60, 70)  # 0-99 (default 50)
FLITE_VOICES = ("slt", "rms", "awb", "kal16")  # flite's 16 kHz general-purpose voices
PACKAGE = {"espeak-ng": "espeak-ng", "flite": "flite", "sox": "sox"}  # binary -> Debian package


@dataclass(frozen=True)
class Voice:
    """A synthetic voice: `engine` with voice `name` ("fr-fr+m3", "slt"); speed in words per minute
    and pitch (0-99) apply to espeak-ng only (None = the engine's default)."""

    engine: Literal["espeak-ng", "flite"]
    name: str
    speed: int | None = None
    pitch: int | None = None

    @property
    def id(self) -> str:
        """e.g. "espeak-ng:fr-fr+m3:s150:p40" or "flite:slt"."""
        parts = [self.engine, self.name]
        parts += [f"s{self.speed}"] if self.speed is not None else []
        parts += [f"p{self.pitch}"] if self.pitch is not None else []
        return ":".join(parts)


def max_voices() -> int:
    return len(VARIANTS) * len(SPEEDS) * len(PITCHES)


def voices_for(lang: str, n: int, seed: int = 0) -> list[Voice]:
    """n distinct espeak-ng voices for `lang`, deterministic in (lang, n, seed). Variants are drawn
    without replacement, so the first len(VARIANTS) voices all differ in variant; each voice also
    gets its own (variant, speed, pitch) combination."""
    if lang not in ESPEAK_LANG:
        raise ConfigError(f"no espeak-ng voice for language {lang!r}; available: {', '.join(sorted(ESPEAK_LANG))}")
    if not 1 <= n <= max_voices():
        raise ConfigError(f"number of voices must be 1..{max_voices()}, got {n}")
    rng = random.Random(f"{lang}:{seed}")
    combos = [(s, p) for s in SPEEDS for p in PITCHES]
    per_variant = {v: rng.sample(combos, len(combos)) for v in VARIANTS}  # each variant's combos, shuffled
    order = rng.sample(VARIANTS, len(VARIANTS))
    voices = []
    for i in range(n):
        variant = order[i % len(order)]
        speed, pitch = per_variant[variant][i // len(order)]
        voices.append(Voice("espeak-ng", f"{ESPEAK_LANG[lang]}+{variant}", speed, pitch))
    return voices


def flite_voices() -> list[Voice]:
    """flite's English voices (a voice family unlike espeak-ng's, e.g. for held-out tests)."""
    return [Voice("flite", name) for name in FLITE_VOICES]


def require(binary: str) -> str:
    """The path of an external program, or a ToolError naming the Debian package that provides it."""
    path = shutil.which(binary)
    if path is None:
        raise ToolError(f"{binary} is not installed: apt-get install {PACKAGE.get(binary, binary)} "
                        "(or `make sysdeps`)")
    return path


def _engine_command(voice: Voice, text_file: Path, wav: Path) -> list[str]:
    if voice.engine == "flite":
        if voice.name not in FLITE_VOICES:  # flite silently falls back to its default voice
            raise ConfigError(f"unknown flite voice {voice.name!r}; available: {', '.join(FLITE_VOICES)}")
        return [require("flite"), "-voice", voice.name, "-f", str(text_file), "-o", str(wav)]
    if voice.engine != "espeak-ng":
        raise ConfigError(f"unknown speech engine {voice.engine!r} (espeak-ng or flite)")
    cmd = [require("espeak-ng"), "-v", voice.name, "-w", str(wav), "-f", str(text_file)]
    cmd += ["-s", str(voice.speed)] if voice.speed is not None else []
    cmd += ["-p", str(voice.pitch)] if voice.pitch is not None else []
    return cmd


def _call(cmd: list[str], what: str) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolError(f"{what} could not run: {e}") from None
    if res.returncode != 0:
        raise ToolError(f"{what} failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()}")


def synthesize(text: str, voice: Voice, wav_path: str | Path) -> Path:
    """Speak `text` with `voice` into `wav_path`: 16 kHz mono 16-bit PCM WAV. Deterministic (sox
    without dither)."""
    if not text.strip():
        raise ConfigError("cannot synthesize an empty text")
    wav_path = Path(wav_path)
    with tempfile.TemporaryDirectory(prefix="moekit-tts-") as tmp:
        text_file, raw = Path(tmp) / "text.txt", Path(tmp) / "raw.wav"
        text_file.write_text(text, encoding="utf-8")
        _call(_engine_command(voice, text_file, raw), f"{voice.engine} (voice {voice.id})")
        _call([require("sox"), "-D", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", "-e", "signed-integer",
               str(wav_path)], f"sox resampling {voice.engine} output")
    return wav_path


def load_audio(path: str | Path) -> np.ndarray:
    """A 16 kHz mono 16-bit PCM WAV file as float32 samples in [-1, 1]."""
    try:
        with wave.open(str(path), "rb") as w:
            rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
            frames = w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise ConfigError(f"cannot read WAV file {path}: {e}") from None
    if (rate, channels, width) != (SAMPLE_RATE, 1, 2):
        raise ConfigError(f"{path}: expected 16 kHz mono 16-bit PCM, got {rate} Hz, {channels} channel(s), "
                          f"{8 * width}-bit (resample with e.g. `sox in.wav -r 16000 -c 1 -b 16 out.wav`)")
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
