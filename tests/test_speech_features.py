import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from moekit.errors import ConfigError
from moekit.speech.features import log_mel, spec_augment, stack_frames


@pytest.fixture(scope="module")
def audios():
    rng = np.random.default_rng(0)
    t = np.arange(16000) / 16000
    return [(0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
            (0.1 * rng.standard_normal(5000)).astype(np.float32)]


def test_log_mel_whisper_input(audios):
    feats, lengths = log_mel(audios, pad_to_30s=True)
    assert feats.shape == (2, 3000, 80) and lengths.tolist() == [100, 31]
    direct = WhisperFeatureExtractor(feature_size=80)(audios, sampling_rate=16000, return_tensors="pt")
    assert torch.equal(feats.transpose(1, 2), direct["input_features"])  # (B, 80, 3000), as Whisper takes it


def test_log_mel_ctc_input(audios):
    feats, lengths = log_mel(audios, pad_to_30s=False)
    assert feats.shape == (2, 100, 80) and lengths.tolist() == [100, 31]
    direct = WhisperFeatureExtractor(feature_size=80)(audios, sampling_rate=16000, padding="longest",
                                                      truncation=False, return_tensors="pt")
    assert torch.equal(feats, direct["input_features"].transpose(1, 2))
    alone, n = log_mel(audios[1:], pad_to_30s=False)
    assert alone.shape == (1, 31, 80) and n.tolist() == [31]  # the same length whatever the batch
    with pytest.raises(ConfigError):
        log_mel([], pad_to_30s=False)


def test_stack_frames_exact():
    feats = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2)  # (B=2, T=5, F=2)
    stacked, lengths = stack_frames(feats, torch.tensor([5, 2]), factor=2)
    assert stacked.shape == (2, 3, 4)
    assert stacked[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]  # last frame zero-padded
    assert stacked[1].tolist() == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 0, 0]]
    assert lengths.tolist() == [3, 1]
    four, n4 = stack_frames(torch.ones(1, 8, 80), torch.tensor([7]))  # default ×4: 10 ms -> 40 ms frames
    assert four.shape == (1, 2, 320) and n4.tolist() == [2]
    with pytest.raises(ConfigError):
        stack_frames(feats, torch.tensor([5, 2]), factor=0)


def _augment(seed, lengths=(400, 200, 5), **kw):
    feats = torch.ones(3, 400, 80)  # (B, T, F), padding marked with 7
    for i, n in enumerate(lengths):
        feats[i, n:] = 7.0
    return feats, spec_augment(feats, torch.tensor(lengths), torch.Generator().manual_seed(seed), **kw)


def test_spec_augment_time_masks_inside_valid_lengths():
    for seed in range(20):
        feats, out = _augment(seed, freq_masks=0)
        masked = out == 0  # (B, T, F)
        assert torch.equal(masked.any(-1), masked.all(-1))  # time masks cover whole frames
        for i, (n, cap) in enumerate([(400, 20), (200, 10), (5, 0)]):  # width ≤ min(100, 0.05 · length)
            assert not masked[i, n:].any() and torch.equal(out[i, n:], feats[i, n:])
            assert masked[i].all(-1).sum() <= 2 * cap
    assert sum(bool((_augment(s, freq_masks=0)[1] == 0).any()) for s in range(20)) > 10  # masks do happen


def test_spec_augment_freq_masks_inside_valid_lengths():
    for seed in range(20):
        feats, out = _augment(seed, time_masks=0)
        for i, n in enumerate((400, 200, 5)):
            masked = out[i] == 0  # (T, F)
            assert not masked[n:].any()
            assert torch.equal(masked[:n], masked[:1].expand(n, -1))  # the same bins in every valid frame
            assert masked[0].sum() <= 2 * 27


def test_spec_augment_reproducible_and_pure():
    feats, a = _augment(3)
    _, b = _augment(3)
    _, c = _augment(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (feats != 0).all()  # the input is not modified
    _, custom = _augment(3, value=-1.0, freq_width=0, time_width=3, time_width_ratio=1.0)
    frames = (custom == -1.0).all(-1)  # (B, T)
    assert frames.any() and frames.sum(-1).max() <= 2 * 3
