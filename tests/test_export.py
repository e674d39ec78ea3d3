"""Export to native transformers MoE formats: same logits after a plain from_pretrained, clear refusals."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models
from torch import nn

from moekit import MoESpec, moe_layers, upcycle
from moekit.errors import ConfigError, ExportError, OutputExistsError
from moekit.checkpoint.convert import export
from moekit.checkpoint.export import EXPORTERS
from moekit.moe import Experts, Router, SharedExpert
from moekit.testing import logits, randomized_moe, tiny_inputs, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3

TOL = 1e-5


def roundtrip(model, fmt: str, out, cls: type) -> tuple[nn.Module, float]:
    """Export, reload with plain transformers (fp32), return the native model and max |Δ logits|."""
    export(model, out, fmt)
    native = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(native) is cls
    x = tiny_inputs(model, batch=2, length=12)
    ref = logits(model, x)
    return native, (ref - logits(native, x)).abs().max().item()


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral])
def test_mixtral(tmp_path, build):
    model = randomized_moe(build, router={"jitter": 0.05})
    x = tiny_inputs(model)
    assert (logits(model, x) - logits(build(), x)).abs().max() > 1e-2  # the MoE differs from the dense model
    native, diff = roundtrip(model, "mixtral", tmp_path / "out", tf.MixtralForCausalLM)
    assert diff <= TOL
    assert native.config.router_jitter_noise == 0.05 and native.config.num_local_experts == 4


@pytest.mark.parametrize("scoring", ["topk_softmax", "softmax_topk"])
def test_qwen3_moe_with_dense_layers(tmp_path, scoring):
    model = randomized_moe(tiny_qwen3, every=2, router={"scoring": scoring})
    native, diff = roundtrip(model, "qwen3_moe", tmp_path / "out", tf.Qwen3MoeForCausalLM)
    assert diff <= TOL
    assert native.config.mlp_only_layers == [0, 2]
    assert native.config.norm_topk_prob == (scoring == "topk_softmax")


@pytest.mark.parametrize("spec", [dict(init="spri", shared_expert=True, every=2),
                                  dict(init="noise", router={"scoring": "softmax_topk"})])
def test_qwen2_moe(tmp_path, spec):
    model = randomized_moe(tiny_qwen2, **spec)
    native, diff = roundtrip(model, "qwen2_moe", tmp_path / "out", tf.Qwen2MoeForCausalLM)
    assert diff <= TOL
    assert native.config.shared_expert_intermediate_size == native.config.moe_intermediate_size == 64
    assert native.config.mlp_only_layers == ([0, 2] if "every" in spec else [])


@pytest.mark.parametrize("fmt,build,cls", [
    ("qwen3_moe", lambda: tiny_qwen3(head_dim=16, tie_word_embeddings=True), tf.Qwen3MoeForCausalLM),
    ("qwen2_moe", lambda: tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=2),
     tf.Qwen2MoeForCausalLM),
    ("mixtral", lambda: tiny_mistral(sliding_window=4), tf.MixtralForCausalLM),
])
def test_source_variants(tmp_path, fmt, build, cls):
    """head_dim != hidden/heads, tied embeddings, sliding windows shorter than the input."""
    assert roundtrip(randomized_moe(build), fmt, tmp_path / "out", cls)[1] <= TOL


def test_tokenizer_and_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    model = randomized_moe(tiny_llama)
    with pytest.raises(OutputExistsError):
        export(model, out, "mixtral")
    assert (out / "keep.txt").exists()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    export(model, out, "mixtral", overwrite=True, tokenizer=tok)
    assert not (out / "keep.txt").exists() and (out / "tokenizer.json").is_file()
    assert tf.AutoConfig.from_pretrained(out).model_type == "mixtral"


def test_unknown_format(tmp_path):
    assert EXPORTERS.names() == ["mixtral", "qwen2_moe", "qwen3_moe"]
    with pytest.raises(ConfigError, match="export format"):
        export(randomized_moe(tiny_llama), tmp_path / "out", "gguf-moe")


def _layer(model, i: int):
    return moe_layers(model)[i][1]


def _share_router(model):
    _layer(model, 1).router = _layer(model, 0).router
    return model


def _fewer_experts(model):
    moe = _layer(model, 1)
    moe.router, moe.experts = Router(32, 2, 2, "topk_softmax"), Experts(2, 32, 64, "silu")
    return model


def _non_gated(model):
    _layer(model, 0).experts = Experts(4, 32, 64, "silu", gated=False)
    return model


def _other_shared_size(model):
    moe = _layer(model, 0)
    moe.shared = SharedExpert(moe.shared.to_weights().clone(up=torch.zeros(8, 32), gate=torch.zeros(8, 32),
                                                            down=torch.zeros(32, 8)))
    return model


def _top_k(model):
    _layer(model, 1).router.top_k = 1
    return model


def _act(model):
    _layer(model, 0).experts.act = "gelu"
    return model


def _outside(model):
    model.model.extra = copy.deepcopy(_layer(model, 0))  # an MoE layer outside model.layers.<i>.mlp
    return model


def _dropout(model):
    _layer(model, 0).dropout = nn.Dropout(0.1)
    return model


REFUSALS = {
    "dense layers": ("mixtral", lambda: randomized_moe(tiny_llama, every=2), "no dense layers.*qwen2_moe"),
    "scoring": ("mixtral", lambda: randomized_moe(tiny_llama, router={"scoring": "softmax_topk"}), "renormalizes"),
    "shared": ("mixtral", lambda: randomized_moe(tiny_llama, shared_expert=True, init="noise"), "shared expert"),
    "family mixtral": ("mixtral", lambda: randomized_moe(tiny_qwen2), "LlamaForCausalLM or MistralForCausalLM"),
    "family qwen3": ("qwen3_moe", lambda: randomized_moe(tiny_llama), "Qwen3ForCausalLM"),
    "family qwen2": ("qwen2_moe", lambda: randomized_moe(tiny_qwen3), "Qwen2ForCausalLM or LlamaForCausalLM or MistralForCausalLM"),
    "qwen3 shared": ("qwen3_moe", lambda: randomized_moe(tiny_qwen3, shared_expert=True, init="noise"), "shared expert"),
    "router_sharing": ("qwen3_moe", lambda: randomized_moe(tiny_qwen3, router_sharing="all"), "routers are shared"),
    "same router object": ("mixtral", lambda: _share_router(randomized_moe(tiny_llama)), "routers are shared"),
    "expert bias": ("mixtral", lambda: randomized_moe(lambda: tiny_llama(mlp_bias=True)), "biases"),
    "non-gated": ("mixtral", lambda: _non_gated(randomized_moe(tiny_llama)), "not gated"),
    "activation": ("qwen2_moe", lambda: _act(randomized_moe(tiny_qwen2)), "activation 'gelu'"),
    "experts": ("qwen2_moe", lambda: _fewer_experts(randomized_moe(tiny_qwen2)), "number of experts differs"),
    "top_k": ("qwen3_moe", lambda: _top_k(randomized_moe(tiny_qwen3)), "top_k differs"),
    "shared sizes": ("qwen2_moe", lambda: _other_shared_size(randomized_moe(tiny_qwen2, init="spri", shared_expert=True)),
                     "different sizes"),
    "jitter": ("qwen2_moe", lambda: randomized_moe(tiny_qwen2, router={"jitter": 0.1}), "jitter"),
    "outside decoder": ("mixtral", lambda: _outside(randomized_moe(tiny_llama)), "not a decoder layer's MLP"),
    "dropout": ("qwen3_moe", lambda: _dropout(randomized_moe(tiny_qwen3)), "dropout"),
    "mixed windows": ("qwen3_moe", lambda: randomized_moe(lambda: tiny_qwen3(use_sliding_window=True, sliding_window=4,
                                                                        max_window_layers=2)), "sliding-window"),
    "dense model": ("mixtral", tiny_llama, "no MoE layers"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_leave_nothing(tmp_path, case):
    fmt, make, reason = REFUSALS[case]
    with pytest.raises(ExportError, match=f"cannot export to {fmt}: .*{reason}"):
        export(make(), tmp_path / "out", fmt)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ layouts and other readers

HUB_NAMES = {  # layer 0's MoE tensors as the Hub's own checkpoints name them (expert 0 of each projection)
    "mixtral": {"model.layers.0.block_sparse_moe.gate.weight", *(f"model.layers.0.block_sparse_moe.experts.0.{w}.weight"
                                                                 for w in ("w1", "w2", "w3"))},
    "qwen2_moe": {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                  *(f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")),
                  *(f"model.layers.0.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))},
    "qwen3_moe": {"model.layers.0.mlp.gate.weight", *(f"model.layers.0.mlp.experts.0.{p}_proj.weight"
                                                      for p in ("gate", "up", "down"))},
}
SOURCES = {"mixtral": tiny_llama, "qwen2_moe": tiny_qwen2, "qwen3_moe": tiny_qwen3}


def stored(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("fmt", HUB_NAMES)
def test_classic_layout_uses_the_hub_names(tmp_path, fmt):
    """Default: one tensor per expert, named as mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B and
    Qwen/Qwen3-30B-A3B name them; transformers 5 fuses them on load (equal logits, see roundtrip)."""
    model = randomized_moe(SOURCES[fmt])
    _, diff = roundtrip(model, fmt, tmp_path / "out", EXPORTERS.get(fmt).native)
    names = set(stored(tmp_path / "out"))
    layer0 = {n for n in names if n.startswith("model.layers.0.") and ("expert" in n or ".gate." in n)}
    assert diff <= TOL and layer0 == HUB_NAMES[fmt] | {n.replace("experts.0.", f"experts.{e}.") for n in HUB_NAMES[fmt]
                                                       for e in range(4) if "experts.0." in n}
    assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("fmt", HUB_NAMES)
def test_fused_layout(tmp_path, fmt):
    """layout="fused": transformers 5's stacked tensors, the same logits."""
    model = randomized_moe(SOURCES[fmt])
    export(model, tmp_path / "out", fmt, layout="fused")
    names = set(stored(tmp_path / "out"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    assert not any(".experts.0." in n for n in names)
    native = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    x = tiny_inputs(model, batch=2, length=12)
    assert (logits(model, x) - logits(native, x)).abs().max() <= TOL


def test_unknown_layout(tmp_path):
    with pytest.raises(ConfigError, match="unknown layout 'flat'; choose one of: classic, fused"):
        export(randomized_moe(tiny_llama), tmp_path / "out", "mixtral", layout="flat")
    assert list(tmp_path.iterdir()) == []


def test_config_carries_transformers_4_keys(tmp_path):
    """transformers 4.x reads rope_theta / rope_scaling and num_experts where 5 writes rope_parameters and
    num_local_experts: both are written, with the same values, and transformers 5 reads the same config."""
    import json

    model = randomized_moe(lambda: tiny_qwen3(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}))
    export(model, tmp_path / "out", "qwen3_moe")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_theta"] == 5e5 and cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert cfg["num_experts"] == cfg["num_local_experts"] == 4
    assert tf.AutoConfig.from_pretrained(tmp_path / "out").rope_parameters == model.config.rope_parameters
    export(randomized_moe(tiny_llama), tmp_path / "mx", "mixtral")
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["rope_theta"] == 10000.0


def test_tokenizer_class_transformers_4_reads(tmp_path):
    """transformers 5 saves a tokenizer.json-backed tokenizer as "TokenizersBackend", a class 4.x does not have:
    exports name PreTrainedTokenizerFast, which both read from the same tokenizer.json."""
    import json

    from moekit.testing import tiny_tokenizer

    export(randomized_moe(tiny_llama), tmp_path / "out", "mixtral", tokenizer=tiny_tokenizer())
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("abc")["input_ids"] == tiny_tokenizer()("abc")["input_ids"]


# Qwen2-MoE's constant shared-expert gate: sigmoid(g·x) = 1/2 exactly, never 0/0 in llama.cpp (silu(z)/z)

def _llama_cpp_sigmoid(z: "np.ndarray"):
    """llama.cpp's Qwen2-MoE gate in float32: ggml_silu(z) = z / (1 + expf(-z)), then divided by z."""
    import numpy as np

    z = z.astype(np.float32)
    with np.errstate(invalid="ignore"):
        return (z / (np.float32(1) + np.exp(-z))) / z


def test_half_gate_is_one_half_in_transformers_and_llama_cpp():
    import numpy as np

    from moekit.checkpoint.export.qwen2_moe import half_gate

    g = half_gate(576, torch.float32)
    assert torch.equal(g.bfloat16().float(), g) and (g > 0).all() and g.max() < 2.0 ** -59  # exact in bfloat16
    # every |z| the bound allows (2^-125 .. 2^-26, both signs): exactly 1/2 in float32 and bfloat16, and in
    # llama.cpp's silu(z)/z; z = 0 (a zero gate row) is 0/0 there
    mags = torch.logspace(-125, -26, 100_000, base=2)
    z = torch.cat([mags, -mags])
    assert (torch.sigmoid(z) == 0.5).all() and (torch.sigmoid(z.bfloat16()) == 0.5).all()
    assert (_llama_cpp_sigmoid(z.numpy()) == 0.5).all()
    assert np.isnan(_llama_cpp_sigmoid(np.zeros(1)))[0]
    # the bound: an RMSNorm output x (|x|_1 <= H max|w|) with large weights gives |g·x| <= 2^-26
    h = torch.randn(64, 576) * 100
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) * 30.0  # RMSNorm, weights 30
    zx = x @ g.T  # (T, 1)
    assert (zx.abs() <= 2.0 ** -26).all() and (zx != 0).all() and (torch.sigmoid(zx) == 0.5).all()
    assert (_llama_cpp_sigmoid(zx.numpy()) == 0.5).all()
    f16 = half_gate(576, torch.float16)
    assert torch.equal(f16.half().float(), f16) and (f16.half() != 0).all()  # float16: nonzero (no 0/0)


@pytest.mark.parametrize("spec", [dict(init="spri", shared_expert=True), dict(init="drop")])
def test_qwen2_moe_gate_is_never_zero(tmp_path, spec):
    """An ungated shared expert (and the all-zero one that stands for no shared expert) gets the constant gate,
    not a zero row; the logits stay equal to moekit's."""
    model = randomized_moe(tiny_qwen2, **spec)
    _, diff = roundtrip(model, "qwen2_moe", tmp_path / "out", tf.Qwen2MoeForCausalLM)
    gates = {k: v for k, v in stored(tmp_path / "out").items() if k.endswith("shared_expert_gate.weight")}
    assert diff <= TOL and len(gates) == 4 and all((g != 0).all() for g in gates.values())


def test_qwen2_moe_zero_learned_gate_written_as_the_constant_gate(tmp_path):
    model = randomized_moe(tiny_qwen2, init="spri", shared_expert=True, shared_gate=True)
    with torch.no_grad():
        _layer(model, 0).shared_gate.weight.zero_()  # sigmoid(0) = 1/2: the same as the constant gate
    _, diff = roundtrip(model, "qwen2_moe", tmp_path / "out", tf.Qwen2MoeForCausalLM)
    assert diff <= TOL and (stored(tmp_path / "out")["model.layers.0.mlp.shared_expert_gate.weight"] != 0).all()


def test_qwen2_moe_writes_a_tied_lm_head(tmp_path):
    """llama.cpp's Qwen2-MoE loader needs output.weight: a tied head is stored too (transformers still ties it)."""
    model = randomized_moe(lambda: tiny_llama(tie_word_embeddings=True), init="spri", shared_expert=True)
    native, diff = roundtrip(model, "qwen2_moe", tmp_path / "out", tf.Qwen2MoeForCausalLM)
    state = stored(tmp_path / "out")
    assert diff <= TOL and torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert native.lm_head.weight is native.model.embed_tokens.weight


READER_GAPS = {  # (format, source, spec, layout): the llama.cpp gap's words, or None when every reader agrees
    "mixtral": ("mixtral", tiny_llama, {}, "classic", None),
    "mixtral fused": ("mixtral", tiny_llama, {}, "fused", "fused expert layout"),
    "mistral window": ("mixtral", lambda: tiny_mistral(sliding_window=4), {}, "classic", "sliding window of 4"),
    "qwen2 renormalized": ("qwen2_moe", tiny_qwen2, {}, "classic", "norm_topk_prob"),
    "qwen2 dense layers": ("qwen2_moe", tiny_llama, {"every": 2, "router": {"scoring": "softmax_topk"}}, "classic",
                           r"dense decoder layers \[0, 2\]"),
    "qwen2 ok": ("qwen2_moe", tiny_llama, {"router": {"scoring": "softmax_topk"}}, "classic", None),
    "qwen3 not renormalized": ("qwen3_moe", tiny_qwen3, {"router": {"scoring": "softmax_topk"}}, "classic",
                               "not renormalized"),
    "qwen3 ok": ("qwen3_moe", tiny_qwen3, {}, "classic", None),
}


@pytest.mark.parametrize("case", READER_GAPS)
def test_reader_gaps(case):
    """What llama.cpp and transformers 4.57 compute differently is known per format (tests/test_clients.py shows
    the converter and transformers 4.57 on these exports; bench/clients.py llama.cpp's tokens)."""
    import re

    from moekit.checkpoint.export.base import LLAMA_CPP, TF4

    fmt, build, spec, layout, gap = READER_GAPS[case]
    model = randomized_moe(build, **spec)
    exporter = EXPORTERS.get(fmt)
    gaps = exporter.reader_gaps(model, exporter.plan(model, layout))
    assert bool(gaps[TF4]) == (layout == "fused")
    assert (not gaps[LLAMA_CPP]) if gap is None else re.search(gap, " ".join(gaps[LLAMA_CPP])), gaps


STREAM_CASES = {"mixtral": (tiny_llama, {"init": "drop"}), "qwen2_moe": (lambda: tiny_llama(tie_word_embeddings=True),
                                                                        {"init": "spri", "shared_expert": True}),
                "qwen3_moe": (tiny_qwen3, {"init": "drop", "every": 2})}


@pytest.mark.parametrize("layout", ["classic", "fused"])
@pytest.mark.parametrize("fmt", STREAM_CASES)
def test_streaming_and_in_memory_exports_write_the_same_tensors(tmp_path, fmt, layout):
    """upcycle_checkpoint (streaming) and export of a model (in memory) write one file content, name for name, bit for bit."""
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.checkpoint.dense import load_dense

    build, spec_kw = STREAM_CASES[fmt]
    build().save_pretrained(tmp_path / "dense")
    spec = MoESpec(num_experts=4, top_k=2, **spec_kw)
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "streamed", spec, format=fmt, layout=layout)
    export(upcycle(load_dense(tmp_path / "dense"), spec), tmp_path / "memory", fmt, layout=layout)
    got, want = stored(tmp_path / "streamed"), stored(tmp_path / "memory")
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_auto_format_says_when_only_transformers_computes_it(tmp_path, run):
    """--format auto on a Llama with dense layers and a shared expert: Qwen2-MoE, which llama.cpp cannot compute
    (dense layers between MoE layers): the final line and the model card say so; a layout on moekit's format is
    refused."""
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.testing import tiny_tokenizer

    tiny_llama().save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    spec = MoESpec(num_experts=4, top_k=2, init="spri", shared_expert=True, every=2)
    w = upcycle_checkpoint(tmp_path / "dense", tmp_path / "auto", spec, format="auto")
    assert w.format == "qwen2_moe" and "for transformers" in w.why and "llama.cpp: dense decoder layers" in w.why
    assert w.readers.startswith("only transformers 5 and transformers 4.57 compute it as moekit does")
    card = (tmp_path / "auto" / "README.md").read_text()
    assert "**readers**: only transformers 5 and transformers 4.57" in card and "classic expert layout" in card
    rc, out, err = run("upcycle", "--model", tmp_path / "dense", "--method", "spri", "--experts", 4, "--top-k", 2,
                       "--every", 2, "--shared-expert", "--format", "auto", "--out", tmp_path / "cli")
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"wrote {tmp_path / 'cli'}: qwen2_moe") and "llama.cpp cannot represent dense" in last
    rc, out, err = run("upcycle", "--model", tmp_path / "dense", "--method", "drop", "--experts", 4, "--top-k", 2,
                       "--format", "auto", "--out", tmp_path / "mixtral")
    assert rc == 0 and "only" not in out.strip().splitlines()[-1]  # Mixtral: every reader computes it the same
    with pytest.raises(ConfigError, match="the moekit format has no expert layout"):
        upcycle_checkpoint(tmp_path / "dense", tmp_path / "x", spec, format="moekit", layout="fused")
    assert not (tmp_path / "x").exists()
