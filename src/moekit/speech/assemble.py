"""A speech-LLM assembled from shipped parts the way Qwen2-Audio and Qwen3-ASR are built: a Whisper encoder, an
adapter into the text embedding space, a decoder-only LM, saved as transformers' Qwen2AudioForConditionalGeneration
with its processor, so that the folder loads with plain transformers (AutoModelForSpeechSeq2Seq, AutoProcessor) and
trains with `task: speech_llm` recipes (moekit.speech.llm's qwen2_audio family).

  audio_tower            Qwen2AudioEncoder, whose layers are Whisper's encoder layers (transformers copies them from
                         WhisperEncoder): Whisper's weights as they are. Qwen2-Audio adds a 2x average pooling before
                         the final LayerNorm (Whisper's own LayerNorm), and masks padded frames in attention.
                         `window_seconds` below Whisper's 30 shortens the input window (positions truncated to the
                         first ones): with padding masked, the states of the real frames are the same for any window
                         that holds the clip (tested), and the encoder's work shrinks with the window.
  multi_modal_projector  the adapter, one Linear (Qwen2-Audio's), freshly initialized: weight N(0, s^2) with s chosen
                         so its outputs have the rms of the LM's token embeddings, bias 0 (seeded).
  language_model, lm_head  the LM's decoder and output layer as they are. Three audio tokens are added to its
                         tokenizer (Qwen2-Audio's <|audio_bos|>, <|AUDIO|>, <|audio_eos|>); their embedding rows are
                         the mean embedding. Qwen2-Audio's class has its own lm_head (no tying): an LM with tied
                         embeddings starts with a copy of them, and the two then train apart.
  processor              Qwen2AudioProcessor: the Whisper checkpoint's feature extractor (window_seconds), the LM's
                         tokenizer with the audio tokens, a ChatML chat template (audio as bos/placeholder/eos).
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from moekit._fs import output
from moekit.errors import AssetError

AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
# ChatML turns (SmolLM2's own format), no default system turn; audio items as Qwen2-Audio writes them
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'audio' %}" + "".join(AUDIO_TOKENS) +
    "\n{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if not loop.last or m['role'] != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WHISPER_WINDOW = 30  # seconds: Whisper's input window (1500 encoder positions)


def assemble_speech_llm(whisper: str | Path, lm: str | Path, out: str | Path, window_seconds: int = WHISPER_WINDOW,
                        seed: int = 0, overwrite: bool = False) -> Path:
    """Write the speech-LLM of the Whisper checkpoint in `whisper` (its encoder and feature extractor) and the
    causal LM in `lm` (with its tokenizer) into `out`, atomically (see the module doc)."""
    import transformers as tf

    if not 1 <= window_seconds <= WHISPER_WINDOW:
        raise AssetError(f"the audio window must be 1 to {WHISPER_WINDOW} seconds (Whisper's), not {window_seconds}")
    with output(out, [whisper, lm], overwrite) as tmp, contextlib.redirect_stderr(io.StringIO()):
        encoder = _load(tf.WhisperForConditionalGeneration, whisper).model.encoder
        causal = _load(tf.AutoModelForCausalLM, lm)
        tok = tf.AutoTokenizer.from_pretrained(lm)
        if tok.eos_token_id is None:
            raise AssetError(f"the tokenizer in {lm} has no eos token (a speech-LLM's outputs end with it)")
        tok.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)}, replace_extra_special_tokens=False)
        model = _combine(encoder, causal, len(tok), tok.convert_tokens_to_ids(AUDIO_TOKENS[1]), window_seconds, seed)
        model.generation_config = tf.GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=_pad(tok))
        features = tf.WhisperFeatureExtractor.from_pretrained(whisper, chunk_length=window_seconds)
        processor = tf.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok, chat_template=CHAT_TEMPLATE)
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return Path(out)


def _load(cls, folder):
    try:
        return cls.from_pretrained(folder, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as e:
        raise AssetError(f"cannot load {folder} as {cls.__name__}: {' '.join(str(e).split())[:300]}") from None


def _pad(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def encoder_config(whisper_config, window_seconds: int) -> dict:
    """Qwen2AudioEncoderConfig fields of a Whisper config, the positions cut to `window_seconds`."""
    keys = ("num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model",
            "activation_function", "scale_embedding", "max_source_positions")
    cfg = {k: getattr(whisper_config, k) for k in keys}
    cfg["max_source_positions"] = cfg["max_source_positions"] * window_seconds // WHISPER_WINDOW
    return {**cfg, "model_type": "qwen2_audio_encoder", "dropout": 0.0, "attention_dropout": 0.0,
            "activation_dropout": 0.0, "encoder_layerdrop": 0.0}


def _combine(encoder, causal, vocab: int, audio_token: int, window_seconds: int, seed: int):
    import transformers as tf
    from transformers.initialization import no_init_weights

    text = causal.config.to_dict()
    text.update(vocab_size=vocab, tie_word_embeddings=False)
    config = tf.Qwen2AudioConfig(audio_config=encoder_config(encoder.config, window_seconds), text_config=text,
                                 audio_token_index=audio_token, pad_token_id=causal.config.pad_token_id)
    with no_init_weights():
        model = tf.Qwen2AudioForConditionalGeneration(config)
    enc = encoder.state_dict()
    enc["embed_positions.weight"] = enc["embed_positions.weight"][:config.audio_config.max_source_positions]
    model.model.audio_tower.load_state_dict(enc)
    _resize(causal, vocab)
    model.model.language_model.load_state_dict(causal.model.state_dict())
    model.lm_head.weight.data.copy_(causal.get_output_embeddings().weight)
    _init_adapter(model.model.multi_modal_projector.linear, causal.get_input_embeddings().weight, seed)
    return model.eval()


@torch.no_grad()
def _resize(causal, vocab: int) -> None:
    """The LM's vocabulary grown to `vocab` rows, the new input and output rows the mean of the old ones."""
    old = causal.get_input_embeddings().weight.shape[0]
    causal.resize_token_embeddings(vocab, mean_resizing=False)
    for layer in {causal.get_input_embeddings(), causal.get_output_embeddings()}:
        layer.weight[old:] = layer.weight[:old].mean(0)


@torch.no_grad()
def _init_adapter(linear: torch.nn.Linear, embeddings: torch.Tensor, seed: int) -> None:
    """N(0, s^2) weights, s = rms(embeddings) / sqrt(in_features): unit-rms inputs (the encoder ends in a LayerNorm)
    give outputs of the embeddings' rms; bias 0."""
    gen = torch.Generator().manual_seed(seed)
    std = embeddings.float().pow(2).mean().sqrt() / linear.in_features ** 0.5
    linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
    linear.bias.zero_()
