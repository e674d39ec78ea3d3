"""Finding FFN slots in HF models, selecting them, and installing MoE layers."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from moekit.config import validate
from moekit.errors import ConfigError, UnsupportedModelError
from moekit.moe import MoELayer, MoESpec, moe_layers
from moekit.surgery import find_slots, slot_at, supported_families
from moekit.testing import TINY_MODELS, logits, tiny_inputs, tiny_llama, tiny_whisper
from moekit.checkpoint.upcycle_model import selected_slots, upcycle

# family -> (stacks with their block counts, adapter, FFN path in the block, activation)
EXPECTED = {
    "llama": ({"model.layers": 4}, "gated_mlp", "mlp", "silu"),
    "mistral": ({"model.layers": 4}, "gated_mlp", "mlp", "silu"),
    "qwen2": ({"model.layers": 4}, "gated_mlp", "mlp", "silu"),
    "qwen3": ({"model.layers": 4}, "gated_mlp", "mlp", "silu"),
    "gemma3": ({"model.layers": 4}, "gated_mlp", "mlp", "gelu_pytorch_tanh"),
    "gpt2": ({"transformer.h": 4}, "conv1d_mlp", "mlp", "gelu_new"),
    "bert": ({"bert.encoder.layer": 4}, "bert_ffn", "intermediate", "gelu"),
    "whisper": ({"model.encoder.layers": 2, "model.decoder.layers": 2}, "inline_fc", "fc1", "gelu"),
}


def test_every_tiny_family_is_covered():
    assert set(EXPECTED) == set(TINY_MODELS)


def _dense_ffn(block: nn.Module, adapter: str, x: torch.Tensor) -> torch.Tensor:
    """The block's dense FFN applied to x, computed with the HF modules."""
    if adapter in ("gated_mlp", "conv1d_mlp"):
        return block.mlp(x)
    if adapter == "bert_ffn":
        return block.output.dense(block.intermediate(x))
    return block.fc2(block.activation_fn(block.fc1(x)))


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_find_slots(family):
    stacks, adapter, rel, act = EXPECTED[family]
    model = TINY_MODELS[family]()
    slots = find_slots(model)
    assert [(s.stack, s.index) for s in slots] == [(st, i) for st, n in stacks.items() for i in range(n)]
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    for s in slots:
        assert s.adapter.name == adapter and s.rel == rel and s.act == act
        assert s.path == f"{s.stack}.{s.index}.{rel}"
        assert s.block is model.get_submodule(s.stack)[s.index]
        # the FFNWeights read from the block compute what the HF modules compute
        with torch.no_grad():
            torch.testing.assert_close(s.read()(x), _dense_ffn(s.block, adapter, x), atol=1e-6, rtol=1e-5)
        again = slot_at(model, s.stack, s.index, adapter)
        assert (again.block, again.rel, again.act, again.adapter) == (s.block, s.rel, s.act, s.adapter)


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_install_replaces_exactly_the_ffn(family):
    stacks, adapter, rel, _ = EXPECTED[family]
    model = upcycle(TINY_MODELS[family](), validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    layers = moe_layers(model)
    assert [p for p, _ in layers] == [f"{st}.{i}.{rel}" for st, n in stacks.items() for i in range(n)]
    for path, moe in layers:
        stack, index, _ = path.rsplit(".", 2)
        assert moe.slot == {"stack": stack, "index": int(index), "adapter": adapter}
        block = model.get_submodule(stack)[int(index)]
        if adapter == "bert_ffn":
            assert isinstance(block.output.dense, nn.Identity) and isinstance(block.output.LayerNorm, nn.LayerNorm)
        if adapter == "inline_fc":
            assert isinstance(block.fc2, nn.Identity) and isinstance(block.activation_fn, nn.Identity)
    assert find_slots(model) == []  # nothing dense is left, and no error for an all-MoE model


def _moe_paths(model) -> list[str]:
    return [p for p, _ in moe_layers(model)]


@pytest.mark.parametrize("sel,expected", [
    ({"every": 2}, [1, 3, 5]),
    ({"every": 3}, [2, 5]),
    ({"every": 1}, [0, 1, 2, 3, 4, 5]),
    ({"every": 6}, [5]),
    ({"layers": [0, 4]}, [0, 4]),
    ({}, [0, 1, 2, 3, 4, 5]),
])
def test_every_and_layers(sel, expected):
    dense = tiny_llama(num_hidden_layers=6)
    model = upcycle(dense, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume", **sel}))
    assert _moe_paths(model) == [f"model.layers.{i}.mlp" for i in expected]
    for i, block in enumerate(model.model.layers):
        assert isinstance(block.mlp, MoELayer) == (i in expected)
        if i not in expected:
            assert type(block.mlp).__name__ == "LlamaMLP"


@pytest.mark.parametrize("sel,expected", [
    ({"every": 2}, ["model.encoder.layers.1.fc1", "model.decoder.layers.1.fc1"]),  # per stack
    ({"layers": [0]}, ["model.encoder.layers.0.fc1", "model.decoder.layers.0.fc1"]),
    ({"target": "encoder"}, ["model.encoder.layers.0.fc1", "model.encoder.layers.1.fc1"]),
    ({"target": r"decoder", "every": 2}, ["model.decoder.layers.1.fc1"]),
    ({"target": r"layers\.0\."}, ["model.encoder.layers.0.fc1", "model.decoder.layers.0.fc1"]),
])
def test_selection_per_stack_and_target(sel, expected):
    model = tiny_whisper()
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume", **sel})
    assert [s.path for s in selected_slots(model, spec)] == expected
    assert _moe_paths(upcycle(model, spec)) == expected


def test_decoder_embedded_in_a_larger_model_is_found():
    class SpeechLM(nn.Module):  # e.g. an audio encoder + a known LM, not a transformers class
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 32)
            self.lm = tiny_llama()

    wrapper = SpeechLM()
    slots = find_slots(wrapper)
    assert [s.path for s in slots] == [f"lm.model.layers.{i}.mlp" for i in range(4)]
    assert all(s.act == "silu" for s in slots)  # read from the embedded model's config
    inputs = tiny_inputs(wrapper.lm)
    ref = logits(wrapper.lm, inputs)
    upcycle(wrapper, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    assert (logits(wrapper.lm, inputs) - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
    nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]),
])
def test_model_without_ffn_is_unsupported(model):
    with pytest.raises(UnsupportedModelError) as info:
        find_slots(model)
    msg = str(info.value)
    assert supported_families() in msg
    for family in ("Llama", "GPT-2", "BERT", "Whisper"):
        assert family in msg
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2})
    with pytest.raises(UnsupportedModelError, match="Supported families"):
        upcycle(model, spec)


@pytest.mark.parametrize("sel", [{"layers": [4, 7]}, {"every": 5}, {"target": "encoder"}, {"target": "^mlp$"}])
def test_spec_selecting_nothing(sel):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2, **sel})
    with pytest.raises(ConfigError, match=r"(selects no FFN|do not exist).*model\.layers \(4 blocks\)"):
        upcycle(model, spec)
    assert moe_layers(model) == []
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_invalid_target_regex_is_a_config_error():
    with pytest.raises(ConfigError, match="regular expression"):
        validate(MoESpec, {"target": "layers.(0"})


class _ScaledMLP(nn.Module):
    """Llama's MLP names with something more inside: a scale on the intermediate (as Falcon-H1's multipliers)."""

    def __init__(self, mlp: nn.Module, scale: float):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.scale = scale

    def forward(self, x):
        return self.down_proj(self.scale * self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("scale", [1.5, 1.001])
def test_an_ffn_that_computes_more_than_its_weights_is_refused_before_any_change(scale):
    model = tiny_llama(num_hidden_layers=3)
    model.model.layers[2].mlp = _ScaledMLP(model.model.layers[2].mlp, scale)  # the last layer: checked up front
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.2\.mlp: .* does not compute what moekit reads") as e:
        upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    assert "\n" not in str(e.value)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert not moe_layers(model) and all(m.training for m in model.modules())  # modes restored after the probe


def test_the_probe_allows_16_bit_rounding_and_checks_16_bit_models():
    """A bf16 model's FFN is read as it is (no false refusal from bf16 rounding); a wrong one is still refused."""
    spec = validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"})
    assert moe_layers(upcycle(tiny_llama().to(torch.bfloat16), spec))
    model = tiny_llama().to(torch.bfloat16)
    model.model.layers[0].mlp = _ScaledMLP(model.model.layers[0].mlp, 1.5)
    with pytest.raises(UnsupportedModelError, match="does not compute what moekit reads"):
        upcycle(model, spec)


class _GatedFC(nn.Module):
    """fc1 to [gate; up] (Moshi) or [up; gate] (Moonshine's decoder), then fc2."""

    def __init__(self, gate_first: bool):
        super().__init__()
        self.fc1, self.fc2, self.activation_fn = nn.Linear(8, 24), nn.Linear(12, 8), nn.SiLU()
        self.gate_first = gate_first

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        gate, up = (a, b) if self.gate_first else (b, a)
        return self.fc2(self.activation_fn(gate) * up)


class _Blocks(nn.Module):
    def __init__(self, *mlps: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList()
        for mlp in mlps:
            block = nn.Module()
            block.mlp = mlp
            self.layers.append(block)

    def forward(self, x):
        for block in self.layers:
            x = x + block.mlp(x)
        return x


def test_which_half_of_a_fused_fc1_is_the_gate_is_told_by_what_it_computes():
    torch.manual_seed(0)
    model = _Blocks(_GatedFC(gate_first=True), _GatedFC(gate_first=False))
    slots = find_slots(model)  # no config: the activation is the one the MLP holds
    assert [s.adapter.name for s in slots] == ["fused_gated_fc"] * 2
    assert all(s.act in ("silu", "swish") for s in slots)  # ACT2FN's two names of nn.SiLU
    for s, gate_rows in zip(slots, (slice(0, 12), slice(12, 24))):
        ffn = s.checked_read()
        assert torch.equal(ffn.gate, s.block.mlp.fc1.weight[gate_rows].detach())
    x = torch.randn(2, 5, 8)
    want = model(x).detach()
    upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_the_activation_is_the_one_the_ffn_holds_where_its_config_names_another():
    """Layer 0's MLP runs GELU though the config says silu: its slot reads gelu, the others keep the config's; where
    the MLP holds the config's activation under another key's class (gemma3's gelu_pytorch_tanh), the config's name
    is kept (EXPECTED above)."""
    model = tiny_llama()
    model.model.layers[0].mlp.act_fn = nn.GELU()
    assert [s.act for s in find_slots(model)] == ["gelu", "silu", "silu", "silu"]
    x = tiny_inputs(model)
    want = logits(model, x)
    upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    assert (logits(model, x) - want).abs().max() <= 1e-5


class _CodeActMLP(nn.Module):
    """LFM2's MLP: w1/w3/w2 and an activation called in code, held by no attribute (`acts`: applied in turn)."""

    def __init__(self, *acts):
        super().__init__()
        self.w1, self.w3, self.w2, self.acts = nn.Linear(8, 12, bias=False), nn.Linear(8, 12), nn.Linear(12, 8), acts

    def forward(self, x):
        h = self.w1(x).float()  # a cast is no activation
        for act in self.acts:
            h = act(h)
        return self.w2(h * self.w3(x))


@pytest.mark.parametrize("acts", [(torch.nn.functional.silu,),
                                  (lambda t: torch.nn.functional.gelu(t, approximate="tanh"),), (torch.relu, torch.tanh)])
def test_an_activation_called_in_code_is_named_by_what_it_computes_on_the_meta_device_too(acts):
    """No config and no activation attribute: the one activation the forward calls on one tensor (LFM2's F.silu), on
    real and meta weights alike (the streamed plan); two of them (relu then tanh) are refused in one line."""
    torch.manual_seed(0)
    model = _Blocks(_CodeActMLP(*acts), _CodeActMLP(*acts))
    with torch.device("meta"):
        meta = _Blocks(_CodeActMLP(*acts))
    if len(acts) > 1:
        for m in (model, meta):
            with pytest.raises(UnsupportedModelError, match="cannot tell the FFN activation of Module") as e:
                find_slots(m)
            assert "\n" not in str(e.value)
        return
    (act,) = {s.act for s in find_slots(model) + find_slots(meta)}  # e.g. silu; gelu_new or gelu_fast: one function
    t = torch.linspace(-6, 6, 49)
    torch.testing.assert_close(ACT2FN[act](t), acts[0](t))
    x = torch.randn(2, 5, 8)
    expect = model(x).detach()
    upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    assert len(moe_layers(model)) == 2
    torch.testing.assert_close(model(x), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,ffn", [("T5", "gated-gelu"), ("T5", "relu"), ("MT5", "gated-gelu"),
                                      ("UMT5", "gated-gelu")])
def test_t5_family_ffns_upcycle_exactly(name, ffn):
    """T5's DenseReluDense (wi/wo) and T5 v1.1's gated one (wi_0/wi_1/wo), its activation its `dense_act_fn`."""
    import transformers as tf

    cfg = getattr(tf, f"{name}Config")(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                                       feed_forward_proj=ffn, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = getattr(tf, f"{name}ForConditionalGeneration")(cfg).eval()
    slots = find_slots(model)
    assert len(slots) == 4 and {s.adapter.name for s in slots} == {"gated_mlp" if "gated" in ffn else "linear_mlp"}
    assert {s.act for s in slots} == {"gelu_new" if "gated" in ffn else "relu"}
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, decoder_input_ids=ids).logits
        upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
        torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Bloom", "Mpt"])
def test_an_ffn_that_adds_the_residual_is_replaced_by_an_moe_that_adds_it_after_the_same_dropout(name):
    """BLOOM's and MPT's MLPs are called as mlp(x, residual) and add it after their hidden dropout: the MoE layer
    takes both and does the same, so UME's MoE equals the dense model in training mode too, dropout masks and all
    (the same random draws in the same order)."""
    import transformers as tf

    p = 0.2 if name == "Bloom" else 0.0  # MPT's dropout is its attn_pdrop, typed int in transformers 5.23
    cfg = getattr(tf, f"{name}Config")(vocab_size=64, hidden_size=16, n_layer=2, n_head=4, d_model=16, n_heads=4,
                                       n_layers=2, hidden_dropout=p)
    torch.manual_seed(0)
    model = getattr(tf, f"{name}ForCausalLM")(cfg).train()
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(0))

    def run():
        torch.manual_seed(1)
        return model(input_ids=ids).logits.detach()

    want = run()
    upcycle(model, validate(MoESpec, {"num_experts": 4, "top_k": 2, "init": "ume"}))
    layers = moe_layers(model)
    assert len(layers) == 2 and all((m.dropout.p if p else m.dropout) == (p or None) for _, m in layers)
    if p:  # the dropout was on
        assert (model.eval()(input_ids=ids).logits - want).abs().max() > 1e-3
    torch.testing.assert_close(model.train() and run(), want, rtol=1e-5, atol=1e-5)
