"""Acoustic features: Whisper's 80-bin log-mel spectrogram, frame stacking and SpecAugment."""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from moekit.errors import ConfigError
from moekit.speech.tts import SAMPLE_RATE

N_MELS = 80
HOP = 160  # samples per frame (10 ms)


@lru_cache(maxsize=1)
def _extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=N_MELS)


def log_mel(audios: Sequence[np.ndarray], pad_to_30s: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Whisper's log-mel features (25 ms windows, 10 ms hop, 80 mels; Radford et al. 2022) of 16 kHz
    float waveforms, computed by transformers' `WhisperFeatureExtractor(feature_size=80)`.

    Returns (features (B, T, 80), frame lengths (B,)); length = samples // 160, as for the audio
    alone whatever the batch, and frames past it are padding. pad_to_30s=True (Whisper's input):
    audio padded or cut to 30 s, T = 3000 (Whisper models take `features.transpose(1, 2)`).
    pad_to_30s=False (CTC encoders): padded to the longest audio, T = longest samples // 160."""
    if not len(audios):
        raise ConfigError("log_mel needs at least one audio")
    audios = [np.asarray(a, dtype=np.float32) for a in audios]
    if pad_to_30s:
        out = _extractor()(audios, sampling_rate=SAMPLE_RATE, return_tensors="pt")
    else:
        out = _extractor()(audios, sampling_rate=SAMPLE_RATE, padding="longest", truncation=False,
                           return_tensors="pt")
    feats = out["input_features"].transpose(1, 2).contiguous()  # (B, 80, T) -> (B, T, 80)
    return feats, torch.tensor([min(len(a) // HOP, feats.shape[1]) for a in audios])  # (B,)


def stack_frames(feats: torch.Tensor, lengths: torch.Tensor, factor: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate each `factor` consecutive frames into one (Omni-router, Gu et al. 2025, §5.3:
    10 ms frames x 4 -> 40 ms): (B, T, F) -> (B, ceil(T / factor), factor * F), the last frame
    zero-padded; lengths -> ceil(lengths / factor)."""
    if factor < 1:
        raise ConfigError(f"stacking factor must be ≥ 1, got {factor}")
    b, t, f = feats.shape
    pad = -t % factor
    feats = torch.nn.functional.pad(feats, (0, 0, 0, pad))  # (B, T + pad, F)
    stacked = feats.reshape(b, (t + pad) // factor, factor * f)  # (B, T', factor·F)
    return stacked, torch.div(lengths + factor - 1, factor, rounding_mode="floor")  # (B,)


def _spans(n: int, max_width: torch.Tensor, limit: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(B, n, 2) [start, end) spans: width ~ U{0..max_width}, start ~ U{0..limit - width} per row."""
    b = max_width.shape[0]
    width = (torch.rand(b, n, generator=generator) * (max_width[:, None] + 1)).floor()  # (B, n)
    start = (torch.rand(b, n, generator=generator) * (limit[:, None] - width + 1)).floor()  # (B, n)
    return torch.stack([start, start + width], dim=-1).long()  # (B, n, 2)


def _covered(spans: torch.Tensor, size: int) -> torch.Tensor:
    """(B, size) bool: positions inside any of the (B, n, 2) spans."""
    pos = torch.arange(size)[None, None, :]  # (1, 1, size)
    inside = (pos >= spans[..., :1]) & (pos < spans[..., 1:])  # (B, n, size)
    return inside.any(dim=1)  # (B, size)


def spec_augment(feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator, freq_masks: int = 2,
                 freq_width: int = 27, time_masks: int = 2, time_width: int = 100, time_width_ratio: float = 0.05,
                 value: float = 0.0) -> torch.Tensor:
    """SpecAugment frequency and time masking (Park et al. 2019, §2; defaults: their LibriSpeech
    Double policy LD, F=27, m_F=2, m_T=2, T=100, with the time-mask width capped by
    `time_width_ratio` x the utterance length, the adaptive masks of Park et al. 2020). Time warping
    is not applied. feats (B, T, F) with valid frames [0, lengths); masks touch only valid frames,
    are set to `value`, and are drawn from `generator` (same generator state -> same masks).
    Returns a new tensor."""
    b, t, f = feats.shape
    lengths = lengths.to(torch.float32)  # (B,)
    fspans = _spans(freq_masks, torch.full((b,), float(min(freq_width, f))), torch.full((b,), float(f)), generator)
    t_max = torch.minimum(torch.full((b,), float(time_width)), (time_width_ratio * lengths).floor())  # (B,)
    tspans = _spans(time_masks, t_max, lengths, generator)  # (B, m_T, 2)
    valid = torch.arange(t)[None, :] < lengths[:, None]  # (B, T)
    mask = _covered(fspans, f)[:, None, :] | _covered(tspans, t)[:, :, None]  # (B, T, F)
    return feats.masked_fill(mask & valid[:, :, None], value)  # (B, T, F)
