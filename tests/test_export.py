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
from moekit.export import EXPORTERS, export_model
from moekit.moe import Experts, Router, SharedExpert
from moekit.testing import logits, tiny_inputs, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3

TOL = 1e-5


def moe_model(build, seed: int = 0, **spec):
    """An upcycled tiny model whose routers and experts are randomized, so routing and experts differ."""
    model = upcycle(build(), MoESpec(**{"num_experts": 4, "top_k": 2, "init": "drop", **spec}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, moe in moe_layers(model):
            moe.router.weight.copy_(torch.randn(moe.router.weight.shape, generator=g))
            for p in [*moe.experts.parameters(), *(moe.shared.parameters() if moe.shared else [])]:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def roundtrip(model, fmt: str, out, cls: type) -> tuple[nn.Module, float]:
    """Export, reload with plain transformers (fp32), return the native model and max |Δ logits|."""
    export_model(model, fmt, out)
    native = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(native) is cls
    x = tiny_inputs(model, batch=2, length=12)
    ref = logits(model, x)
    return native, (ref - logits(native, x)).abs().max().item()


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral])
def test_mixtral(tmp_path, build):
    model = moe_model(build, router={"jitter": 0.05})
    x = tiny_inputs(model)
    assert (logits(model, x) - logits(build(), x)).abs().max() > 1e-2  # the MoE differs from the dense model
    native, diff = roundtrip(model, "mixtral", tmp_path / "out", tf.MixtralForCausalLM)
    assert diff <= TOL
    assert native.config.router_jitter_noise == 0.05 and native.config.num_local_experts == 4


@pytest.mark.parametrize("scoring", ["topk_softmax", "softmax_topk"])
def test_qwen3_moe_with_dense_layers(tmp_path, scoring):
    model = moe_model(tiny_qwen3, every=2, router={"scoring": scoring})
    native, diff = roundtrip(model, "qwen3_moe", tmp_path / "out", tf.Qwen3MoeForCausalLM)
    assert diff <= TOL
    assert native.config.mlp_only_layers == [0, 2]
    assert native.config.norm_topk_prob == (scoring == "topk_softmax")


@pytest.mark.parametrize("spec", [dict(init="spri", shared_expert=True, every=2),
                                  dict(init="noise", router={"scoring": "softmax_topk"})])
def test_qwen2_moe(tmp_path, spec):
    model = moe_model(tiny_qwen2, **spec)
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
    assert roundtrip(moe_model(build), fmt, tmp_path / "out", cls)[1] <= TOL


def test_tokenizer_and_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    model = moe_model(tiny_llama)
    with pytest.raises(OutputExistsError):
        export_model(model, "mixtral", out)
    assert (out / "keep.txt").exists()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    export_model(model, "mixtral", out, overwrite=True, tokenizer=tok)
    assert not (out / "keep.txt").exists() and (out / "tokenizer.json").is_file()
    assert tf.AutoConfig.from_pretrained(out).model_type == "mixtral"


def test_unknown_format(tmp_path):
    assert EXPORTERS.names() == ["mixtral", "qwen2_moe", "qwen3_moe"]
    with pytest.raises(ConfigError, match="export format"):
        export_model(moe_model(tiny_llama), "gguf-moe", tmp_path / "out")


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
    "dense layers": ("mixtral", lambda: moe_model(tiny_llama, every=2), "no dense layers.*qwen2_moe"),
    "scoring": ("mixtral", lambda: moe_model(tiny_llama, router={"scoring": "softmax_topk"}), "renormalizes"),
    "shared": ("mixtral", lambda: moe_model(tiny_llama, shared_expert=True, init="noise"), "shared expert"),
    "family mixtral": ("mixtral", lambda: moe_model(tiny_qwen2), "LlamaForCausalLM or MistralForCausalLM"),
    "family qwen3": ("qwen3_moe", lambda: moe_model(tiny_llama), "Qwen3ForCausalLM"),
    "family qwen2": ("qwen2_moe", lambda: moe_model(tiny_qwen3), "Qwen2ForCausalLM or LlamaForCausalLM or MistralForCausalLM"),
    "qwen3 shared": ("qwen3_moe", lambda: moe_model(tiny_qwen3, shared_expert=True, init="noise"), "shared expert"),
    "router_sharing": ("qwen3_moe", lambda: moe_model(tiny_qwen3, router_sharing="all"), "routers are shared"),
    "same router object": ("mixtral", lambda: _share_router(moe_model(tiny_llama)), "routers are shared"),
    "expert bias": ("mixtral", lambda: moe_model(lambda: tiny_llama(mlp_bias=True)), "biases"),
    "non-gated": ("mixtral", lambda: _non_gated(moe_model(tiny_llama)), "not gated"),
    "activation": ("qwen2_moe", lambda: _act(moe_model(tiny_qwen2)), "activation 'gelu'"),
    "experts": ("qwen2_moe", lambda: _fewer_experts(moe_model(tiny_qwen2)), "number of experts differs"),
    "top_k": ("qwen3_moe", lambda: _top_k(moe_model(tiny_qwen3)), "top_k differs"),
    "shared sizes": ("qwen2_moe", lambda: _other_shared_size(moe_model(tiny_qwen2, init="spri", shared_expert=True)),
                     "different sizes"),
    "jitter": ("qwen2_moe", lambda: moe_model(tiny_qwen2, router={"jitter": 0.1}), "jitter"),
    "outside decoder": ("mixtral", lambda: _outside(moe_model(tiny_llama)), "not a decoder layer's MLP"),
    "dropout": ("qwen3_moe", lambda: _dropout(moe_model(tiny_qwen3)), "dropout"),
    "mixed windows": ("qwen3_moe", lambda: moe_model(lambda: tiny_qwen3(use_sliding_window=True, sliding_window=4,
                                                                        max_window_layers=2)), "sliding-window"),
    "dense model": ("mixtral", tiny_llama, "no MoE layers"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_leave_nothing(tmp_path, case):
    fmt, make, reason = REFUSALS[case]
    with pytest.raises(ExportError, match=f"cannot export to {fmt}: .*{reason}"):
        export_model(make(), fmt, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
