"""Upcycling on every dense family of the installed transformers (discovered from transformers itself:
moekit.testing.families), in memory and streamed from a checkpoint: UME's MoE (copies, renormalized top-k) must
compute what the dense model computes, or the family is refused in one line that says why. Each tiny model is made
adversarial for the FFN reader: every weight is perturbed (norms and learned activations away from their init) and
every config multiplier moved away from 1, so a norm, a scale or a learned activation inside an MLP that moekit
would drop changes the output. The families the harness cannot build and those moekit refuses are listed here with
the reason (docs/guides/upcycle.md, "Families"), so a family that a new transformers adds or fixes shows up as a
failure to update these lists."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import PretrainedConfig

from moekit import upcycle, upcycle_checkpoint
from moekit.checkpoint.format import load
from moekit.config import validate
from moekit.errors import MoekitError, UnsupportedModelError
from moekit.moe import MoELayer, MoESpec, moe_layers
from moekit.testing.families import dense_model_types, tiny_config, tiny_family_model

FAMILIES = sorted(dense_model_types())
SPEC = {"num_experts": 4, "top_k": 2, "init": "ume"}
# not built: too costly for the suite (what building them takes)
NOT_BUILT = {"blt": "its default sub-configs are not shrunk by name: gigabytes of weights",
             "phi4_multimodal": "its default vision and audio encoders are not shrunk by name: 35 s a build"}
# the shrunk default config does not build or run in transformers 5.23 (why)
HARNESS_CANNOT_BUILD = {
    "gemma4_unified_assistant": "head_dim is a per-layer attribute",
    "musicgen": "its decoder config has no dropout",
    "musicgen_melody": "its decoder config has no dropout",
    "prophetnet": "it takes encoder and decoder layer counts, not num_hidden_layers",
    "xlnet": "it has no sequence length limit",
}
# moekit refuses these families, with the words of its one-line refusal
NO_FFN, NOT_FAITHFUL = "no supported FFN", "does not compute what moekit"
REFUSED = {
    "apertus": NOT_FAITHFUL,  # xIELU: an activation with learned parameters
    "bitnet": NOT_FAITHFUL,  # ffn_sub_norm between the activation and down_proj
    "gemma3n_text": NOT_FAITHFUL,  # activation sparsity (a Gaussian top-k of the gate) in its first layers
    "roberta-prelayernorm": NOT_FAITHFUL,  # a LayerNorm inside its intermediate module
    "cpmant": NO_FFN, "ctrl": NO_FFN, "falcon_mamba": NO_FFN, "mamba": NO_FFN, "mamba2": NO_FFN,
    "xlm": NO_FFN,
    "zamba": NO_FFN, "zamba2": NO_FFN,  # one MLP, in a transformer block its hybrid layers share (Zamba2's: with LoRA)
    "reformer": NO_FFN,  # its feed-forward runs in chunks (ChunkReformerFeedForward)
    "rwkv": NO_FFN,  # channel mixing: a token shift, a squared ReLU and a receptance gate
}


MORE_SMALL = {"encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_layers": 2, "decoder_layers": 2,
              "encoder_ffn_dim": 48, "decoder_ffn_dim": 48, "rotary_dim": 4, "n_head": 4, "n_inner": 48, "decoder_vocab_size": 128}


def _adversarial(cfg) -> None:
    """The shrunk config made buildable for more dense families (encoder-decoder and partial-rotary sizes, a missing
    head count, head size or rope theta) and every multiplier away from 1 (Granite's, Falcon-H1's ...)."""
    for key, value in MORE_SMALL.items():
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, value)
    if getattr(cfg, "num_key_value_heads", 0) is None:
        cfg.num_key_value_heads = cfg.num_attention_heads
    if getattr(cfg, "head_dim", 0) is None:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_theta", 0) is None:
        rope["rope_theta"] = 10000.0
    for key, value in list(vars(cfg).items()):
        if isinstance(value, PretrainedConfig):  # text_config, vision_config ...
            _adversarial(value)
        if "multiplier" not in key:
            continue
        if isinstance(value, float):
            setattr(cfg, key, value * 1.5)
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            setattr(cfg, key, [v * (1.5 - 0.7 * (i % 2)) for i, v in enumerate(value)])


def _dense(family: str, image_text: bool = False):
    return tiny_family_model(family, edit=_adversarial, image_text=image_text, perturb=0.05)


def _logits(model) -> torch.Tensor:
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


# the streaming upcycle refuses these (in one line with these words); in memory they upcycle exactly
STREAM_REFUSED = {"olmo_hybrid": "transformers builds"}  # its q/k/v convolutions are concatenated on load
BUILT = [f for f in FAMILIES if f not in HARNESS_CANNOT_BUILD and f not in NOT_BUILT]


def test_every_discovered_family_is_built_or_listed():
    listed = [NOT_BUILT, HARNESS_CANNOT_BUILD, REFUSED, STREAM_REFUSED]
    assert all(set(d) <= set(FAMILIES) for d in listed) and not set(NOT_BUILT) & set(HARNESS_CANNOT_BUILD)
    for family in HARNESS_CANNOT_BUILD:
        with pytest.raises(Exception):  # noqa: B017 - the day it builds, it must join the tests below
            _dense(family)


@pytest.mark.parametrize("family", BUILT)
def test_ume_in_memory_equals_the_dense_family_or_refuses_in_one_line(family):
    dense = _dense(family)
    want = _logits(dense)
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    if family in REFUSED:
        with pytest.raises(UnsupportedModelError, match=REFUSED[family]) as e:
            upcycle(dense, validate(MoESpec, SPEC))
        assert "\n" not in str(e.value)
        after = dense.state_dict()  # refused before any layer changed
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
        return
    moe = upcycle(dense, validate(MoESpec, SPEC))
    assert any(isinstance(m, MoELayer) for m in moe.modules())
    torch.testing.assert_close(_logits(moe), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", BUILT)
def test_ume_streamed_equals_the_dense_family_or_refuses_in_one_line(family, tmp_path):
    dense = _dense(family)
    want = _logits(dense)
    dense.save_pretrained(tmp_path / "dense")
    out = tmp_path / "moe"
    if family in REFUSED or family in STREAM_REFUSED:
        with pytest.raises(MoekitError, match={**REFUSED, **STREAM_REFUSED}[family]) as e:
            upcycle_checkpoint(tmp_path / "dense", out, validate(MoESpec, SPEC))
        assert "\n" not in str(e.value) and not out.exists()
        return
    upcycle_checkpoint(tmp_path / "dense", out, validate(MoESpec, SPEC))
    torch.testing.assert_close(_logits(load(out)), want, rtol=1e-5, atol=1e-5)


EXACT = [f for f in BUILT if f not in REFUSED and f not in STREAM_REFUSED]


@pytest.mark.parametrize("family", EXACT)
def test_spri_on_every_family_keeps_the_dense_model_and_its_groups(family, tmp_path):
    """SPRI (Gao et al. 2025, eq. 8: the dense FFN as the shared expert, routed experts from scaled residual SVD
    blocks) on every family UME upcycles: with ρ = 0 the routed experts add nothing and the MoE computes the dense
    model (1e-5); with the default ρ and ε = 0, every layer's expert diversity (A.1) is 1 − same-group pairs / all
    pairs = 1 − 2/6 at E = 4, k = 2 (the k members of a group are one block, the E/k groups orthogonal), and the
    streamed upcycle computes what the in-memory one computes."""
    from moekit.moe.diversity import expert_diversity

    dense = _dense(family)
    want = _logits(dense)
    spec = {"num_experts": 4, "top_k": 2, "shared_expert": True, "init": {"method": "spri", "eps": 0.0}}
    zero = validate(MoESpec, {**spec, "init": {"method": "spri", "eps": 0.0, "rho": 0.0}})
    torch.testing.assert_close(_logits(upcycle(copy.deepcopy(dense), zero)), want, rtol=1e-5, atol=1e-5)
    dense.save_pretrained(tmp_path / "dense")
    moe = upcycle(dense, validate(MoESpec, spec))
    assert all(expert_diversity(m.experts.down) == pytest.approx(1 - 2 / 6, abs=1e-6) for _, m in moe_layers(moe))
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", validate(MoESpec, spec))
    torch.testing.assert_close(_logits(load(tmp_path / "moe")), _logits(moe), rtol=1e-5, atol=1e-5)


# config options a family's default leaves off, flipped one at a time on a sample of widely used families (a sweep of
# every family with every option they have found nothing beyond the refusals above; this keeps a sample of it)
OPTIONS = {"mlp_bias": True, "attention_bias": True, "tie_word_embeddings": True, "hidden_act": "relu2"}
OPTION_SAMPLE = [(f, k) for f in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "olmo2", "granite", "glm4",
                                  "stablelm", "gpt_neox", "bert") for k, v in OPTIONS.items()
                 if getattr(tiny_config(f), k, v) != v]  # the options each family's config has, off by default


@pytest.mark.parametrize("family,option", OPTION_SAMPLE)
def test_ume_stays_exact_with_config_options_flipped(family, option, tmp_path):
    def edit(cfg):
        _adversarial(cfg)
        setattr(cfg, option, OPTIONS[option])

    dense = tiny_family_model(family, edit=edit, perturb=0.05)
    want = _logits(dense)
    dense.save_pretrained(tmp_path / "dense")
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", validate(MoESpec, SPEC))
    torch.testing.assert_close(_logits(upcycle(dense, validate(MoESpec, SPEC))), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(load(tmp_path / "moe")), want, rtol=1e-5, atol=1e-5)


# vision-language models (image-text-to-text classes): not swept, a sample of widely used families; True where
# transformers 5.23 saves the checkpoint under other names than the model's (language_model.model.* ...)
VLM_SAMPLE = {"gemma3": True, "idefics3": False, "internvl": True, "llava": True, "llava_next": True, "mistral3": True,
              "mllama": True, "paligemma": True, "qwen3_vl": False, "smolvlm": False, "lfm2_vl": True,
              "lfm3_vl": True}


@pytest.mark.parametrize("family", VLM_SAMPLE)
def test_vision_language_models_upcycle_exactly_in_memory_and_streamed(family, tmp_path):
    from safetensors import safe_open

    dense = _dense(family, image_text=True)
    want = _logits(dense)
    dense.save_pretrained(tmp_path / "dense")
    with safe_open(tmp_path / "dense" / "model.safetensors", "pt") as f:
        assert (set(f.keys()) != set(dense.state_dict())) == VLM_SAMPLE[family]  # renamed as transformers loads
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", validate(MoESpec, SPEC))
    moe = upcycle(dense, validate(MoESpec, SPEC))
    assert {p for p, _ in moe_layers(moe)} == {p for p, _ in moe_layers(load(tmp_path / "moe"))}
    assert all(re.search(r"\.(language|text)_model\.", p) for p, _ in moe_layers(moe))  # the vision encoder's FFNs stay
    torch.testing.assert_close(_logits(moe), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(load(tmp_path / "moe")), want, rtol=1e-5, atol=1e-5)


def test_the_guides_family_table_is_this_tests_outcome():
    """docs/guides/upcycle.md's "Families" table names each family where this test puts it."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "guides" / "upcycle.md").read_text()
    text = text[text.index("## Families"):text.index("## Speech families")]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith(("upcycled", "refused", "not tested")):
            rows[cells[0]] = {n.strip() for n in re.sub(r"\([^)]*\)", "", cells[1]).split(",")}

    def row(start: str) -> set[str]:
        return next(v for k, v in rows.items() if k.startswith(start))

    assert row("upcycled exactly, in memory and streamed") == set(EXACT)
    assert row("upcycled exactly in memory") == set(STREAM_REFUSED)
    for start, words in [("refused: the FFN computes", NOT_FAITHFUL), ("refused: no FFN", NO_FFN)]:
        assert row(start) == {f for f, w in REFUSED.items() if w == words}
    assert row("not tested: the tiny-model harness") == set(HARNESS_CANNOT_BUILD)
    assert row("not tested: not built") == set(NOT_BUILT)


def test_a_refused_layer_can_be_left_out_and_the_others_upcycle_exactly():
    """Gemma 3n's MLPs with activation sparsity are refused; its layers without it upcycle exactly when the spec's
    `layers` leaves the others out (the harness's Gemma 3n: sparsity on layer 0, none on layer 1)."""
    dense = _dense("gemma3n_text")
    assert dense.config.activation_sparsity_pattern == [0.95, 0.0]
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp: .*layers or target can leave it out"):
        upcycle(dense, validate(MoESpec, SPEC))
    want = _logits(dense)
    moe = upcycle(dense, validate(MoESpec, {**SPEC, "layers": [1]}))
    assert [p for p, _ in moe_layers(moe)] == ["model.layers.1.mlp"]
    torch.testing.assert_close(_logits(moe), want, rtol=1e-5, atol=1e-5)
