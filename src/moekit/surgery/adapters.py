"""Surgery adapters: where a block's FFN lives, how to read it as FFNWeights, how to install an MoE.

Adapters match by structure (module attributes), not by the model's class, so a known decoder
embedded in a larger model (speech-LLMs, vision-language models) is found too. A block can hold more than one FFN
(a Conformer's two half-step FFNs, feed_forward1 and feed_forward2): each is a slot of its own, named by its path
inside the block (`rel`).
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer


PROBE_TOKENS = 4


def probe(hidden: int, like: Tensor) -> Tensor:
    """(PROBE_TOKENS, hidden) fixed random inputs in `like`'s dtype and device: what an FFN's own forward is compared
    on (surgery.locate.read_checked)."""
    x = torch.randn(PROBE_TOKENS, hidden, generator=torch.Generator().manual_seed(0))
    return x.to(device=like.device, dtype=like.dtype)


def _bias(lin: nn.Module):
    return None if getattr(lin, "bias", None) is None else lin.bias.detach()


def _scaled(t: Tensor | None, scale: float) -> Tensor | None:
    return t if t is None or scale == 1 else t * scale


def _multiplier(m: nn.Module, name: str) -> float:
    """The number the FFN scales a projection's output by (Falcon-H1's gate_multiplier, down_multiplier), else 1
    (read_checked refuses an FFN that scales by anything else)."""
    value = getattr(m, name, 1)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 1


def _linears(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in names)


class Adapter:
    name: str
    families: str  # for messages

    def locate(self, block: nn.Module) -> list[str]:
        """Relative paths of the block's FFNs this adapter reads (where the MoE layers will live), in module
        order; empty if none."""
        raise NotImplementedError

    def read(self, block: nn.Module, rel: str, act: str) -> FFNWeights:
        raise NotImplementedError

    def install(self, block: nn.Module, rel: str, moe: MoELayer) -> None:
        raise NotImplementedError

    def forward(self, block: nn.Module, rel: str, x: Tensor) -> Tensor:
        """The block's own FFN on x: what the modules `install` replaces compute (surgery.locate.read_checked)."""
        raise NotImplementedError

    def activation(self, block: nn.Module, rel: str) -> list:
        """The modules and functions the FFN holds that may be its activation (surgery.locate.activation_of tells
        which one is by what it computes)."""
        return _callables(block.get_submodule(rel))

    def dropout(self, block: nn.Module, rel: str) -> float:
        return 0.0


def _callables(m: nn.Module) -> list:
    """A module's parameter-free children other than dropouts, and its function attributes."""
    kids = [c for c in m.children()
            if not isinstance(c, (nn.Dropout, nn.Identity)) and next(c.parameters(), None) is None]
    return kids + [v for v in vars(m).values() if callable(v) and not isinstance(v, (type, nn.Module))]


def _takes_residual(m: nn.Module) -> bool:
    """Whether the FFN adds the residual itself, after its dropout (BLOOM's and MPT's `forward(x, residual)`);
    the MoE layer replacing it does the same (MoELayer.forward)."""
    return "residual" in inspect.signature(m.forward).parameters


class _ChildAdapter(Adapter):
    """Each FFN is a child module of the block, replaced whole by an MoE layer."""

    def is_ffn(self, m: nn.Module) -> bool:
        raise NotImplementedError

    def locate(self, block):
        return [name for name, m in block.named_children() if self.is_ffn(m)]

    def install(self, block, rel, moe):
        setattr(block, rel, moe)

    def forward(self, block, rel, x):
        ffn = block.get_submodule(rel)
        return ffn(x, torch.zeros_like(x)) if _takes_residual(ffn) else ffn(x)

    def dropout(self, block, rel):  # on the FFN's output (GPT-2's MLP.dropout, wav2vec 2.0's output_dropout)
        ffn = block.get_submodule(rel)
        if _takes_residual(ffn) and isinstance(getattr(ffn, "hidden_dropout", None), (int, float)):  # BLOOM's, MPT's
            return float(ffn.hidden_dropout)
        d = next((d for d in (getattr(ffn, n, None) for n in ("dropout", "output_dropout")) if d is not None), None)
        return d.p if isinstance(d, nn.Dropout) else 0.0


class _PairAdapter(_ChildAdapter):
    """The FFN child holds one of PAIRS: (first, second) nn.Linear attribute names."""

    PAIRS: tuple[tuple[str, str], ...]

    def pair(self, m: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
        return next(((getattr(m, a), getattr(m, b)) for a, b in self.PAIRS if _linears(m, a, b)), None)

    def is_ffn(self, m):
        return self.pair(m) is not None


class GatedMLP(_ChildAdapter):
    name = "gated_mlp"
    families = ("gated MLP with gate_proj/up_proj/down_proj, w1/w3/w2, wi_0/wi_1/wo or proj_up_gate/proj_up/proj_down "
                "(Llama, Mistral, Qwen2, Qwen3, Gemma3, ...; LFM2; T5 v1.1, Flan-T5, mT5, UMT5; xLSTM)")
    TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("wi_0", "wi_1", "wo"),  # gate, up, down
               ("proj_up_gate", "proj_up", "proj_down"))

    def triple(self, m: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
        return next((tuple(getattr(m, n) for n in names) for names in self.TRIPLES if _linears(m, *names)), None)

    def is_ffn(self, m):
        return self.triple(m) is not None

    def read(self, block, rel, act):
        """Scales on the gate's and down projection's outputs (Falcon-H1's mlp_multipliers: `gate_multiplier`,
        `down_multiplier`) are folded into their weights and biases: the same function."""
        m = block.get_submodule(rel)
        gate, up, down = self.triple(m)
        g, d = _multiplier(m, "gate_multiplier"), _multiplier(m, "down_multiplier")
        return FFNWeights(up=up.weight.detach(), down=_scaled(down.weight.detach(), d), act=act,
                          gate=_scaled(gate.weight.detach(), g), up_bias=_bias(up),
                          gate_bias=_scaled(_bias(gate), g), down_bias=_scaled(_bias(down), d))


class FusedGatedMLP(_PairAdapter):
    """One projection to [gate; up] (2I rows, the activation on the first half), then down: Phi-3's and GLM's
    gate_up_proj/down_proj, ModernBERT's Wi/Wo."""

    name = "fused_gated_mlp"
    families = "fused gated MLP with gate_up_proj/down_proj or Wi/Wo (Phi-3, GLM, GLM-4, ModernBERT)"
    PAIRS = (("gate_up_proj", "down_proj"), ("Wi", "Wo"))

    def read(self, block, rel, act):
        fused, down = self.pair(block.get_submodule(rel))
        w, b = fused.weight.detach(), _bias(fused)
        n = w.shape[0] // 2
        return FFNWeights(up=w[n:], down=down.weight.detach(), act=act, gate=w[:n],
                          up_bias=None if b is None else b[n:], gate_bias=None if b is None else b[:n],
                          down_bias=_bias(down))


class FusedGatedFC(_ChildAdapter):
    """fc1 to 2I rows that hold the gate and the up projection, then fc2 (I -> H): Moshi (gate first) and Moonshine's
    decoder (up first). The names do not say which half is the gate; `read` tells it from what the module computes on
    a probe (on the meta device, where only shapes matter, gate first)."""

    name = "fused_gated_fc"
    families = "fc1 (gate and up) / fc2 gated MLP (Moshi, Moonshine's decoder)"

    def is_ffn(self, m):
        return _linears(m, "fc1", "fc2") and m.fc1.out_features == 2 * m.fc2.in_features

    def read(self, block, rel, act):
        m = block.get_submodule(rel)
        w, b, n = m.fc1.weight.detach(), _bias(m.fc1), m.fc2.in_features

        def halves(gate_first: bool) -> FFNWeights:
            gate, up = (slice(0, n), slice(n, None)) if gate_first else (slice(n, None), slice(0, n))
            return FFNWeights(up=w[up], down=m.fc2.weight.detach(), act=act, gate=w[gate],
                              up_bias=None if b is None else b[up], gate_bias=None if b is None else b[gate],
                              down_bias=_bias(m.fc2))

        if w.is_meta:
            return halves(True)
        x = probe(m.fc1.in_features, w)
        with torch.no_grad():
            want = m(x[None])[0]
            return min((halves(True), halves(False)), key=lambda f: (f(x) - want).double().norm().item())


class LinearMLP(_PairAdapter):
    """A non-gated MLP of two nn.Linear: up (H -> I), the activation, down (I -> H). wav2vec 2.0's feed_forward
    (and its kin's) applies dropout to the activations (`activation_dropout`), which the experts do not: the same
    function in eval mode, less regularization in training."""

    name = "linear_mlp"
    families = ("non-gated MLP with c_fc/c_proj, dense_h_to_4h/dense_4h_to_h, fc_in/fc_out, up_proj/down_proj, "
                "intermediate_dense/output_dense, linear1/linear2 or wi/wo linears (StarCoder2, GPT-BigCode, GPT-Neo, "
                "GPT-NeoX/Pythia, Falcon, GPT-J, CodeGen, Persimmon, Nemotron, Arcee, Jais2, BLOOM, MPT; wav2vec 2.0, "
                "HuBERT, WavLM, SpeechT5; Parakeet's and LASR's Conformer FFNs; T5, Pop2Piano)")
    PAIRS = (("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("fc_in", "fc_out"), ("up_proj", "down_proj"),
             ("intermediate_dense", "output_dense"), ("linear1", "linear2"), ("wi", "wo"))

    def read(self, block, rel, act):
        up, down = self.pair(block.get_submodule(rel))
        return FFNWeights(up=up.weight.detach(), down=down.weight.detach(), act=act, up_bias=_bias(up),
                          down_bias=_bias(down))


class Conv1DMLP(_ChildAdapter):
    name = "conv1d_mlp"
    families = "GPT-2 style c_fc/c_proj Conv1D MLP"

    def is_ffn(self, m):
        return isinstance(getattr(m, "c_fc", None), Conv1D) and isinstance(getattr(m, "c_proj", None), Conv1D)

    def read(self, block, rel, act):
        m = block.get_submodule(rel)  # Conv1D weight is (in, out): transpose to Linear convention
        return FFNWeights(up=m.c_fc.weight.detach().T, down=m.c_proj.weight.detach().T, act=act,
                          up_bias=_bias(m.c_fc), down_bias=_bias(m.c_proj))


class FCMLP(LinearMLP):
    name = "fc_mlp"
    families = "fc1/fc2 MLP module (CLIP, Phi, ...)"
    PAIRS = (("fc1", "fc2"),)

    def is_ffn(self, m):
        return super().is_ffn(m) and m.fc1.out_features == m.fc2.in_features


class InlineFC(Adapter):
    """fc1/fc2 directly on the block, `activation_fn` between them (Whisper, BART, OPT, ...).

    The MoE layer replaces fc1 and computes the whole FFN; activation_fn and fc2 become Identity.
    The block's activation dropout then acts on the MoE output (0 by default in Whisper)."""

    name = "inline_fc"
    families = "fc1/fc2 on the block (Whisper encoder and decoder, BART, ...)"

    def locate(self, block):
        return ["fc1"] if _linears(block, "fc1", "fc2") and hasattr(block, "activation_fn") else []

    def read(self, block, rel, act):
        return FFNWeights(up=block.fc1.weight.detach(), down=block.fc2.weight.detach(), act=act,
                          up_bias=_bias(block.fc1), down_bias=_bias(block.fc2))

    def install(self, block, rel, moe):
        block.fc1, block.fc2, block.activation_fn = moe, nn.Identity(), nn.Identity()

    def forward(self, block, rel, x):
        return block.fc2(block.activation_fn(block.fc1(x)))

    def activation(self, block, rel):
        return [block.activation_fn]


class BertFFN(Adapter):
    """BERT-style split FFN: intermediate.dense (+ act) then output.dense (+ dropout, residual, LN).

    The MoE layer replaces `intermediate` and output.dense becomes Identity, so BertOutput still
    applies dropout, the residual and LayerNorm to the MoE output."""

    name = "bert_ffn"
    families = "BERT-style intermediate/output encoder layers (BERT, RoBERTa, ...)"

    def locate(self, block):
        inter, out = getattr(block, "intermediate", None), getattr(block, "output", None)
        ok = inter is not None and out is not None and _linears(inter, "dense") and _linears(out, "dense")
        return ["intermediate"] if ok else []

    def read(self, block, rel, act):
        up, down = block.intermediate.dense, block.output.dense
        return FFNWeights(up=up.weight.detach(), down=down.weight.detach(), act=act,
                          up_bias=_bias(up), down_bias=_bias(down))

    def install(self, block, rel, moe):
        block.intermediate, block.output.dense = moe, nn.Identity()

    def forward(self, block, rel, x):
        return block.output.dense(block.intermediate(x))


# in order of precedence: a gated MLP's up_proj/down_proj must not be read as a non-gated one
ADAPTERS: list[Adapter] = [GatedMLP(), FusedGatedMLP(), Conv1DMLP(), LinearMLP(), BertFFN(), InlineFC(),
                           FusedGatedFC(), FCMLP()]
ADAPTERS_BY_NAME = {a.name: a for a in ADAPTERS}


def supported_families() -> str:
    return "; ".join(a.families for a in ADAPTERS)
