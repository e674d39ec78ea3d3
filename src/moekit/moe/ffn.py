"""Plain tensors of a dense FFN and of stacked experts: the only thing init methods see.

All weights follow the torch.nn.Linear convention (weight: (out, in)). Surgery adapters translate
to and from HF modules (e.g. GPT-2's transposed Conv1D), so init methods never see module names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from transformers.activations import ACT2FN


@dataclass
class FFNWeights:
    """y = down(act(gate(x)) * up(x)) if gated else down(act(up(x)))."""

    up: Tensor  # (I, H)
    down: Tensor  # (H, I)
    act: str  # a transformers ACT2FN key, e.g. "silu", "gelu_new", "gelu_pytorch_tanh"
    gate: Tensor | None = None  # (I, H)
    up_bias: Tensor | None = None  # (I,)
    gate_bias: Tensor | None = None  # (I,)
    down_bias: Tensor | None = None  # (H,)

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def hidden_size(self) -> int:
        return self.up.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.up.shape[0]

    @property
    def has_bias(self) -> bool:
        return self.up_bias is not None or self.down_bias is not None

    def clone(self, **changes) -> FFNWeights:
        cloned = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return replace(self, **{**cloned, **changes})

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> FFNWeights:
        """A copy in `dtype` / on `device` (tensors already there are shared, not copied)."""
        return replace(self, **{k: v.to(dtype=dtype, device=device) for k, v in self.__dict__.items()
                                if isinstance(v, Tensor)})

    def shard(self, g: int, parts: int) -> FFNWeights:
        """Shard g of `parts` contiguous, equal shards of the intermediate dimension (granular upcycling, He et
        al. 2024): rows of gate and up (and their biases), columns of down; the down bias stays whole, for the
        caller to share out. The activation acts entry by entry, so the shards' outputs without down bias sum
        to the FFN's. `parts` = 1 gives the FFN itself."""
        if parts == 1:
            return self
        n = self.intermediate_size // parts
        rows = slice(g * n, (g + 1) * n)

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return replace(self, up=self.up[rows], down=self.down[:, rows], gate=pick(self.gate),
                       up_bias=pick(self.up_bias), gate_bias=pick(self.gate_bias))

    def math(self) -> FFNWeights:
        """For init math: float32 or wider (bf16/fp16 weights are upcast; float32/float64 kept)."""
        return self if self.up.dtype in (torch.float32, torch.float64) else self.to(torch.float32)

    def __call__(self, x: Tensor) -> Tensor:
        """Reference forward (used by tests and metrics)."""
        act = ACT2FN[self.act]
        h = act(torch.nn.functional.linear(x, self.gate, self.gate_bias)) if self.gated else None
        u = torch.nn.functional.linear(x, self.up, self.up_bias)
        h = h * u if h is not None else act(u)
        return torch.nn.functional.linear(h, self.down, self.down_bias)


@dataclass
class ExpertWeights:
    """What an init method returns for one MoE layer: E stacked routed experts (+ shared, router)."""

    up: Tensor  # (E, I, H)
    down: Tensor  # (E, H, I)
    act: str
    gate: Tensor | None = None  # (E, I, H)
    up_bias: Tensor | None = None  # (E, I)
    gate_bias: Tensor | None = None  # (E, I)
    down_bias: Tensor | None = None  # (E, H)
    shared: FFNWeights | None = None  # always-on expert (SPRI eq. 3), None if the spec has none
    router: Tensor | None = None  # (E, H); None -> the router is initialised from the spec

    @property
    def num_experts(self) -> int:
        return self.up.shape[0]

    @classmethod
    def stack(cls, experts: list[FFNWeights], **extra) -> ExpertWeights:
        """Stack per-expert FFNs (all of one shape) into (E, ...) tensors."""
        first = experts[0]

        def st(name: str) -> Tensor | None:
            return None if getattr(first, name) is None else torch.stack([getattr(e, name) for e in experts])

        fields = ("up", "down", "gate", "up_bias", "gate_bias", "down_bias")
        return cls(act=first.act, **{f: st(f) for f in fields}, **extra)

    def to(self, dtype: torch.dtype) -> ExpertWeights:
        out = replace(self, **{k: v.to(dtype) for k, v in self.__dict__.items() if isinstance(v, Tensor)})
        out.shared = None if self.shared is None else self.shared.to(dtype)
        return out

    def expert(self, i: int) -> FFNWeights:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[i]

        return FFNWeights(
            up=self.up[i], down=self.down[i], act=self.act, gate=pick(self.gate),
            up_bias=pick(self.up_bias), gate_bias=pick(self.gate_bias), down_bias=pick(self.down_bias),
        )
