"""Quantized checkpoints (DeepSeek-V3's and Qwen3-FP8's block FP8, compressed-tensors' 8-bit formats, GPT-OSS's MXFP4
experts) are read as the float model they encode, everywhere moekit reads a checkpoint; experts removed from one stay
quantized; any other quantization is refused.

The oracle is the float checkpoint of the values a quantized one encodes, written beside it by
moekit.testing.quantized (whose dequantization is index arithmetic written apart from moekit's); where transformers
or compressed-tensors can read the same checkpoint, they are checked too."""
import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

import moekit
from moekit.checkpoint.dense import load_dense
from moekit.checkpoint.files import ShardReader
from moekit.checkpoint.format import load_model
from moekit.checkpoint.quantized import dequantize, unpack_ints, unpack_mxfp4
from moekit.checkpoint.remove import remove_experts
from moekit.errors import CheckpointError, ConfigError
from moekit.moe import MoESpec
from moekit.routing.sites import find_sites
from moekit.routing.streamed import Batch, collect_streamed
from moekit.testing import tiny_deepseek_v3, tiny_llama, tiny_qwen3, tiny_qwen3_moe, tiny_tokenizer
from moekit.testing.families import tiny_family_model
from moekit.testing.quantized import (block_scales, mxfp4_pack, mxfp4_values, reference_values, save_compressed,
                                      save_fp8, save_mxfp4)

# DeepSeek-V3's sizes at 1/8: blocks of 16 that its 24-wide experts and 20-row kv_a_proj_with_mqa fill partly
DEEPSEEK = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, kv_lora_rank=16, q_lora_rank=16,
                qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_attention_heads=4, num_key_value_heads=4,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                num_hidden_layers=3)
MOE = {"deepseek_v3": lambda: tiny_deepseek_v3(**DEEPSEEK), "qwen3_moe": tiny_qwen3_moe}
IDS = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))


def _pair(tmp_path, model, save=save_fp8, name: str = "fp8", **kw) -> tuple[Path, Path]:
    """(the quantized checkpoint `save` writes of `model`, its float checkpoint), both with the tiny tokenizer."""
    quantized, ref = tmp_path / name, tmp_path / "float"
    save(model, quantized, ref, **kw)
    for d in (quantized, ref):
        tiny_tokenizer().save_pretrained(d)
    return quantized, ref


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e8m0fnu])
@pytest.mark.parametrize("shape,block", [((37, 50), (16, 16)), ((3, 20, 33), (8, 16)), ((5, 7), (128, 128)),
                                         ((6, 9), None)])
def test_dequantize_is_the_closed_form(shape, block, scale_dtype):
    """W[..., o, i] = q[..., o, i] · s[..., o // bo, i // bi], partial last blocks included; UE8M0 scales (bytes or
    float8_e8m0fnu) are 2^(b - 127)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    s = block_scales(w, block, scale_dtype)
    q = (w / reference_values(torch.ones_like(w, dtype=torch.float8_e4m3fn), s, block)).to(torch.float8_e4m3fn)
    got = dequantize(q, s, block)
    assert got.dtype == torch.float32 and torch.equal(got, reference_values(q, s, block))
    assert (got - w).abs().max() <= 0.07 * w.abs().max()  # it is w, to FP8's precision


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_reads_as_its_float_model(tmp_path, family):
    """Every tensor the reader serves equals the float checkpoint's, and the model moekit loads computes what
    transformers computes from the float checkpoint, bit for bit."""
    model = {"qwen3": tiny_qwen3, **MOE}[family]()
    fp8, ref = _pair(tmp_path, model)
    _reads_as(fp8, ref)
    with ShardReader(fp8, dequantize=False) as raw:
        assert any(k.endswith("_scale_inv") for k in raw.keys())
    loaded = load_dense(fp8)
    assert getattr(loaded.config, "quantization_config", None) is None
    expected = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, expected(IDS).logits)


def test_transformers_dequantizes_partial_blocks_with_the_wrong_blocks(tmp_path):
    """Why moekit dequantizes itself (moekit.checkpoint.quantized): transformers 5.23, without a GPU, derives the
    block from the scale grid, so DeepSeek-V3's 20-row kv_a_proj_with_mqa (2 blocks of 16) gets blocks of 10. The day
    this fails, transformers reads partial blocks right and the module docstring must say so."""
    fp8, ref = _pair(tmp_path, MOE["deepseek_v3"]())
    theirs = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    with safe_open(ref / "model.safetensors", "pt") as want:
        assert not torch.equal(theirs.get_parameter(name).data, want.get_tensor(name))
    assert torch.equal(load_dense(fp8).get_parameter(name).data, ShardReader(ref).get(name))


def test_transformers_cannot_dequantize_deepseek_v3s_kv_a_proj_moekit_can():
    """At DeepSeek-V3's real shape: kv_a_proj_with_mqa is (576, 7168) in blocks of 128, so 5 × 56 scales; transformers'
    dequantization (the op it runs on a machine without a GPU) refuses 576 rows for 5 scale rows; moekit reads it, the
    last 64 rows with the fifth scale row."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q = torch.ones(576, 7168, dtype=torch.float8_e4m3fn)
    s = torch.arange(1, 6, dtype=torch.float32)[:, None].expand(5, 56).contiguous()
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        Fp8Dequantize(None)._dequantize_one(q, s, torch.bfloat16)
    w = dequantize(q, s, (128, 128))
    assert torch.equal(w[:, 0], torch.arange(576) // 128 + 1.0)


@pytest.mark.parametrize("family", sorted(MOE))
def test_routes_and_pruning_of_fp8_equal_the_float_model(tmp_path, family):
    """The routing trace of an FP8 checkpoint, streamed or loaded, is the float checkpoint's: the same experts,
    weights and config digest (a selection made on either applies to both); its REAP selection disabled or removed
    computes what the same on the float checkpoint computes."""
    fp8, ref = _pair(tmp_path, MOE[family]())
    assert moekit.inspect(fp8).description.endswith("native transformers MoE, FP8 weights (blocks of 16×16), read "
                                                    "dequantized")
    _routes_and_pruning_equal(tmp_path, fp8, ref)


def _routes_and_pruning_equal(tmp_path: Path, quantized: Path, ref: Path) -> None:
    texts = tmp_path / "en.txt"
    texts.write_text("hello world\nthe cat sat on the mat\n")
    traces = {}
    for src in (quantized, ref):
        for stream in ("off", "on"):
            out = tmp_path / f"{src.name}_{stream}.npz"
            moekit.routes.collect(src, {"en": texts}, out, stream=stream)
            traces[src.name, stream] = np.load(out)
    want = traces[ref.name, "off"]
    for key, got in traces.items():
        for array in ("ids", "weights", "token"):
            assert np.array_equal(got[array], want[array]), (key, array)
        assert json.loads(str(got["meta"]))["config_sha256"] == json.loads(str(want["meta"]))["config_sha256"]
    # the REAP workflow on the quantized checkpoint: its selection, disabled or removed, computes as on the float one
    moekit.select(tmp_path / f"{quantized.name}_on.npz", "reap", top=2, out=tmp_path / "keep.json")
    for mode in ("disable", "keep"):
        for src in (quantized, ref):
            moekit.prune(src, tmp_path / "keep.json", tmp_path / f"{src.name}_{mode}", mode=mode)
        with torch.no_grad():
            assert torch.equal(load_model(tmp_path / f"{quantized.name}_{mode}")(IDS).logits,
                               load_model(tmp_path / f"{ref.name}_{mode}")(IDS).logits), mode


@pytest.mark.parametrize("family,fused", [("deepseek_v3", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_removing_experts_keeps_fp8(tmp_path, family, fused):
    """Experts removed from an FP8 checkpoint leave an FP8 checkpoint (each kept expert's values and scales as they
    were; fused experts' scales cut with them) that computes what removing them from the float checkpoint gives."""
    fp8, ref = _pair(tmp_path, MOE[family](), fused=fused)
    keep = {s.name: [0, 2] for s in find_sites(load_dense(ref))}
    remove_experts(fp8, tmp_path / "fp8_cut", keep)
    remove_experts(ref, tmp_path / "float_cut", keep)
    config = json.loads((tmp_path / "fp8_cut" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    with safe_open(tmp_path / "fp8_cut" / "model.safetensors", "pt") as cut, \
            safe_open(fp8 / "model.safetensors", "pt") as src:
        scales = [k for k in cut.keys() if k.endswith("_scale_inv")]
        assert scales and all(cut.get_tensor(k[:-len("_scale_inv")]).dtype == torch.float8_e4m3fn for k in scales)
        if not fused:  # the second kept expert is the source's expert 2, bytes and scales alike
            kept = [k for k in cut.keys() if ".experts.1." in k]
            assert kept and all(torch.equal(cut.get_tensor(k).view(torch.uint8),
                                            src.get_tensor(k.replace(".experts.1.", ".experts.2.")).view(torch.uint8))
                                for k in kept)
    with torch.no_grad():
        assert torch.equal(load_dense(tmp_path / "fp8_cut")(IDS).logits,
                           load_dense(tmp_path / "float_cut")(IDS).logits)


def test_fp8_expert_removal_refuses_to_split_blocks(tmp_path):
    """A weight cut along a dimension stored in blocks (here every tensor in blocks of 3 rows, so a fused expert
    tensor's scales cannot follow a cut of a router's rows) is refused before anything is written."""
    fp8, _ = _pair(tmp_path, tiny_qwen3_moe(), fused=True, block=(3, 16))
    headers = {}
    with safe_open(fp8 / "model.safetensors", "pt") as f:
        for k in f.keys():
            headers[k] = f.get_tensor(k)
    router = next(k for k in headers if k.endswith("mlp.gate.weight"))
    s = block_scales(headers[router].float(), (3, 16), torch.float32)
    q = (headers[router].float() / reference_values(torch.ones_like(headers[router], dtype=torch.float8_e4m3fn),
                                                    s, (3, 16))).to(torch.float8_e4m3fn)
    headers[router], headers[router + "_scale_inv"] = q, s
    from safetensors.torch import save_file

    save_file(headers, fp8 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    keep = {f"model.layers.{i}.mlp": [0, 2] for i in range(config["num_hidden_layers"])}
    with pytest.raises(ConfigError, match="FP8 weights in blocks of 3 along the axis of its experts") as e:
        remove_experts(fp8, tmp_path / "cut", keep)
    assert "\n" not in str(e.value) and not (tmp_path / "cut").exists()


def test_expert_removal_checks_the_scales_first(tmp_path):
    """Removal copies quantized bytes as they are, but checks the checkpoint as the model reads it first: scales in
    16×16 blocks under a config that declares 3×16 are refused, naming the tensor, before anything is written."""
    fp8, _ = _pair(tmp_path, tiny_qwen3_moe(), fused=True)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [3, 16]
    (fp8 / "config.json").write_text(json.dumps(config))
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"_scale_inv is F32 \[8, 2, 2\] beside .* shaped \[8, 11, 2\]") as e:
        remove_experts(fp8, tmp_path / "cut", {f"model.layers.{i}.mlp": [0, 2] for i in range(3)})
    assert "\n" not in str(e.value) and _tree(tmp_path) == before


@pytest.mark.parametrize("family,fmt", [("qwen3", "fp8"), ("llama", "fp8"), ("qwen3", "packed")])
def test_upcycling_fp8_equals_upcycling_its_float_model(tmp_path, family, fmt):
    """A dense FP8 (or W4A16 pack-quantized) checkpoint upcycles (streamed and in memory) to exactly what its float
    checkpoint upcycles to; the output is a float checkpoint (no quantization_config), by default in the dtype of the
    quantized checkpoint's unquantized tensors (bf16 here)."""
    model = {"qwen3": tiny_qwen3, "llama": tiny_llama}[family]().to(torch.bfloat16)
    fp8, ref = _pair(tmp_path, model, **({"save": W4A16} if fmt == "packed" else {}))
    spec = MoESpec(num_experts=4, top_k=2, init={"method": "drop", "ratio": 0.5})
    written = {d.name: moekit.upcycle_checkpoint(d, tmp_path / f"{d.name}_moe", spec, dtype="bfloat16")
               for d in (fp8, ref)}
    assert moekit.upcycle_checkpoint(fp8, tmp_path / "auto", spec).dtype == "bfloat16"
    assert "quantization_config" not in json.loads((tmp_path / "fp8_moe" / "config.json").read_text())
    assert _tree(tmp_path / "fp8_moe").keys() == _tree(tmp_path / "float_moe").keys()
    with safe_open(tmp_path / "fp8_moe" / "model.safetensors", "pt") as a, \
            safe_open(tmp_path / "float_moe" / "model.safetensors", "pt") as b:
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in b.keys())
    in_memory = moekit.upcycle(load_dense(fp8), spec)
    with torch.no_grad():
        assert torch.equal(in_memory(IDS).logits, moekit.upcycle(load_dense(ref), spec)(IDS).logits)


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "hqq", "fbgemm_fp8"])
def test_other_quantizations_are_refused_and_nothing_is_written(tmp_path, method):
    src = tmp_path / "model"
    tiny_qwen3_moe().save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    (tmp_path / "en.txt").write_text("hello\n")
    before = _tree(tmp_path)
    calls = [lambda: load_dense(src),
             lambda: moekit.routes.collect(src, {"en": tmp_path / "en.txt"}, tmp_path / "t.npz", stream="on"),
             lambda: moekit.routes.collect(src, {"en": tmp_path / "en.txt"}, tmp_path / "t.npz", stream="off"),
             lambda: remove_experts(src, tmp_path / "cut", {"model.layers.0.mlp": [0, 1]}),
             lambda: moekit.upcycle_checkpoint(src, tmp_path / "up", MoESpec(num_experts=2, top_k=1))]
    for call in calls:
        with pytest.raises(CheckpointError, match=f"quantized with '{method}'") as e:
            call()
        assert "\n" not in str(e.value)
    assert _tree(tmp_path) == before


def _edit_tensors(folder: Path, edit) -> None:
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    from safetensors.torch import save_file

    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"


DOWN = "model.layers.0.mlp.experts.down_proj"  # GPT-OSS's MXFP4 down projection: DOWN_blocks, DOWN_scales
WORDS = "model.layers.0.mlp.down_proj.weight"  # a W4A16 weight: WORDS_packed, WORDS_shape, WORDS_scale


@pytest.mark.parametrize("kind,edit,words", [
    ("fp8", lambda t: t.update({SCALE: t[SCALE][:1]}), r"F32 \[1, 2\] beside .* shaped \[2, 2\]"),
    ("fp8", lambda t: t.update({SCALE[:-len("_scale_inv")]: t[SCALE[:-len("_scale_inv")]].float()}),
     "beside the F32"),
    ("fp8", lambda t: t.update({"model.layers.0.self_attn.nothing.weight_scale_inv": t[SCALE].clone()}),
     "scales no tensor"),
    ("fp8", lambda t: t.update({SCALE: t[SCALE].to(torch.int32)}), "I32"),
    ("mxfp4", lambda t: t.pop(DOWN + "_scales"), f"beside no {DOWN}_scales"),
    ("mxfp4", lambda t: t.update({DOWN + "_scales": t[DOWN + "_scales"][:, :1].clone()}), "MXFP4 needs U8 blocks"),
    ("mxfp4", lambda t: t.update({DOWN + "_blocks": t[DOWN + "_blocks"].to(torch.int16)}), "_blocks is I16"),
    ("packed", lambda t: t.pop(WORDS + "_shape"), f"beside no {WORDS}_shape"),
    ("packed", lambda t: t.update({WORDS + "_shape": torch.tensor([64, 48])}), r"_shape = \[64, 48\]"),
    ("packed", lambda t: t.update({WORDS + "_shape": torch.zeros(10**6, dtype=torch.int64)}), r"_shape I64 \[1000000\]"),
    ("packed", lambda t: t.update({WORDS + "_packed": t[WORDS + "_packed"][:, :1].clone()}), "need I32 words"),
    ("packed", lambda t: t.update({WORDS + "_packed": t[WORDS + "_packed"].to(torch.int64)}), "_packed is I64"),
    ("packed", lambda t: t.pop(WORDS + "_scale"), f"{WORDS}_packed has no {WORDS}_scale"),
])
def test_malformed_quantized_tensors_are_refused_in_one_line(tmp_path, kind, edit, words):
    folder, _ = {"fp8": lambda: _pair(tmp_path, tiny_qwen3()), "packed": lambda: _pair(tmp_path, tiny_qwen3(), W4A16),
                 "mxfp4": lambda: _pair(tmp_path, _gpt_oss(), save_mxfp4, "mxfp4")}[kind]()
    _edit_tensors(folder, edit)
    before = _tree(tmp_path)
    for call in (lambda: ShardReader(folder), lambda: load_dense(folder)):
        with pytest.raises(CheckpointError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("block", [[0, 16], [16], "16x16", [16.0, 16]])
def test_bad_block_size_is_refused(tmp_path, block):
    fp8, _ = _pair(tmp_path, tiny_qwen3())
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_block_size must be two positive integers"):
        ShardReader(fp8)
    shutil.rmtree(fp8)


def _gpt_oss():
    return tiny_family_model("gpt_oss", edit=lambda c: setattr(c, "intermediate_size", 64))  # I a multiple of 32


def test_unpack_mxfp4_is_the_closed_form():
    """Value j of a row: the FP4 value of nibble j of its block (low nibble first) times 2^(scale - 127), transposed
    to the model's (..., I, O); packing then unpacking gives w to FP4's precision."""
    w = torch.randn(3, 64, 40, generator=torch.Generator().manual_seed(2))
    blocks, scales = mxfp4_pack(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    got = unpack_mxfp4(blocks, scales)
    assert got.is_contiguous() and torch.equal(got, mxfp4_values(blocks, scales))
    assert ((got - w).abs() <= 0.25 * w.abs().amax(dim=-2, keepdim=True)).all()


def test_mxfp4_gpt_oss_reads_as_its_float_model(tmp_path):
    """GPT-OSS with MXFP4 experts: the reader serves the float checkpoint's tensors, and moekit's model computes
    what transformers computes from the float checkpoint, and from the MXFP4 one (its own dequantization agrees
    here: a second, independent check of the oracle)."""
    mx, ref = _pair(tmp_path, _gpt_oss(), save_mxfp4, "mxfp4")
    _reads_as(mx, ref)
    assert moekit.inspect(mx).description.endswith("MXFP4 experts (32 FP4 values per power-of-two scale), read "
                                                   "dequantized")
    # `routes collect --stream auto` predicts the loaded model's size from the weights as the model holds them
    assert moekit.routes.in_memory_peak(mx, torch.float32) == moekit.routes.in_memory_peak(ref, torch.float32)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)(IDS).logits
        assert torch.equal(load_dense(mx)(IDS).logits, expected)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(mx, dtype=torch.float32)(IDS).logits, expected)


def test_routes_and_pruning_of_mxfp4_equal_the_float_model(tmp_path):
    """As for FP8: traces, REAP selections disabled or removed; removal keeps the kept experts' blocks and scales."""
    mx, ref = _pair(tmp_path, _gpt_oss(), save_mxfp4, "mxfp4")
    _routes_and_pruning_equal(tmp_path, mx, ref)
    config = json.loads((tmp_path / "mxfp4_keep" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    keep = json.loads((tmp_path / "keep.json").read_text())
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    ids = next(v for k, v in keep["experts"].items() if k.startswith("model.layers.0."))
    with safe_open(tmp_path / "mxfp4_keep" / "model.safetensors", "pt") as cut, \
            safe_open(mx / "model.safetensors", "pt") as src:
        assert torch.equal(cut.get_tensor(name), src.get_tensor(name)[sorted(ids)])


CT_SCHEMES = [("channel", "float", True), ("tensor", "float", True), ("block", "float", True),
              ("channel", "int", True), ("group", "int", True), ("channel", "int", False), ("block", "int", False)]


@pytest.mark.parametrize("strategy,kind,symmetric", CT_SCHEMES)
def test_compressed_tensors_read_as_their_float_model(tmp_path, strategy, kind, symmetric):
    """llm-compressor's FP8-dynamic and W8A8 checkpoints (compressed-tensors float- and naive-quantized, scales per
    tensor, row, group of columns or block; int8 with zero points too): every tensor read and the loaded model's
    logits equal the float checkpoint's."""
    ct, ref = _pair(tmp_path, tiny_qwen3(), save_compressed, "compressed", strategy=strategy, kind=kind,
                    symmetric=symmetric)
    _reads_as(ct, ref)
    with torch.no_grad():
        assert torch.equal(load_dense(ct)(IDS).logits,
                           AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)(IDS).logits)


def _reads_as(quantized: Path, ref: Path) -> None:
    """Every tensor of `quantized` reads as the float checkpoint `ref` holds it."""
    with ShardReader(quantized) as reader, safe_open(ref / "model.safetensors", "pt") as want:
        assert sorted(reader.keys()) == sorted(want.keys())
        assert all(torch.equal(reader.get(k).to(want.get_tensor(k).dtype), want.get_tensor(k)) for k in want.keys())


def _decompressed_as_compressed_tensors_does(ct: Path) -> nn.Module:
    """moekit's bf16 model of `ct`, checked against the real program: transformers with compressed-tensors' own
    decompression (run_compressed=False) loads the same weights and computes the same logits, bit for bit."""
    from transformers import CompressedTensorsConfig

    theirs = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.bfloat16,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
    ours = load_dense(ct, dtype=torch.bfloat16)
    assert all(torch.equal(p.data, ours.get_parameter(n).data) for n, p in theirs.named_parameters())
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, theirs(IDS).logits)
    return ours


@pytest.mark.parametrize("strategy,kind,symmetric,family", [(*scheme, "qwen3") for scheme in CT_SCHEMES] + [
    ("channel", "float", True, "qwen3_moe"), ("tensor", "float", True, "qwen3_moe")])
def test_compressed_tensors_equal_their_own_decompression(tmp_path, strategy, kind, symmetric, family):
    """The real program: transformers with compressed-tensors' own decompression (run_compressed=False) loads the
    same bf16 weights and computes the same logits as moekit, bit for bit (compressed-tensors multiplies in the
    scales' bf16; moekit in float32, then casts: one rounding of the same product either way)."""
    model = {"qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe}[family]().to(torch.bfloat16)
    ct, _ = _pair(tmp_path, model, save_compressed, "compressed", strategy=strategy, kind=kind, symmetric=symmetric)
    _decompressed_as_compressed_tensors_does(ct)


@pytest.mark.parametrize("strategy,kind,packed", [("block", "float", None), ("channel", "int", None),
                                                 ("group", "int", 4)])
def test_transformers_cannot_load_these_compressed_moe_checkpoints_moekit_reads(tmp_path, strategy, kind, packed):
    """What docs/guides/bigger-than-memory.md says: transformers 5.23 with compressed-tensors 0.20.1 fails on a
    block-FP8, int8 or W4A16 Qwen3-MoE (its per-expert concatenation receives no tensors); moekit reads it as its
    float checkpoint. The day transformers loads it, this fails and the guide must change."""
    from transformers import CompressedTensorsConfig

    ct, ref = _pair(tmp_path, tiny_qwen3_moe(), save_compressed, "compressed", strategy=strategy, kind=kind,
                    packed=packed)
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        AutoModelForCausalLM.from_pretrained(ct, quantization_config=CompressedTensorsConfig(run_compressed=False))
    with torch.no_grad():
        assert torch.equal(load_dense(ct)(IDS).logits, load_dense(ref)(IDS).logits)


def test_routes_and_pruning_of_compressed_tensors_equal_the_float_model(tmp_path):
    """An FP8-dynamic Qwen3-MoE (per-row scales on every expert): traces, REAP disabled and removed as on the float
    checkpoint; the removal keeps compressed-tensors FP8."""
    ct, ref = _pair(tmp_path, tiny_qwen3_moe(), save_compressed, "compressed")
    assert moekit.inspect(ct).description.endswith("compressed-tensors FP8 weights (one scale per row), read "
                                                   "dequantized")
    _routes_and_pruning_equal(tmp_path, ct, ref)
    with safe_open(tmp_path / "compressed_keep" / "model.safetensors", "pt") as cut:
        assert cut.get_tensor("model.layers.0.mlp.experts.1.down_proj.weight").dtype == torch.float8_e4m3fn
        assert "model.layers.0.mlp.experts.1.down_proj.weight_scale" in cut.keys()


@pytest.mark.parametrize("kind", ["fp8 deepseek_v3", "fp8-fused qwen3_moe", "mxfp4 gpt_oss", "compressed qwen3_moe",
                                  "packed deepseek_v3"])
def test_quantized_experts_load_in_parts(tmp_path, kind):
    """A streamed capture that reads a layer's experts 3 at a time (a layer bigger than memory: DeepSeek-V3's is
    22.5 GB in bf16) from DeepSeek-V3's layout (per-expert FP8 with block scales), fused FP8 experts, GPT-OSS's
    MXFP4 blocks, an FP8-dynamic Qwen3-MoE and a W4A16 DeepSeek-V3 (Kimi-K2-Thinking's layout): the decisions of the
    float checkpoint read whole, and its weights up to the order of a token's sum over its experts."""
    fmt, family = kind.split()
    save, model = {"mxfp4": save_mxfp4, "compressed": save_compressed, "packed": W4A16}.get(fmt, save_fp8), \
        {"gpt_oss": _gpt_oss, **MOE}[family]()
    quantized, ref = _pair(tmp_path, model, save, fmt, **({"fused": True} if fmt == "fp8-fused" else {}))
    data = [Batch("en", IDS, torch.ones_like(IDS))]
    want = collect_streamed(ref, data, dtype=torch.float32)
    got = collect_streamed(quantized, data, dtype=torch.float32, experts_per_load=3)
    assert np.array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("edit,words", [
    (lambda q: q.update(format="marlin-24"), "its format is 'marlin-24'"),
    (lambda q: q.update(format="nvfp4-pack-quantized"), "its format is 'nvfp4-pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "FP8 weights have zero points"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "4-bit float"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "reordered"),
    (lambda q: q["config_groups"].update(group_1={"targets": ["re:.*down_proj"], "weights": {"num_bits": 8}}),
     "different ways"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
])
def test_other_compressed_tensors_formats_are_refused(tmp_path, edit, words):
    ct, _ = _pair(tmp_path, tiny_qwen3(), save_compressed, "compressed")
    config = json.loads((ct / "config.json").read_text())
    edit(config["quantization_config"])
    (ct / "config.json").write_text(json.dumps(config))
    for call in (lambda: ShardReader(ct), lambda: load_dense(ct)):
        with pytest.raises(CheckpointError, match=words) as e:
            call()
        assert "\n" not in str(e.value) and "compressed-tensors checkpoint moekit cannot read" in str(e.value)


W4A16 = functools.partial(save_compressed, strategy="group", kind="int", symmetric=True, packed=4)
# (bits, strategy, symmetric, model): compressed-tensors' pack-quantized checkpoints, as llm-compressor's W4A16 (GPTQ or
# RTN; Kimi-K2-Thinking's experts: 4-bit, groups, symmetric) and W8A16 save them; "odd": I = 36, a partial last word
PACKED_SCHEMES = [(4, "group", True, "qwen3"), (4, "channel", False, "odd"), (2, "channel", False, "qwen3"),
                  (8, "group", True, "qwen3"), (4, "tensor", True, "qwen3"), (4, "group", False, "qwen3")]
PACKED_MODELS = {"qwen3": tiny_qwen3, "odd": lambda: tiny_qwen3(intermediate_size=36)}


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_ints_undoes_compressed_tensors_packing(bits):
    """Value j of a row sits in word j // (32/bits) at bit (j mod 32/bits)·bits, stored plus 2^(bits-1): one word
    packed by hand, and compressed-tensors' own pack_to_int32 undone (a partial last word, 3-D tensors)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, offset = 32 // bits, 1 << (bits - 1)
    values = torch.arange(n) % (1 << bits) - offset  # one word's values
    word = sum(int(v + offset) << (bits * j) for j, v in enumerate(values))
    word = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert torch.equal(unpack_ints(word, bits, n), values.to(torch.int8)[None])
    g = torch.Generator().manual_seed(bits)
    for shape in [(5, 37), (3, 4, 9), (1, 1)]:
        q = torch.randint(-offset, offset, shape, generator=g).to(torch.int8)
        assert torch.equal(unpack_ints(pack_to_int32(q, bits), bits, shape[-1]), q)


@pytest.mark.parametrize("bits,strategy,symmetric,model", PACKED_SCHEMES)
def test_pack_quantized_reads_as_its_float_model_and_as_compressed_tensors_decompresses_it(tmp_path, bits, strategy,
                                                                                          symmetric, model):
    """compressed-tensors' pack-quantized checkpoints (packed by its own pack_to_int32): every tensor reads as the
    float checkpoint's; the real program, transformers with compressed-tensors' own decompression
    (run_compressed=False), loads the same bf16 weights and computes the same logits as moekit, bit for bit."""
    ct, ref = _pair(tmp_path, PACKED_MODELS[model]().to(torch.bfloat16), save_compressed, "packed", strategy=strategy,
                    kind="int", symmetric=symmetric, packed=bits)
    _reads_as(ct, ref)
    with torch.no_grad():
        assert torch.equal(_decompressed_as_compressed_tensors_does(ct)(IDS).logits,
                           load_dense(ref, dtype=torch.bfloat16)(IDS).logits)


def test_pack_quantized_experts_read_as_compressed_tensors_decompresses_them(tmp_path):
    """A W4A16 Qwen3-MoE with zero points (which transformers 5.23 cannot load: its per-expert concatenation receives
    no tensors, test below): each expert's weight equals compressed-tensors' own PackedQuantizationCompressor
    decompression of its stored tensors, bit for bit."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    model = tiny_qwen3_moe(moe_intermediate_size=32).to(torch.bfloat16)  # compressed-tensors needs whole groups
    ct, _ = _pair(tmp_path, model, save_compressed, "packed", strategy="group", kind="int", symmetric=False, packed=4)
    config = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=config["weights"])
    with ShardReader(ct) as reader, safe_open(ct / "model.safetensors", "pt") as f:
        experts = [k.removesuffix("_packed") for k in f.keys() if ".experts." in k and k.endswith("_packed")]
        assert len(experts) == 3 * 8 * 3  # layers × experts × projections
        for weight in experts:
            stored = {k.removeprefix(weight.removesuffix("weight")): f.get_tensor(k) for k in f.keys()
                      if k.startswith(weight + "_")}
            want = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
            assert torch.equal(reader.get(weight).to(want.dtype), want), weight


def test_routes_and_pruning_of_pack_quantized_equal_the_float_model(tmp_path):
    """A W4A16 Qwen3-MoE: traces, REAP disabled and removed as on the float checkpoint; the removal keeps each kept
    expert's packed words, shape, scales and zero points as they were, renumbered."""
    ct, ref = _pair(tmp_path, tiny_qwen3_moe(), save_compressed, "packed", strategy="group", kind="int",
                    symmetric=False, packed=4)
    assert moekit.inspect(ct).description.endswith("compressed-tensors packed int4 weights (one scale per 16 columns "
                                                   "of a row), read dequantized")
    _routes_and_pruning_equal(tmp_path, ct, ref)
    keep = json.loads((tmp_path / "keep.json").read_text())["experts"]["model.layers.0.mlp"]
    with safe_open(tmp_path / "packed_keep" / "model.safetensors", "pt") as cut, \
            safe_open(ct / "model.safetensors", "pt") as src:
        prefix = "model.layers.0.mlp.experts.{}.down_proj.weight_"
        for suffix in ("packed", "shape", "scale", "zero_point"):
            want = src.get_tensor(prefix.format(keep[1]) + suffix)
            assert torch.equal(cut.get_tensor(prefix.format(1) + suffix), want)


def test_packed_values_count_as_the_model_holds_them(tmp_path):
    """The check that a config belongs to its weights (no model far larger than the values its files hold) counts a
    packed weight's values, not its int32 words: a W4A16 Qwen3-MoE whose experts hold most of its values streams as
    its float checkpoint (before: "the config does not belong to these weights", found at DeepSeek-V3's width)."""
    model = tiny_qwen3_moe(hidden_size=128, moe_intermediate_size=256, num_experts=64, num_hidden_layers=2)
    ct, ref = _pair(tmp_path, model, W4A16, "packed")
    data = [Batch("en", IDS, torch.ones_like(IDS))]
    assert np.array_equal(collect_streamed(ct, data).ids, collect_streamed(ref, data).ids)


def test_kimi_k25_with_int4_experts_routes_and_prunes_as_its_float_model(tmp_path):
    """Kimi-K2.5 (transformers' kimi_k25: a vision tower beside a DeepSeek-V3 language model), whose checkpoints ship
    compressed-tensors INT4 weights, tiny: traces streamed (its experts 3 at a time too) and loaded, REAP disabled
    and removed, as on its float checkpoint; the removal keeps the kept experts packed."""
    ct, ref = _pair(tmp_path, tiny_family_model("kimi_k25", image_text=True, perturb=0.05), W4A16, "packed")
    _routes_and_pruning_equal(tmp_path, ct, ref)
    data = [Batch("en", IDS, torch.ones_like(IDS))]
    assert np.array_equal(collect_streamed(ct, data, experts_per_load=3).ids, collect_streamed(ref, data).ids)
    with safe_open(tmp_path / "packed_keep" / "model.safetensors", "pt") as cut:
        assert any(".experts.1." in k and k.endswith("_packed") for k in cut.keys())


def test_fused_pack_quantized_experts_read_but_are_not_removed(tmp_path):
    """Every expert packed in one tensor (the model's fused layout): read as the float checkpoint, whole and in
    parts; removing experts from it, which would change its stored shape tensor, is refused before anything is
    written."""
    ct, ref = _pair(tmp_path, tiny_qwen3_moe(), save_compressed, "packed", strategy="group", kind="int", packed=4,
                    fused=True)
    data = [Batch("en", IDS, torch.ones_like(IDS))]
    want = collect_streamed(ref, data, dtype=torch.float32)
    got = collect_streamed(ct, data, dtype=torch.float32, experts_per_load=3)
    assert np.array_equal(got.ids, want.ids)
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match="pack-quantized values of every expert") as e:
        remove_experts(ct, tmp_path / "cut", {f"model.layers.{i}.mlp": [0, 2] for i in range(3)})
    assert "\n" not in str(e.value) and _tree(tmp_path) == before


@pytest.mark.parametrize("bits", [3, 16])
def test_other_packings_are_refused(tmp_path, bits):
    """moekit reads the widths whose values fill a word exactly (2, 4, 8 bits); compressed-tensors 0.20 packs 3-bit
    values across word boundaries, which moekit does not read; 16 bits are not packed."""
    ct, _ = _pair(tmp_path, tiny_qwen3(), W4A16, "packed")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = bits
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"its weights are {bits}-bit int \(moekit reads 2 or 4 or 8-bit int"):
        ShardReader(ct)


@pytest.mark.parametrize("actorder", ["static", "weight"])
def test_gptq_activation_order_of_weights_is_read(tmp_path, actorder):
    """GPTQ's activation order "weight" (alias "static", llm-compressor's default) changes how it calibrates, not
    what it stores: such a W8A8 checkpoint reads as its float model ("group" stores a permutation: refused above)."""
    ct, ref = _pair(tmp_path, tiny_qwen3(), save_compressed, "compressed", strategy="channel", kind="int")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    (ct / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert torch.equal(load_dense(ct)(IDS).logits, load_dense(ref)(IDS).logits)


@pytest.mark.parametrize("strategy,key,value", [("group", "group_size", 0), ("group", "group_size", "16"),
                                                ("block", "block_structure", [16]), ("block", "block_structure", None)])
def test_bad_compressed_tensors_sizes_are_refused(tmp_path, strategy, key, value):
    ct, _ = _pair(tmp_path, tiny_qwen3(), save_compressed, "compressed", strategy=strategy, kind="int")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"the {strategy} strategy's {key} is"):
        ShardReader(ct)


def _shard_apart(folder: Path) -> None:
    """Split model.safetensors into two shards and an index, every scale in the other shard than its weight (the Hub's
    FP8 checkpoints spread over 163 shards do not promise them together)."""
    from safetensors.torch import save_file

    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    first = {k for i, k in enumerate(sorted(k for k in tensors if not k.endswith("_scale_inv"))) if i % 2 == 0}
    first |= {k for k in tensors if k.endswith("_scale_inv") and k[:-len("_scale_inv")] not in first}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": set(tensors) - first}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in sorted(keys)}, folder / name, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, keys in shards.items() for k in keys}}))


def test_the_cli_on_a_sharded_fp8_moe(tmp_path, run):
    """`moekit inspect`, `routes collect --stream on`, `select reap` and `prune --keep` on a DeepSeek-V3 whose scales
    lie in other shards than their weights: the kept experts stay FP8 and compute what the float checkpoint's do."""
    fp8, ref = _pair(tmp_path, MOE["deepseek_v3"]())
    _shard_apart(fp8)
    where = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(where[k] != where[k[:-len("_scale_inv")]] for k in where if k.endswith("_scale_inv"))
    rc, out, err = run("inspect", fp8)
    assert rc == 0 and "FP8 weights (blocks of 16×16), read dequantized" in out, err
    (tmp_path / "en.txt").write_text("hello world\nthe cat sat on the mat\n")
    for src in (fp8, ref):
        rc, _, err = run("routes", "collect", "--model", src, "--texts", f"en={tmp_path / 'en.txt'}", "--out",
                         tmp_path / f"{src.name}.npz", "--stream", "on")
        assert rc == 0, err
    assert np.array_equal(np.load(tmp_path / "fp8.npz")["ids"], np.load(tmp_path / "float.npz")["ids"])
    rc, _, err = run("select", "reap", tmp_path / "fp8.npz", "--top", "2", "--out", tmp_path / "keep.json")
    assert rc == 0, err
    for src in (fp8, ref):
        rc, _, err = run("prune", "--model", src, "--experts", tmp_path / "keep.json", "--keep", "--out",
                         tmp_path / f"{src.name}_kept")
        assert rc == 0, err
    config = json.loads((tmp_path / "fp8_kept" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["n_routed_experts"] == 2
    with torch.no_grad():
        assert torch.equal(load_dense(tmp_path / "fp8_kept")(IDS).logits,
                           load_dense(tmp_path / "float_kept")(IDS).logits)
