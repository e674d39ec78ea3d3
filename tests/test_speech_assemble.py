"""moekit.speech.assemble: a Whisper encoder + adapter + causal LM assembled as transformers' Qwen2-Audio class,
checked on tiny stand-ins (tiny Whisper, tiny SmolLM2-shaped Llama) against the parts it was built from."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from moekit.speech.assemble import AUDIO_TOKENS, assemble_speech_llm
from moekit.testing import save_tiny_whisper_asr
from moekit.testing.standins import WHISPER, save_tiny_chat_llama


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("assemble")
    whisper, lm = save_tiny_whisper_asr(root / "whisper", **WHISPER), save_tiny_chat_llama(root / "lm")
    return {"whisper": whisper, "lm": lm, "speech": assemble_speech_llm(whisper, lm, root / "speech"),
            "short": assemble_speech_llm(whisper, lm, root / "short", window_seconds=10)}


def _pre_norm(encoder, features: torch.Tensor) -> torch.Tensor:
    """The encoder's states before its final LayerNorm (a hook on that LayerNorm's input)."""
    seen = []
    handle = encoder.layer_norm.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        encoder(features)
    handle.remove()
    return seen[0]


def test_audio_tower_is_whispers_encoder(parts):
    whisper = tf.WhisperForConditionalGeneration.from_pretrained(parts["whisper"]).eval().model.encoder
    model = tf.AutoModelForMultimodalLM.from_pretrained(parts["speech"]).eval()  # plain transformers
    assert type(model) is tf.Qwen2AudioForConditionalGeneration
    tower = model.model.audio_tower
    features = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0))
    states = _pre_norm(whisper, features)  # (B, 1500, D): Whisper's layers
    pooled = torch.nn.functional.avg_pool1d(states.transpose(1, 2), 2, 2).transpose(1, 2)  # (B, 750, D)
    assert torch.equal(_pre_norm(tower, features), pooled)  # the same layers, then Qwen2-Audio's pooling
    with torch.no_grad():
        assert torch.equal(tower(features).last_hidden_state, whisper.layer_norm(pooled))  # Whisper's LayerNorm


def test_text_logits_are_the_lms(parts):
    lm = tf.AutoModelForCausalLM.from_pretrained(parts["lm"]).eval()
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(parts["speech"]).eval()
    ids = torch.randint(0, lm.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = lm(input_ids=ids).logits, model(input_ids=ids).logits
    assert got.shape[-1] == lm.config.vocab_size + len(AUDIO_TOKENS)
    assert torch.equal(got[..., :lm.config.vocab_size], want)


def test_processor_expands_audio_and_window_changes_nothing_for_the_clip(parts):
    """A 10 s window gives the real frames of a 3 s clip the states the 30 s window gives them (padding masked)."""
    import numpy as np

    clip = np.random.default_rng(0).standard_normal(48000).astype("float32") * 0.1
    states = {}
    for name in ("speech", "short"):
        proc = tf.AutoProcessor.from_pretrained(parts[name])
        model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(parts[name]).eval()
        text = proc.apply_chat_template([[{"role": "user", "content": [{"type": "audio"}]}]], tokenize=False,
                                        add_generation_prompt=True)
        enc = proc(text=text, audio=[clip], sampling_rate=16000, return_tensors="pt")
        audio_id = proc.tokenizer.convert_tokens_to_ids(AUDIO_TOKENS[1])
        assert int((enc["input_ids"] == audio_id).sum()) == 75  # 3 s: 300 frames -> 150 positions -> 75 tokens
        with torch.no_grad():
            out = model(**enc, output_hidden_states=True)
        states[name] = out.hidden_states[-1][enc["input_ids"] == audio_id]  # the LM's states at the audio tokens
    assert torch.allclose(states["short"], states["speech"], atol=1e-5)
