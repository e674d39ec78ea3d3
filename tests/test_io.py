"""moekit checkpoint format (atomic save, aliases, bit-identical load), dense loading, metrics."""
from __future__ import annotations

from moekit.moe.state import spec_of
import functools
import json
import math

import pytest
import torch
from safetensors import safe_open

import moekit.checkpoint.format as mio
from moekit.checkpoint.dense import load_dense
from moekit.config import validate
from moekit.errors import CheckpointError, OutputExistsError, UnsafeOutputError
from moekit.eval.upcycling import kl_dense_moe
from moekit.routing.sites import param_counts
from moekit.moe import MoESpec, moe_layers
from moekit.testing import TINY_MODELS, logits, tiny_gpt2, tiny_inputs, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle


def _spec(**kw) -> MoESpec:
    return validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "noise", **kw})


def _disk_keys(folder) -> list[str]:
    keys = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            keys += list(st.keys())
    return keys


def _siblings(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_shared_router_and_tied_embeddings_roundtrip(tmp_path):
    model = upcycle(tiny_llama(tie_word_embeddings=True), _spec(router_sharing="all", shared_expert=True))
    routers = {id(m.router) for _, m in moe_layers(model)}
    assert len(routers) == 1
    inputs = tiny_inputs(model)
    before = logits(model, inputs)
    out = mio.save(model, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"

    keys = _disk_keys(out)
    assert sum("router.weight" in k for k in keys) == 1  # one tensor on disk
    assert ("lm_head.weight" in keys) + ("model.embed_tokens.weight" in keys) == 1
    meta = json.loads((out / "moekit.json").read_text())
    assert meta["format"] == "moekit/2" and meta["architecture"] == "LlamaForCausalLM"
    assert [e["router_of"] for e in meta["layers"]] == ["model.layers.0.mlp"] * 4
    assert len(meta["aliases"]) == 4  # three routers and the tied head

    loaded = mio.load(out)
    assert not loaded.training
    layers = moe_layers(loaded)
    assert len(layers) == 4 and len({id(m.router) for _, m in layers}) == 1
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded, inputs), before)
    assert spec_of(loaded) == spec_of(model)
    # the loaded shared router is still one parameter: gradients from every layer land in it
    assert sum(1 for n, _ in loaded.named_parameters() if "router" in n) == 1


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_roundtrip_every_family(family, tmp_path):
    model = upcycle(TINY_MODELS[family](), _spec(router_sharing="all", shared_expert=True, every=2))
    inputs = tiny_inputs(model)
    before = logits(model, inputs)
    loaded = mio.load(mio.save(model, tmp_path / family))
    assert type(loaded) is type(model)
    assert [p for p, _ in moe_layers(loaded)] == [p for p, _ in moe_layers(model)]
    assert torch.equal(logits(loaded, inputs), before)


def test_sharded_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setattr(mio, "save_weights", functools.partial(mio.save_weights, shard_bytes=40_000))
    model = upcycle(tiny_llama(), _spec())
    inputs = tiny_inputs(model)
    out = mio.save(model, tmp_path / "sharded")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == files
    assert not (out / "model.safetensors").exists()
    assert torch.equal(logits(mio.load(out), inputs), logits(model, inputs))


def test_bf16_roundtrip_from_load_dense(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "dense")
    model = load_dense(tmp_path / "dense", dtype=torch.bfloat16)
    model = upcycle(model, _spec())
    inputs = tiny_inputs(model)
    before = logits(model, inputs)
    assert before.dtype == torch.bfloat16
    loaded = mio.load(mio.save(model, tmp_path / "moe"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(logits(loaded, inputs), before)


def test_cast_model_loads_in_its_dtype(tmp_path):
    model = upcycle(tiny_llama().to(torch.bfloat16), _spec())
    loaded = mio.load(mio.save(model, tmp_path / "moe"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}  # not float32 with bf16 MoE layers
    assert logits(loaded, tiny_inputs(loaded)).dtype == torch.bfloat16


def test_non_empty_output_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    model = upcycle(tiny_llama(), _spec())
    with pytest.raises(OutputExistsError, match="overwrite"):
        mio.save(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert _siblings(out) == []  # no temp dir left behind
    # a file in the way is refused too; an empty directory is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError):
        mio.save(model, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    mio.save(model, tmp_path / "empty")
    assert (tmp_path / "empty" / "moekit.json").is_file()


def test_overwrite_replaces(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    model = upcycle(tiny_llama(), _spec())
    mio.save(model, out, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert "old.txt" not in names and {"config.json", "moekit.json", "model.safetensors"} <= set(names)
    assert _siblings(out) == []
    inputs = tiny_inputs(model)
    assert torch.equal(logits(mio.load(out), inputs), logits(model, inputs))
    # a file in the way is another kind of output: refused even with overwrite, and left as it was
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeOutputError, match="exists and is not a directory, and the output is a directory"):
        mio.save(model, tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").read_text() == "x" and _siblings(tmp_path / "file") == ["out"]


@pytest.mark.parametrize("existing", [False, True])
def test_failure_mid_save_leaves_nothing(tmp_path, monkeypatch, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("old")

    def boom(tensors, folder, *a, **kw):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(mio, "save_weights", boom)
    model = upcycle(tiny_llama(), _spec())
    with pytest.raises(RuntimeError, match="disk full"):
        mio.save(model, out, overwrite=existing)
    if existing:  # the previous checkpoint is untouched
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    else:
        assert not out.exists()
    assert _siblings(out) == []  # no temp dir


def test_save_needs_moe_layers(tmp_path):
    with pytest.raises(CheckpointError, match="no MoE layers"):
        mio.save(tiny_llama(), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_load_rejects_non_moekit_dirs(tmp_path):
    dense = tmp_path / "dense"
    tiny_llama().save_pretrained(dense)
    with pytest.raises(CheckpointError, match="moekit.json"):
        mio.load(dense)
    with pytest.raises(CheckpointError, match="moekit.json"):
        mio.load(tmp_path / "missing")
    out = mio.save(upcycle(tiny_llama(), _spec()), tmp_path / "moe")
    meta = json.loads((out / "moekit.json").read_text())
    (out / "moekit.json").write_text(json.dumps({**meta, "format": "moekit/999"}))
    with pytest.raises(CheckpointError, match="format"):
        mio.load(out)
    (out / "moekit.json").write_text(json.dumps({**meta, "architecture": "os"}))
    with pytest.raises(CheckpointError, match="not a transformers or moekit model class"):
        mio.load(out)


def test_load_dense_safetensors_only(tmp_path):
    dense = tiny_llama()
    folder = tmp_path / "pickle"
    folder.mkdir()
    dense.config.save_pretrained(folder)
    torch.save(dense.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pass allow_pickle=True") as info:
        load_dense(folder)
    assert "pytorch_model.bin" in str(info.value)
    with pytest.raises(CheckpointError, match="config.json"):
        load_dense(tmp_path)
    dense.save_pretrained(tmp_path / "st")
    again = load_dense(tmp_path / "st")
    inputs = tiny_inputs(dense)
    assert torch.equal(logits(again, inputs), logits(dense, inputs))


# ------------------------------------------------------------------ metrics


def test_param_counts_closed_form_llama():
    # tiny llama: H=32, I=64, 4 layers, 4 heads, 2 KV heads (head_dim 8), vocab 128, untied head
    H, I, V = 32, 64, 128
    per_layer = 2 * H * H + 2 * H * 16 + 3 * H * I + 2 * H
    dense_total = 2 * V * H + 4 * per_layer + H
    assert dense_total == 45344 and param_counts(tiny_llama()) == (45344, 45344)
    # E=4, k=2 on blocks 1 and 3, plus a shared expert (the size of the dense FFN it replaces)
    moe = upcycle(tiny_llama(), validate(MoESpec, {"num_experts": 4, "top_k": 2, "every": 2,
                                                   "shared_expert": True, "init": "naive"}))
    expert = 3 * H * I
    total = dense_total + 2 * (4 * expert + 4 * H)
    active = total - 2 * (4 - 2) * expert
    assert (total, active) == (94752, 70176)
    assert param_counts(moe) == (total, active)


def test_param_counts_closed_form_gpt2_shared_router_and_biases():
    H, I, E, k = 32, 128, 4, 1
    dense_total, _ = param_counts(tiny_gpt2())
    moe = upcycle(tiny_gpt2(), validate(MoESpec, {"num_experts": E, "top_k": k, "router_sharing": "all",
                                                  "init": "naive"}))
    expert = I * H + I + H * I + H  # fc1 (+bias), fc2 (+bias)
    total = dense_total + 4 * (E - 1) * expert + E * H  # one router for all four layers
    assert param_counts(moe) == (total, total - 4 * (E - k) * expert)
    assert param_counts(moe)[1] == dense_total + E * H  # k=1: active = dense + the router


def test_kl_zero_for_identical_logits():
    x = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    assert kl_dense_moe(x, x).item() == 0.0
    assert kl_dense_moe(x, x + 3.0).item() == pytest.approx(0.0, abs=1e-6)  # softmax is shift-invariant
    assert kl_dense_moe(x, torch.randn(2, 5, 11)).item() > 0


def test_kl_by_hand_and_ignores_masked_positions():
    ln3 = math.log(3.0)
    dense = torch.tensor([[[5.0, -5.0], [0.0, 0.0], [9.0, 0.0]]])  # (B=1, L=3, V=2)
    moe = torch.tensor([[[-5.0, 5.0], [ln3, 0.0], [0.0, 9.0]]])
    # position 1: p = [1/2, 1/2], q = [3/4, 1/4]: KL = ½ ln(2/3) + ½ ln 2 = ½ ln(4/3)
    expected_1 = 0.5 * math.log(4.0 / 3.0)
    # labels[1] = -100: position 0 (which predicts token 1) is not scored; position 2 has no next token
    labels = torch.tensor([[5, -100, 7]])
    assert kl_dense_moe(dense, moe, labels).item() == pytest.approx(expected_1, abs=1e-6)
    # without labels every position counts
    p = dense.log_softmax(-1)
    per_pos = (p.exp() * (p - moe.log_softmax(-1))).sum(-1)
    assert per_pos[0, 1].item() == pytest.approx(expected_1, abs=1e-6)
    assert kl_dense_moe(dense, moe).item() == pytest.approx(per_pos.mean().item(), abs=1e-6)
    # two sequences: the mean is over scored positions, not over sequences
    dense2, moe2 = torch.cat([dense, dense]), torch.cat([moe, moe])
    labels2 = torch.tensor([[5, -100, 7], [5, 6, -100]])  # scores (0,1) and (1,0)
    expected = (expected_1 + per_pos[0, 0].item()) / 2
    assert kl_dense_moe(dense2, moe2, labels2).item() == pytest.approx(expected, abs=1e-5)


def test_generation_config_survives_save_and_load(tmp_path):
    from moekit.testing import tiny_whisper

    from transformers import GenerationConfig

    model = tiny_whisper()
    model.generation_config = GenerationConfig(decoder_start_token_id=1, lang_to_id={"<|en|>": 5, "<|sw|>": 6},
                                               no_timestamps_token_id=7)  # as a real Whisper checkpoint has
    moe = upcycle(model, _spec(init="naive"))
    loaded = mio.load(mio.save(moe, tmp_path / "w"))
    assert loaded.generation_config.lang_to_id == {"<|en|>": 5, "<|sw|>": 6}
    assert loaded.generation_config.no_timestamps_token_id == 7
