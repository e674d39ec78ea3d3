"""Tiny randomly initialized HF models built from configs (no network), shipped for users' tests too."""
from __future__ import annotations

import torch
import transformers as tf

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _build(cls, config, seed: int):
    torch.manual_seed(seed)
    return cls(config).eval()


def tiny_llama(seed: int = 0, **kw):
    return _build(tf.LlamaForCausalLM, tf.LlamaConfig(**{**_DECODER, **kw}), seed)


def tiny_mistral(seed: int = 0, **kw):
    return _build(tf.MistralForCausalLM, tf.MistralConfig(**{**_DECODER, **kw}), seed)


def tiny_qwen2(seed: int = 0, **kw):
    return _build(tf.Qwen2ForCausalLM, tf.Qwen2Config(**{**_DECODER, **kw}), seed)


def tiny_qwen3(seed: int = 0, **kw):
    return _build(tf.Qwen3ForCausalLM, tf.Qwen3Config(**{**_DECODER, "head_dim": 8, **kw}), seed)


def tiny_gemma3(seed: int = 0, **kw):
    cfg = tf.Gemma3TextConfig(**{**_DECODER, "head_dim": 8, "sliding_window": 16, **kw})
    return _build(tf.Gemma3ForCausalLM, cfg, seed)


def tiny_gpt2(seed: int = 0, **kw):
    cfg = tf.GPT2Config(**{**dict(n_embd=32, n_layer=4, n_head=4, vocab_size=128, n_positions=64,
                                  bos_token_id=1, eos_token_id=2), **kw})
    return _build(tf.GPT2LMHeadModel, cfg, seed)


def tiny_bert(seed: int = 0, **kw):
    cfg = tf.BertConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=64), **kw})
    return _build(tf.BertForMaskedLM, cfg, seed)


def tiny_whisper(seed: int = 0, **kw):
    cfg = tf.WhisperConfig(**{**dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                                     vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1), **kw})
    return _build(tf.WhisperForConditionalGeneration, cfg, seed)


TINY_MODELS = {"llama": tiny_llama, "mistral": tiny_mistral, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3,
               "gemma3": tiny_gemma3, "gpt2": tiny_gpt2, "bert": tiny_bert, "whisper": tiny_whisper}


def tiny_inputs(model, batch: int = 2, length: int = 8, seed: int = 0) -> dict:
    """Model inputs of the right kind (token ids, or mel features + decoder ids for Whisper)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (batch, length), generator=g)
    if isinstance(model, tf.WhisperForConditionalGeneration):
        feats = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        return {"input_features": feats, "decoder_input_ids": ids}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def tiny_tokenizer():
    """A character-level tokenizer (< 128 ids) with pad/eos/unk, built offline for tiny models."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-\n"
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_chat_tokenizer():
    """The tiny character tokenizer with ChatML's turn markers as special tokens and a ChatML template."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


# transformers' own MoE families (v5 fused experts), tiny and random: for routing capture/selection tests
_MOE = dict(_DECODER, num_hidden_layers=3, intermediate_size=48)


def tiny_mixtral(seed: int = 0, **kw):
    cfg = tf.MixtralConfig(**{**_MOE, "num_local_experts": 8, "num_experts_per_tok": 2, **kw})
    return _build(tf.MixtralForCausalLM, cfg, seed)


def tiny_qwen2_moe(seed: int = 0, **kw):
    cfg = tf.Qwen2MoeConfig(**{**_MOE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                               "shared_expert_intermediate_size": 48, **kw})
    return _build(tf.Qwen2MoeForCausalLM, cfg, seed)


def tiny_qwen3_moe(seed: int = 0, **kw):
    cfg = tf.Qwen3MoeConfig(**{**_MOE, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 24, "norm_topk_prob": True, **kw})
    return _build(tf.Qwen3MoeForCausalLM, cfg, seed)


def tiny_olmoe(seed: int = 0, **kw):
    cfg = tf.OlmoeConfig(**{**_MOE, "num_experts": 8, "num_experts_per_tok": 2, "pad_token_id": 1, "eos_token_id": 2, **kw})
    return _build(tf.OlmoeForCausalLM, cfg, seed)


def tiny_phimoe(seed: int = 0, **kw):
    cfg = tf.PhimoeConfig(**{**_MOE, "num_local_experts": 8, "num_experts_per_tok": 2, **kw})
    return _build(tf.PhimoeForCausalLM, cfg, seed)


def tiny_deepseek_v3(seed: int = 0, **kw):
    cfg = tf.DeepseekV3Config(**{**_MOE, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                                 "topk_group": 1, "moe_intermediate_size": 24, "n_shared_experts": 1,
                                 "first_k_dense_replace": 1, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                                 "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, **kw})
    return _build(tf.DeepseekV3ForCausalLM, cfg, seed)


TINY_HF_MOE = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "qwen3_moe": tiny_qwen3_moe,
               "olmoe": tiny_olmoe, "phimoe": tiny_phimoe, "deepseek_v3": tiny_deepseek_v3}


# <|notimestamps|> must have the highest id: Whisper's generate reads every id above it as a timestamp
WHISPER_SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|sw|>", "<|de|>", "<|transcribe|>",
                    "<|notimestamps|>")


def _whisper_char_tokenizer():
    """Characters + Whisper's special tokens (<|endoftext|> is eos and pad), built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'-"
    vocab = {t: i for i, t in enumerate(["<unk>", *WHISPER_SPECIALS[:-1], *chars, WHISPER_SPECIALS[-1]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                      pad_token="<|endoftext|>", additional_special_tokens=list(WHISPER_SPECIALS[1:]))


def save_tiny_whisper_asr(folder, multilingual: bool = True, seed: int = 0, **config):
    """A tiny random Whisper with the real input and output lengths (80 mels, 30 s = 3000 frames -> 1500 positions;
    448 decoder positions), a character tokenizer with Whisper's special tokens, the feature extractor and a
    generation config (with language/task tokens when `multilingual`): a stand-in for a converted checkpoint in
    ASR tests. `config` overrides WhisperConfig fields. Returns `folder`."""
    tok = _whisper_char_tokenizer()
    ids = tok.convert_tokens_to_ids
    cfg = tf.WhisperConfig(**{**dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
        vocab_size=len(tok), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|endoftext|>"), decoder_start_token_id=ids("<|startoftranscript|>")), **config})
    model = _build(tf.WhisperForConditionalGeneration, cfg, seed)
    langs = [t for t in WHISPER_SPECIALS if len(t) == 6]  # <|xx|>
    # an English-only model has no lang_to_id at all (as moekit.assets.ct2 writes it): generate would detect a language
    multi = dict(lang_to_id={t: ids(t) for t in langs}, task_to_id={"transcribe": ids("<|transcribe|>")})
    model.generation_config = tf.GenerationConfig(
        decoder_start_token_id=cfg.decoder_start_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        no_timestamps_token_id=ids("<|notimestamps|>"), is_multilingual=multilingual, max_length=448,
        begin_suppress_tokens=[], suppress_tokens=[], **(multi if multilingual else {}))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    tf.WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    return folder


def save_tiny_wav2vec2_ctc(folder, texts, upper: bool = False, seed: int = 0):
    """A tiny random Wav2Vec2ForCTC with its processor (feature extractor and a character Wav2Vec2CTCTokenizer whose
    vocabulary is the characters of `texts` as spoken_text writes them, upper-cased with `upper`, as
    facebook/wav2vec2-base-960h's is): a stand-in for a pretrained CTC checkpoint in ASR tests. Returns `folder`."""
    import json
    import tempfile
    from pathlib import Path

    from moekit.speech.text import spoken_text

    chars = sorted({c for t in texts for c in spoken_text(t) if c != " "})
    chars = sorted({c.upper() for c in chars}) if upper else chars
    vocab = {"<pad>": 0, "<unk>": 1, "|": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        tok = tf.Wav2Vec2CTCTokenizer(str(Path(tmp) / "vocab.json"), word_delimiter_token="|")
    fe = tf.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                     return_attention_mask=True)
    cfg = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(16,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                            vocab_size=len(vocab), pad_token_id=0, ctc_loss_reduction="mean")
    _build(tf.Wav2Vec2ForCTC, cfg, seed).save_pretrained(folder)
    tf.Wav2Vec2Processor(feature_extractor=fe, tokenizer=tok).save_pretrained(folder)
    return folder


def save_tiny_parakeet_ctc(folder, texts, seed: int = 0):
    """A tiny random ParakeetForCTC (2 Conformer blocks, 16 mel bins) with its processor: Parakeet's feature extractor
    and a word-piece ParakeetTokenizer (byte-pair merges learned from `texts` as spoken_text writes them, every
    character of them in its alphabet, `<pad>` last as the CTC blank, as nvidia/parakeet-ctc-*'s): a stand-in for a
    pretrained Parakeet CTC checkpoint in ASR tests. Returns `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moekit.speech.text import spoken_text

    spoken = [spoken_text(t) for t in texts]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    alphabet = sorted({c for t in spoken for c in t if c != " "})
    bpe.train_from_iterator(spoken, trainers.BpeTrainer(vocab_size=len(alphabet) + 24, special_tokens=["<unk>"],
                                                        initial_alphabet=alphabet, show_progress=False))
    bpe.add_special_tokens(["<pad>"])
    tok = tf.ParakeetTokenizer(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>")
    encoder = tf.ParakeetEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, subsampling_conv_channels=8, num_mel_bins=16)
    cfg = tf.ParakeetCTCConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, encoder_config=encoder.to_dict())
    _build(tf.ParakeetForCTC, cfg, seed).save_pretrained(folder)
    tf.ParakeetProcessor(feature_extractor=tf.ParakeetFeatureExtractor(feature_size=16), tokenizer=tok
                         ).save_pretrained(folder)
    return folder


def randomized_moe(build, seed: int = 0, **spec):
    """A tiny model from `build` upcycled (4 experts, top-2, drop init; `spec` overrides MoESpec fields) with its
    routers and experts randomized, so that routing and experts differ (export and client tests)."""
    from moekit.moe.layer import moe_layers
    from moekit.moe.spec import MoESpec
    from moekit.checkpoint.upcycle_model import upcycle

    model = upcycle(build(), MoESpec(**{"num_experts": 4, "top_k": 2, "init": "drop", **spec}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, moe in moe_layers(model):
            moe.router.weight.copy_(torch.randn(moe.router.weight.shape, generator=g))
            for p in [*moe.experts.parameters(), *(moe.shared.parameters() if moe.shared else [])]:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()
