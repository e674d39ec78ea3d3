"""Upcycling on every speech recognition family of the installed transformers (its CTC encoders, encoder-decoders and
speech-LLMs, discovered from transformers itself: moekit.testing.families.speech_model_types), in memory and streamed
from a checkpoint: UME's MoE must compute what the dense model computes on the family's own inputs (raw audio,
features, or a speech-LLM's text path), or the family is refused in one line. Each tiny model is perturbed away from
its init. The families the harness cannot build are listed with the reason (docs/guides/upcycle.md, "Speech
families"), so a family that a new transformers adds or fixes shows up as a failure to update this list."""
from __future__ import annotations

import re

import pytest
import torch

from moekit import upcycle, upcycle_checkpoint
from moekit.checkpoint.format import load
from moekit.config import validate
from moekit.moe import MoELayer, MoESpec, moe_layers
from moekit.surgery import find_slots
from moekit.testing.families import speech_model_types, tiny_speech_model

FAMILIES = sorted(speech_model_types())
SPEC = {"num_experts": 4, "top_k": 2, "init": "ume"}
# the shrunk default config does not build or run in transformers 5.23 (why)
HARNESS_CANNOT_BUILD = {
    "dia": "a text-to-speech model: its decoder takes audio codebooks, not text tokens",
    "speech-encoder-decoder": "it has no default encoder and decoder",
    "vibevoice": "a text-to-speech model whose config ties its diffusion head to the audio encoder's size",
}
# not built: too costly for the suite (what building them takes)
NOT_BUILT = {"vibevoice_asr": "its audio tokenizers are not shrunk by name: 686 M parameters, 17 s a build"}
BUILT = [f for f in FAMILIES if f not in HARNESS_CANNOT_BUILD and f not in NOT_BUILT]


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_every_discovered_family_is_built_or_listed():
    assert set(HARNESS_CANNOT_BUILD) | set(NOT_BUILT) <= set(FAMILIES)
    assert not set(HARNESS_CANNOT_BUILD) & set(NOT_BUILT)
    for family in HARNESS_CANNOT_BUILD:
        with pytest.raises(Exception):  # noqa: B017 - the day it builds, it must join the test below
            tiny_speech_model(family)


@pytest.mark.parametrize("family", BUILT)
def test_ume_equals_the_dense_speech_family_in_memory_and_streamed(family, tmp_path):
    dense, inputs = tiny_speech_model(family, perturb=0.05)
    want = _logits(dense, inputs)
    dense.save_pretrained(tmp_path / "dense")
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", validate(MoESpec, SPEC))
    streamed = load(tmp_path / "moe")
    moe = upcycle(dense, validate(MoESpec, SPEC))
    paths = [p for p, _ in moe_layers(moe)]
    assert paths and paths == [p for p, _ in moe_layers(streamed)]
    if any(n.endswith("language_model") for n, _ in moe.named_modules()):  # a speech-LLM: its LM's FFNs only
        assert all(".language_model." in p for p in paths)
    else:  # every FFN of an encoder (and decoder) is an MoE layer now, but an audio codec's (Kyutai's Mimi)
        assert all(s.path.startswith("codec_model.") for s in find_slots(moe))
        assert not any(p.startswith("codec_model.") for p in paths)
    torch.testing.assert_close(_logits(moe, inputs), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(streamed, inputs), want, rtol=1e-5, atol=1e-5)


def test_a_conformer_blocks_two_ffns_are_two_slots(tmp_path):
    """Parakeet's Conformer blocks hold two half-step FFNs (feed_forward1, feed_forward2): two slots per block, each
    selectable on its own, saved and loaded at its own place."""
    dense, inputs = tiny_speech_model("parakeet_ctc", perturb=0.05)
    want = _logits(dense, inputs)
    slots = [s.path for s in find_slots(dense)]
    assert slots == [f"encoder.layers.{i}.feed_forward{j}" for i in (0, 1) for j in (1, 2)]
    dense.save_pretrained(tmp_path / "dense")
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", validate(MoESpec, {**SPEC, "target": r"feed_forward2$"}))
    moe = load(tmp_path / "moe")
    assert [p for p, _ in moe_layers(moe)] == ["encoder.layers.0.feed_forward2", "encoder.layers.1.feed_forward2"]
    assert not any(isinstance(b.feed_forward1, MoELayer) for b in moe.encoder.layers)
    torch.testing.assert_close(_logits(moe, inputs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["wav2vec2", "parakeet_ctc"])
def test_an_upcycled_ctc_encoder_trains_with_moetrainer(family, tmp_path):
    """An upcycled transformers CTC encoder (raw audio in, wav2vec 2.0; log-mel features in, Parakeet) trains with
    MoETrainer: its CTC loss falls on a fixed batch and the router losses are logged. wav2vec 2.0 trains with LayerDrop
    (here 0.5): a skipped layer's routing is left out of the step's router losses (before, the routing of its last
    forward was added, and the backward failed on its freed graph)."""
    import transformers as tf

    import moekit

    dense, inputs = tiny_speech_model(family, perturb=0.05)
    model = upcycle(dense, validate(MoESpec, {**SPEC, "init": "drop"}))
    if family == "wav2vec2":
        model.config.layerdrop = 0.5
    x = inputs[model.main_input_name]
    labels = torch.randint(1, 20, (len(x), 3), generator=torch.Generator().manual_seed(0))
    mask = {"attention_mask": torch.ones(x.shape[1], dtype=torch.long)} if x.dim() == 3 else {}  # frames, Parakeet
    rows = [{model.main_input_name: x[i], "labels": labels[i], **mask} for i in range(len(x))] * 8
    args = tf.TrainingArguments(tmp_path, max_steps=8, per_device_train_batch_size=2, learning_rate=3e-3,
                                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True)
    trainer = moekit.MoETrainer(model=model, args=args, train_dataset=rows,
                                data_collator=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 8 and logs[-1]["loss"] < 0.9 * logs[0]["loss"]
    ran = [sum(f"moe/{p}/lb" in h for h in logs) for p, _ in moe_layers(model)]  # the steps each layer ran in
    assert ran == [8] * len(ran) if family == "parakeet_ctc" else 0 < sum(ran) and min(ran) < 8


@pytest.mark.parametrize("family", ["wav2vec2", "whisper", "kyutai_speech_to_text", "qwen3_asr"])
def test_simoe_takes_a_model_that_reads_token_ids_and_refuses_one_that_reads_audio(family):
    """SIMoE's instance router reads a prompt's final token embedding (§3.1.3): a CTC encoder or Whisper (audio in),
    or Kyutai's model (a text token and K audio codes per step), is refused in one line, its weights untouched; a
    speech-LLM reads token ids: SIMoE wraps its layers and computes what it computed (δ = 0 at init)."""
    from moekit.errors import ConfigError
    from moekit.simoe.model import SIMoEConfig, si_modules, simoe_upcycle

    model, inputs = tiny_speech_model(family)
    before, want = {k: v.clone() for k, v in model.state_dict().items()}, _logits(model, inputs)
    if family == "qwen3_asr":  # its language model's linear layers and norms only (§4: "in the pre-trained LLM")
        simoe_upcycle(model, SIMoEConfig())
        wrapped = [p for p, _ in si_modules(model)]
        assert wrapped and all(".language_model." in p for p in wrapped)
        assert any(".audio_tower." in p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        torch.testing.assert_close(_logits(model, inputs), want, rtol=1e-5, atol=1e-5)
        return
    with pytest.raises(ConfigError, match="needs a model that reads token ids") as e:
        simoe_upcycle(model, SIMoEConfig())
    assert "\n" not in str(e.value)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_the_guides_speech_table_is_this_tests_outcome():
    """docs/guides/upcycle.md's "Speech families" table names each family where this test puts it."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "guides" / "upcycle.md").read_text()
    section = text[text.index("## Speech families"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith(("upcycled", "not tested")):
            rows[cells[0]] = {n.strip() for n in re.sub(r"\([^)]*\)", "", cells[1]).split(",")}
    assert rows == {next(k for k in rows if k.startswith("upcycled")): set(BUILT),
                    next(k for k in rows if k.startswith("not tested: the tiny")): set(HARNESS_CANNOT_BUILD),
                    next(k for k in rows if k.startswith("not tested: not built")): set(NOT_BUILT)}


def test_kyutais_audio_codec_is_left_out_unless_the_target_names_it():
    """Kyutai's speech-to-text model: its decoder's FFNs are upcycled, not those of the Mimi codec that makes its
    audio tokens (`codec_model`), unless spec.target names them; either way the MoE equals the dense model."""
    dense, inputs = tiny_speech_model("kyutai_speech_to_text", perturb=0.05)
    want = _logits(dense, inputs)
    codec = [s.path for s in find_slots(dense) if s.path.startswith("codec_model.")]
    assert codec
    for target, expect in [(None, lambda p: p.startswith("model.layers.")), (r"^codec_model\.", lambda p: p in codec)]:
        moe = upcycle(tiny_speech_model("kyutai_speech_to_text", perturb=0.05)[0],
                      validate(MoESpec, {**SPEC, "target": target}))
        paths = [p for p, _ in moe_layers(moe)]
        assert paths and all(expect(p) for p in paths)
        torch.testing.assert_close(_logits(moe, inputs), want, rtol=1e-5, atol=1e-5)
