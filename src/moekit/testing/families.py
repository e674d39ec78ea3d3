"""Every family of the installed transformers, as a tiny random model: for the family tests (routing capture on the
MoE families, tests/test_families.py; upcycling the dense ones, tests/test_dense_families.py; upcycling the speech
ones, tests/test_speech_families.py).

The families are discovered from transformers itself (every causal-LM config whose fields name experts, or none), so
a family added by a new transformers release shows up in the tests without a hand-written list. A tiny instance
is the family's default config with its sizes shrunk by name (hidden and FFN sizes, heads, layers, experts, MLA
ranks, vocabulary); where a family's layer pattern mixes layer kinds (linear attention, Mamba, dense), the first
layers that hold every kind are kept.
"""
from __future__ import annotations

import re
import warnings

import torch

SMALL = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 64,
         "shared_expert_intermediate_size": 24, "expert_ffn_hidden_size": 24, "moe_shared_expert_intermediate_size": 24,
         "shared_experts_intermediate_size": 24, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
         "moe_num_experts": 4, "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "top_k": 2,
         "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "num_expert_group": 1, "q_lora_rank": 16,
         "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "qk_head_dim": 8,
         "ffn_hidden_size": 48, "d_model": 32, "n_heads": 4, "kv_n_heads": 4, "moe_top_k": 2, "moe_topk": 2,
         "zero_expert_num": 2, "top_k_experts": 2, "linear_head_dim": 8, "vocab_size_per_layer_input": 128,
         "hidden_size_per_layer_input": 8}
# constructor arguments of families whose config derives sizes from others when it is built: dots3_note_text's
# sliding-window layers (its swa_* aliases), whose head size must equal their own MLA head sizes, shrunk as SMALL
# shrinks the others; 3 layers (2 indexed, 1 sliding), so that its per-layer entries name no layer past the last.
# Zamba's and Zamba2's attention and Mamba head sizes (from the hidden size and head counts), xLSTM's model width
# (its hidden size, rounded up to 64 for its states: 128), HRM-Text's layers per stack (num_hidden_layers, turned
# into the count of slots its two stacks fill as they cycle), Cohere Compass's rotary table (none by default)
CONSTRUCT = {"dots3_note_text": {"num_hidden_layers": 3, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                                 "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16, "swa_head_dim": 8,
                                 "swa_qk_nope_head_dim": 4, "swa_v_head_dim": 8},
             "zamba": {"hidden_size": 32, "n_mamba_heads": 2, "mamba_dt_rank": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 4},
             "zamba2": {"hidden_size": 32, "num_hidden_layers": 3, "n_mamba_heads": 4, "mamba_d_state": 16,
                        "chunk_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4, "adapter_rank": 8,
                        "layers_block_type": ["linear_attention", "hybrid", "linear_attention"]},
             "xlstm": {"embedding_dim": 128, "num_blocks": 2, "num_heads": 4, "ffn_round_up_to_multiple_of": 16},
             "hrm_text": {"num_hidden_layers": 2},
             "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}}}
MOE_SWITCHES = ("enable_moe_block", "is_moe")  # families whose default config is dense
EXPERT_COUNTS = ("n_routed_experts",)  # MoE families whose default config leaves it unset (dots1: None)
# what a family's shrunk default config lacks to build and run (a dict: entries of a sub-config)
OVERRIDES = {"zaya": {"num_experts_per_tok": 1},  # its config validation (on reload) allows top-1 only
             "xlstm": {"hidden_size": 128},
             "rwkv": {"attention_hidden_size": 32, "intermediate_size": 48},
             "xmod": {"default_language": "en_XX", "is_decoder": True},  # its language adapters: one chosen
             # a causal LM, axial positions that sum to the shrunk width, chunks and heads within it
             "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": (8, 8),
                          "attention_head_size": 8, "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8,
                          "attn_layers": ["local", "lsh"]},
             "hrm_text": {"num_hidden_layers": 16},  # 2 layers a stack, 2 H-cycles of 3 L-cycles and 1 H-step
             # two hybrid layers, the first at index 2: the one whose shared block the others are tied to
             "zamba": {"layers_block_type": ["linear_attention", "linear_attention", "hybrid", "linear_attention",
                                             "hybrid"], "num_hidden_layers": 5},
             # no layer kinds listed, or none but linear attention among the first layers: a layer of each kind
             "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3,
                          "num_dense_layers": 1},
             "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention"],
                                  "num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                                  "mamba_chunk_size": 16},
             "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 4},
             "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_head": 16,
                       "mamba_d_state": 16, "mamba_chunk_size": 16},
             "recurrent_gemma": {"num_hidden_layers": 3, "lru_width": 32},
             "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 16, "chunk_size": 16, "n_groups": 1},
             # a layer of each kind, no KV sharing; activation sparsity on the first (as Gemma 3n's first 10 layers)
             "gemma3n_text": {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
                              "activation_sparsity_pattern": [0.95, 0.0], "intermediate_size": [48, 48]},
             "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # None defaults its forward rejects
             "hunyuan_v1_moe": {"head_dim": 8},
             "mimo_v2_flash": {"num_key_value_heads": 2},  # its sliding layers have twice the KV heads
             # its indexed-attention layers build the QSA indexer whether or not its (optional) sizes are set
             "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                                "indexer_compress_ratio": 2},
             "dots1": {"n_shared_experts": 1},  # unset by default (dots.llm1 has 2)
             "dots3_note_text": {"index_n_heads": 2, "index_head_dim": 8, "index_topk": 4},  # its DSA indexer
             "fun_asr_nano": {"adaptor_config": {"intermediate_size": 8}},  # a quarter of the shrunk LM's 32
             "moonshine_streaming": {"num_key_value_heads": 4},
             # its relative positions span the attention context: within the shrunk max_position_embeddings
             "granite_speech5_ctc": {"encoder_config": {"context_size": 16}},
             # a Mimi codec of 4 codebooks of 64 codes (upsampling groups within its shrunk width); the audio pad id
             # after the text vocabulary and the codebooks, as the model's embedding lays them out
             "kyutai_speech_to_text": {
                 "codec_config": {"upsample_groups": 32, "num_quantizers": 4, "codebook_size": 64, "codebook_dim": 16,
                                  "vector_quantization_hidden_dimension": 16},
                 "num_codebooks": 4, "codebook_vocab_size": 65, "audio_pad_token_id": 128 + 4 * 65,
                 "audio_bos_token_id": 64}}


def _model_types(moe: bool) -> dict[str, str]:
    """{model_type: causal-LM class name} of every transformers family whose config names experts (`moe`) or names
    none (one model type per class: the text-only variant where a multimodal one shares its class)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
            if f"{model_type}_text" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                continue  # a multimodal family's causal LM: its text-only config is the one to shrink
            try:
                cfg = AutoConfig.for_model(model_type)
            except Exception:  # noqa: BLE001 - a config that needs arguments is no family we can build by name
                continue
            text = str(cfg.to_dict())
            experts = re.search(r"['\"][a-z_]*expert[a-z_]*['\"]\s*:\s*\d", text) or any(
                re.search(rf"['\"]{key}['\"]\s*:", text) for key in (*MOE_SWITCHES, *EXPERT_COUNTS))
            if bool(experts) == moe and cls not in out.values():
                out[model_type] = cls
    return out


def moe_model_types() -> dict[str, str]:
    """Every MoE family of the installed transformers: {model_type: causal-LM class name}."""
    return _model_types(moe=True)


def dense_model_types() -> dict[str, str]:
    """Every family of the installed transformers with a causal LM and no experts: what upcycling starts from."""
    return _model_types(moe=False)


def _set(cfg, key: str, value) -> None:
    try:
        setattr(cfg, key, value)
    except (AttributeError, ValueError, TypeError):  # a derived property, or a per-layer attribute
        pass


def _shrink(cfg, cut_lists: bool = True) -> None:
    switched = any(getattr(cfg, key, None) is False for key in MOE_SWITCHES)
    for key in MOE_SWITCHES:
        if getattr(cfg, key, None) is False:
            _set(cfg, key, True)
    for key, value in SMALL.items():
        current = getattr(cfg, key, "absent")
        if (isinstance(current, int) and not isinstance(current, bool)) or (current is None and (
                switched or "expert" in key)):
            _set(cfg, key, value)
    if isinstance(getattr(cfg, "qk_rope_head_dim", None), int) and isinstance(getattr(cfg, "qk_nope_head_dim", None), int):
        _set(cfg, "head_dim", cfg.qk_rope_head_dim)  # multi-head latent attention: rotary embeddings span the rope part
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int):
            _set(cfg, key, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key])
    for sub in ("text_config", "ffn_config", "attn_config"):
        if getattr(cfg, sub, None) is not None and not isinstance(getattr(cfg, sub), dict):
            _shrink(getattr(cfg, sub), cut_lists)
    layers_key = "num_hidden_layers" if isinstance(getattr(cfg, "num_hidden_layers", None), int) else "num_layers"
    total = getattr(cfg, layers_key, None)
    # every per-layer list (attention kinds, dense/sparse MLPs) cut to the first layers that hold each kind
    lists = {k: v for k, v in vars(cfg).items() if cut_lists and isinstance(v, list) and v and len(v) == total
             and all(isinstance(x, (str, int)) for x in v)}
    n = max([2, *(max(v.index(x) for x in set(v)) + 1 for v in lists.values())])
    for key, kinds in lists.items():
        _set(cfg, key, kinds[:n])
    if isinstance(total, int):
        _set(cfg, layers_key, n)


def tiny_config(model_type: str, cut_lists: bool = True):
    """The family's default config, shrunk (module docstring); cut_lists=False keeps its per-layer lists whole
    (families whose layer kinds are derived from periods rather than listed)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **CONSTRUCT.get(model_type, {}))
    if model_type in CONSTRUCT:  # its per-layer sizes are shrunk: read and set the global ones beside them
        cfg.allow_global_per_layer_attribute_access = True
    elif cfg.to_dict().get("per_layer_config"):  # per-layer sizes (Gemma 4): one size for every layer instead
        cfg = AutoConfig.for_model(model_type, per_layer_config={})
    _shrink(cfg, cut_lists)
    _override(cfg, model_type)
    if model_type in CONSTRUCT:  # rebuilt, so what its constructor derives from the sizes (dots3_note_text's partial
        cfg = type(cfg).from_dict(cfg.to_dict())  # rotary factors) follows the shrunk ones, as on a reload
    return cfg


def _override(cfg, model_type: str) -> None:
    for key, value in OVERRIDES.get(model_type, {}).items():
        if isinstance(value, dict):  # entries of a sub-config
            for sub, entry in value.items():
                setattr(getattr(cfg, key), sub, entry)
        else:
            setattr(cfg, key, value)


def _perturb(model, amount: float, seed: int) -> None:
    """`amount` of seeded standard normal noise added to every floating-point parameter (none for 0)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters() if amount else ():
            if p.is_floating_point():
                p.add_(amount * torch.randn(p.shape, generator=g))


def tiny_family_model(model_type: str, seed: int = 0, edit=None, image_text: bool = False, perturb: float = 0.0):
    """A tiny random instance of the family's causal LM in float32, eval mode; raises what transformers raises when
    the shrunk config does not build or run (tests/test_families.py names those families). `edit(config)` changes
    the shrunk config before the model is built. `image_text`: the family's image-text-to-text model, its vision and
    audio encoders shrunk too. `perturb`: every floating-point parameter gets that much standard normal noise added
    (seeded), so no weight sits at its init (zero routers, unit norms)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    error = None
    for cut_lists in (True, False):
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = tiny_config(model_type, cut_lists)
                for sub in ("vision_config", "audio_config") if image_text else ():
                    if getattr(cfg, sub, None) is not None and not isinstance(getattr(cfg, sub), dict):
                        _shrink(getattr(cfg, sub), cut_lists)
                if edit is not None:
                    edit(cfg)
                auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
                model = auto.from_config(cfg).float().eval()
                with torch.no_grad():
                    model(input_ids=torch.randint(3, 100, (2, 5)))
                _perturb(model, perturb, seed)
            return model
        except Exception as e:  # noqa: BLE001 - the other variant may build; the first error is raised
            error = error or e
    raise error


SPEECH_SMALL = {"encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_layers": 2, "decoder_layers": 2,
                "encoder_ffn_dim": 48, "decoder_ffn_dim": 48, "d_model": 32, "num_mel_bins": 16,
                "max_source_positions": 64, "max_target_positions": 64, "encoder_hidden_size": 32,
                "decoder_hidden_size": 32, "speech_encoder_layers": 2}
_FEATURE_KEYS = ("num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", "feature_projection_input_dim")


def speech_model_types() -> dict[str, str]:
    """Every speech recognition family of the installed transformers: {model_type: class name} of its CTC and its
    speech-to-text (sequence-to-sequence or speech-LLM) classes."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CTC_MAPPING_NAMES,
                                                        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)

    return {**MODEL_FOR_CTC_MAPPING_NAMES, **MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}


def _shrink_speech(cfg) -> None:
    from transformers import PretrainedConfig

    _shrink(cfg)
    for key, value in SPEECH_SMALL.items():
        if isinstance(getattr(cfg, key, None), int):
            _set(cfg, key, value)
    if getattr(cfg, "vocab_size", 0) is None:  # CTC heads whose default config leaves the vocabulary to the user
        _set(cfg, "vocab_size", 128)
    for value in list(vars(cfg).values()):
        if isinstance(value, PretrainedConfig):  # audio and text sub-configs
            _shrink_speech(value)


def _speech_inputs(model, generator: torch.Generator):
    """Input candidates for a speech model: raw audio (B, samples), features as (B, bins, frames) or (B, frames,
    bins) for each feature size its configs name (and twice it, for stacked frames), or token ids (a speech-LLM's
    text path; with features of 8 frames per token where its forward requires both, as Voxtral-Realtime's; or a
    text token and K audio codes per step, as Kyutai's); a decoder's first tokens for an encoder-decoder."""
    from transformers import PretrainedConfig

    name = model.main_input_name
    dec = {"decoder_input_ids": torch.randint(3, 100, (2, 5), generator=generator)} \
        if model.config.is_encoder_decoder else {}
    configs = [model.config, *(v for v in vars(model.config).values() if isinstance(v, PretrainedConfig))]
    sizes = sorted({n * f for c in configs for k in _FEATURE_KEYS
                    if isinstance(n := getattr(c, k, None), int) for f in (1, 2, 4)})
    if name == "input_values":
        yield {name: torch.randn(2, 4000, generator=generator), **dec}
    elif name == "input_ids":
        ids = torch.randint(3, 100, (2, 6), generator=generator)
        yield {name: ids, **dec}
        for n in sizes:
            yield {name: ids, "input_features": torch.randn(2, n, 48, generator=generator), **dec}
        if isinstance(k := getattr(model.config, "num_codebooks", None), int):  # Kyutai: a text and K audio codes
            yield {name: torch.randint(3, 60, (2, 6, k + 1), generator=generator), **dec}
    else:
        for shape in [s for n in sizes for s in ((2, n, 128), (2, 128, n))] + [(2, n, 3000) for n in sizes]:
            yield {name: torch.randn(*shape, generator=generator), **dec}


def tiny_speech_model(model_type: str, seed: int = 0, perturb: float = 0.0):
    """(a tiny random instance of the family's speech recognition class in float32, eval mode; inputs it runs on):
    its default config shrunk by name, the first of _speech_inputs' candidates that runs. Raises what transformers
    raises when none builds and runs (tests/test_speech_families.py names those families). `perturb`: as
    tiny_family_model's."""
    from transformers import AutoConfig, AutoModelForCTC, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import MODEL_FOR_CTC_MAPPING_NAMES

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type)
        _shrink_speech(cfg)
        _override(cfg, model_type)
        auto = AutoModelForCTC if model_type in MODEL_FOR_CTC_MAPPING_NAMES else AutoModelForSpeechSeq2Seq
        model = auto.from_config(cfg).float().eval()
        model.config.validate()  # what save_pretrained checks (transformers 5's config validators)
        error = None
        for inputs in _speech_inputs(model, torch.Generator().manual_seed(seed)):
            try:
                with torch.no_grad():
                    model(**inputs)
                break
            except Exception as e:  # noqa: BLE001 - the next candidate may fit; the first error is raised
                error = error or e
        else:
            raise error or ValueError(f"no input for {type(model).__name__} (its main input {model.main_input_name})")
        _perturb(model, perturb, seed)
    return model, inputs
