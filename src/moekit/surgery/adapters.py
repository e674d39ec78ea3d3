"""Surgery adapters: where a block's FFN lives, how to read it as FFNWeights, how to install an MoE.

Adapters match by structure (module attributes), not by the model's class, so a known decoder
embedded in a larger model (speech-LLMs, vision-language models) is found too.
"""
from __future__ import annotations

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from moekit.moe.ffn import FFNWeights
from moekit.moe.layer import MoELayer


def _bias(lin: nn.Module):
    return None if getattr(lin, "bias", None) is None else lin.bias.detach()


def _linears(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) for n in names)


class Adapter:
    name: str
    families: str  # for messages

    def locate(self, block: nn.Module) -> str | None:
        """Relative path of the FFN inside `block` (where the MoE layer will live), or None."""
        raise NotImplementedError

    def read(self, block: nn.Module, act: str) -> FFNWeights:
        raise NotImplementedError

    def install(self, block: nn.Module, moe: MoELayer) -> None:
        raise NotImplementedError

    def forward(self, block: nn.Module, x: Tensor) -> Tensor:
        """The block's own FFN on x: what the modules `install` replaces compute (surgery.locate.read_checked)."""
        raise NotImplementedError

    def dropout(self, block: nn.Module) -> float:
        return 0.0


class _ChildAdapter(Adapter):
    """The FFN is one child module of the block, replaced whole by the MoE layer."""

    def child(self, block: nn.Module) -> tuple[str, nn.Module] | None:
        for name, m in block.named_children():
            if self.is_ffn(m):
                return name, m
        return None

    def is_ffn(self, m: nn.Module) -> bool:
        raise NotImplementedError

    def locate(self, block):
        found = self.child(block)
        return None if found is None else found[0]

    def install(self, block, moe):
        setattr(block, self.child(block)[0], moe)

    def forward(self, block, x):
        return self.child(block)[1](x)

    def dropout(self, block):  # on the FFN's output (GPT-2's MLP.dropout)
        d = getattr(self.child(block)[1], "dropout", None)
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
    families = "gated MLP with gate_proj/up_proj/down_proj (Llama, Mistral, Qwen2, Qwen3, Gemma3, ...)"

    def is_ffn(self, m):
        return _linears(m, "gate_proj", "up_proj", "down_proj")

    def read(self, block, act):
        m = self.child(block)[1]
        return FFNWeights(up=m.up_proj.weight.detach(), down=m.down_proj.weight.detach(), act=act,
                          gate=m.gate_proj.weight.detach(), up_bias=_bias(m.up_proj),
                          gate_bias=_bias(m.gate_proj), down_bias=_bias(m.down_proj))


class FusedGatedMLP(_PairAdapter):
    """One projection to [gate; up] (2I rows, the activation on the first half), then down: Phi-3's and GLM's
    gate_up_proj/down_proj, ModernBERT's Wi/Wo."""

    name = "fused_gated_mlp"
    families = "fused gated MLP with gate_up_proj/down_proj or Wi/Wo (Phi-3, GLM, GLM-4, ModernBERT)"
    PAIRS = (("gate_up_proj", "down_proj"), ("Wi", "Wo"))

    def read(self, block, act):
        fused, down = self.pair(self.child(block)[1])
        w, b = fused.weight.detach(), _bias(fused)
        n = w.shape[0] // 2
        return FFNWeights(up=w[n:], down=down.weight.detach(), act=act, gate=w[:n],
                          up_bias=None if b is None else b[n:], gate_bias=None if b is None else b[:n],
                          down_bias=_bias(down))


class LinearMLP(_PairAdapter):
    """A non-gated MLP of two nn.Linear: up (H -> I), the activation, down (I -> H)."""

    name = "linear_mlp"
    families = ("non-gated MLP with c_fc/c_proj, dense_h_to_4h/dense_4h_to_h, fc_in/fc_out or up_proj/down_proj "
                "linears (StarCoder2, GPT-BigCode, GPT-Neo, GPT-NeoX/Pythia, Falcon, GPT-J, CodeGen, Persimmon, "
                "Nemotron, Arcee, Jais2)")
    PAIRS = (("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("fc_in", "fc_out"), ("up_proj", "down_proj"))

    def read(self, block, act):
        up, down = self.pair(self.child(block)[1])
        return FFNWeights(up=up.weight.detach(), down=down.weight.detach(), act=act, up_bias=_bias(up),
                          down_bias=_bias(down))


class Conv1DMLP(_ChildAdapter):
    name = "conv1d_mlp"
    families = "GPT-2 style c_fc/c_proj Conv1D MLP"

    def is_ffn(self, m):
        return isinstance(getattr(m, "c_fc", None), Conv1D) and isinstance(getattr(m, "c_proj", None), Conv1D)

    def read(self, block, act):
        m = self.child(block)[1]  # Conv1D weight is (in, out): transpose to Linear convention
        return FFNWeights(up=m.c_fc.weight.detach().T, down=m.c_proj.weight.detach().T, act=act,
                          up_bias=_bias(m.c_fc), down_bias=_bias(m.c_proj))


class FCMLP(LinearMLP):
    name = "fc_mlp"
    families = "fc1/fc2 MLP module (CLIP, Phi, ...)"
    PAIRS = (("fc1", "fc2"),)


class InlineFC(Adapter):
    """fc1/fc2 directly on the block, `activation_fn` between them (Whisper, BART, OPT, ...).

    The MoE layer replaces fc1 and computes the whole FFN; activation_fn and fc2 become Identity.
    The block's activation dropout then acts on the MoE output (0 by default in Whisper)."""

    name = "inline_fc"
    families = "fc1/fc2 on the block (Whisper encoder and decoder, BART, ...)"

    def locate(self, block):
        return "fc1" if _linears(block, "fc1", "fc2") and hasattr(block, "activation_fn") else None

    def read(self, block, act):
        return FFNWeights(up=block.fc1.weight.detach(), down=block.fc2.weight.detach(), act=act,
                          up_bias=_bias(block.fc1), down_bias=_bias(block.fc2))

    def install(self, block, moe):
        block.fc1, block.fc2, block.activation_fn = moe, nn.Identity(), nn.Identity()

    def forward(self, block, x):
        return block.fc2(block.activation_fn(block.fc1(x)))


class BertFFN(Adapter):
    """BERT-style split FFN: intermediate.dense (+ act) then output.dense (+ dropout, residual, LN).

    The MoE layer replaces `intermediate` and output.dense becomes Identity, so BertOutput still
    applies dropout, the residual and LayerNorm to the MoE output."""

    name = "bert_ffn"
    families = "BERT-style intermediate/output encoder layers (BERT, RoBERTa, ...)"

    def locate(self, block):
        inter, out = getattr(block, "intermediate", None), getattr(block, "output", None)
        ok = inter is not None and out is not None and _linears(inter, "dense") and _linears(out, "dense")
        return "intermediate" if ok else None

    def read(self, block, act):
        up, down = block.intermediate.dense, block.output.dense
        return FFNWeights(up=up.weight.detach(), down=down.weight.detach(), act=act,
                          up_bias=_bias(up), down_bias=_bias(down))

    def install(self, block, moe):
        block.intermediate, block.output.dense = moe, nn.Identity()

    def forward(self, block, x):
        return block.output.dense(block.intermediate(x))


# in order of precedence: a gated MLP's up_proj/down_proj must not be read as a non-gated one
ADAPTERS: list[Adapter] = [GatedMLP(), FusedGatedMLP(), Conv1DMLP(), LinearMLP(), BertFFN(), InlineFC(), FCMLP()]
ADAPTERS_BY_NAME = {a.name: a for a in ADAPTERS}


def supported_families() -> str:
    return "; ".join(a.families for a in ADAPTERS)
