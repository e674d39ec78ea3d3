"""Tiny random speech-LLMs of transformers' own classes, saved with a full processor (feature extractor, a character
tokenizer with the family's special tokens, a chat template), built offline: stand-ins for Qwen3-ASR-0.6B and
Qwen2-Audio in speech-LLM recipe tests. Their chat templates render the families' prompt layouts (ChatML turns, the
audio as start/placeholder/end tokens); a real checkpoint brings its own template. Nothing measured with them means
anything about the real models."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

CHARS = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"-()\n"
         "àâäçéèêëîïôöùûüÿñßáíóúõãœæåøÀÂÄÇÉÈÊËÎÏÔÖÙÛÜÑÁÍÓÚ")
# ChatML turns; an audio item is the family's start/placeholder/end; a final assistant turn is left open for the
# model to continue (continue_final_message)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'audio' %}AUDIO_ITEM{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% if not loop.last or m['role'] != 'assistant' %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3_ASR_AUDIO = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")
QWEN2_AUDIO_AUDIO = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, tie_word_embeddings=True)


def _tokenizer(audio: tuple[str, str, str], extra: tuple[str, ...] = ()):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *audio, *extra]
    vocab = {t: i for i, t in enumerate(["<unk>", *specials, *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = tf.Qwen2TokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                pad_token="<|endoftext|>", extra_special_tokens=dict(zip(
                                    ("audio_bos_token", "audio_token", "audio_eos_token"), audio)))
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tok


def _save(model, processor, folder) -> Path:
    ids = processor.tokenizer.convert_tokens_to_ids
    model.generation_config = tf.GenerationConfig(eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return Path(folder)


def save_tiny_qwen3_asr(folder, seed: int = 0, **text) -> Path:
    """Qwen3ASRForConditionalGeneration shaped like Qwen3-ASR-0.6B's kind (an 18→2-layer audio encoder, the adapter,
    a Qwen3 decoder of 8 blocks so that `every: 4` gives MoE layers 3 and 7), 16 mel bins."""
    tok = _tokenizer(QWEN3_ASR_AUDIO, ("<asr_text>",))
    ids = tok.convert_tokens_to_ids
    cfg = tf.Qwen3ASRConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                          output_dim=_TEXT["hidden_size"], downsample_hidden_size=8, n_window_infer=400),
        text_config={**_TEXT, "head_dim": 8, "vocab_size": len(tok), **text}, audio_token_id=ids("<|audio_pad|>"),
        timestamp_token_id=0, pad_token_id=ids("<|endoftext|>"), eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")])
    torch.manual_seed(seed)
    model = tf.Qwen3ASRForConditionalGeneration(cfg).eval()
    processor = tf.Qwen3ASRProcessor(feature_extractor=tf.Qwen3ASRFeatureExtractor(feature_size=16), tokenizer=tok,
                                     chat_template=CHAT_TEMPLATE.replace("AUDIO_ITEM", "".join(QWEN3_ASR_AUDIO)))
    return _save(model, processor, folder)


def save_tiny_qwen2_audio(folder, seed: int = 0, **text) -> Path:
    """Qwen2AudioForConditionalGeneration with a 2-layer Whisper-style encoder (16 mel bins, 30 s windows) and a
    Qwen2 decoder of 8 blocks."""
    tok = _tokenizer(QWEN2_AUDIO_AUDIO)
    ids = tok.convert_tokens_to_ids
    cfg = tf.Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=1, encoder_ffn_dim=32, d_model=16),
        text_config={**_TEXT, "vocab_size": len(tok), **text}, audio_token_index=ids("<|AUDIO|>"),
        pad_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    torch.manual_seed(seed)
    model = tf.Qwen2AudioForConditionalGeneration(cfg).eval()
    processor = tf.Qwen2AudioProcessor(feature_extractor=tf.WhisperFeatureExtractor(feature_size=16), tokenizer=tok,
                                       chat_template=CHAT_TEMPLATE.replace("AUDIO_ITEM", "".join(QWEN2_AUDIO_AUDIO)))
    return _save(model, processor, folder)


def write_wav(path, seconds: float, freq: float = 220.0, rate: int = 16000) -> Path:
    """A mono 16-bit PCM sine tone (a stand-in clip)."""
    import wave

    import numpy as np

    x = (0.3 * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(x.tobytes())
    return Path(path)


def save_tiny_covost(folder, directions=("de", "fr"), train: int = 6, test: int = 2, seconds: float = 1.0) -> Path:
    """CoVoST 2's release layout in miniature: clips/*.wav (sine tones, a pitch per sentence) and
    covost_v2.en_XX.{train,test}.tsv with path, sentence, translation, client_id; the translation of sentence i into
    XX is "XX i". Returns `folder`."""
    folder = Path(folder)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    for split, n, offset in (("train", train, 0), ("test", test, train)):
        for i in range(offset, offset + n):
            write_wav(folder / "clips" / f"c{i}.wav", seconds, 200.0 + 40 * i)
        for d in directions:
            lines = ["path\tsentence\ttranslation\tclient_id",
                     *(f"c{i}.wav\tsentence {i}\t{d} {i}\tspk{i % 2}" for i in range(offset, offset + n))]
            (folder / f"covost_v2.en_{d}.{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
