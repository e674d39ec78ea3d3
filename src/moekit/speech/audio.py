"""Audio clips as speech-LLM recipes read them: WAV through Python's `wave` (any rate, 8/16/32-bit PCM, any channel
count), every other container (Common Voice's MP3, FLAC, OGG) through `soundfile` when it is installed (the
optional extra `moekit[audio]`); mono float32 at 16 kHz (channels averaged, resampled by scipy's polyphase filter)."""
from __future__ import annotations

import io
import wave
from math import gcd
from pathlib import Path

import numpy as np

from moekit.errors import ConfigError

RATE = 16000
_PCM = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}  # width: dtype, offset, scale


class AudioError(ConfigError):
    """A clip that does not decode."""


def _wav(source: Path | bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), "rb") as w:
        rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        frames = w.readframes(w.getnframes())
    if width not in _PCM:
        raise wave.Error(f"{8 * width}-bit samples")
    dtype, offset, scale = _PCM[width]
    samples = (np.frombuffer(frames, dtype=dtype).astype(np.float32) - offset) / scale
    return samples.reshape(-1, channels).mean(axis=1), rate


def _soundfile(source: Path | bytes) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError:
        raise AudioError("decoding audio other than WAV needs the soundfile package (pip install 'moekit[audio]')") \
            from None
    data, rate = soundfile.read(io.BytesIO(source) if isinstance(source, bytes) else str(source), dtype="float32",
                                always_2d=True)
    return data.mean(axis=1), rate


def is_wav(source: Path | bytes) -> bool:
    """Whether the clip (a file or its bytes) is a RIFF/WAVE file."""
    head = source[:12] if isinstance(source, bytes) else _head(source)
    return head[:4] == b"RIFF" and head[8:12] == b"WAVE"


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(12)


def decode(source: Path | bytes, where: str) -> np.ndarray:
    """The clip (a file or its bytes) as mono float32 samples at 16 kHz; AudioError naming `where` if it does not
    decode."""
    try:
        samples, rate = (_wav if is_wav(source) else _soundfile)(source)
    except AudioError:
        raise
    except Exception as e:  # noqa: BLE001  (wave, soundfile and the OS raise many types for a bad clip)
        raise AudioError(f"{where} does not decode as audio ({type(e).__name__}: {e})") from None
    if not samples.size:
        raise AudioError(f"{where} holds no audio samples")
    return resample(samples, rate)


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """`samples` at `rate` Hz resampled to 16 kHz (unchanged at 16 kHz)."""
    if rate == RATE:
        return samples.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = gcd(RATE, rate)
    return resample_poly(samples, RATE // g, rate // g).astype(np.float32)
