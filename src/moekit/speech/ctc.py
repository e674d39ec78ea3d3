"""A Transformer-encoder CTC ASR model (Omni-router, Gu et al. 2025, §5.2, in miniature).

Input: 80-dim log-mel frames stacked ×4 (320 dims, 40 ms per step, §5.3; `moekit.speech.features`).
A linear projection, sinusoidal positions, N pre-LayerNorm blocks (self-attention, then an explicit
`mlp` with fc1/fc2 that MoE surgery replaces), a final LayerNorm and a linear CTC head over
characters (blank = 0). Trainable from scratch as dense, Switch (one router per MoE layer) or
Omni-router (`router_sharing: all`). A transformers `PreTrainedModel`, so Trainer, save_pretrained
and moekit's checkpoint format work unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutput


class CTCConfig(PretrainedConfig):
    model_type = "moekit_ctc"

    def __init__(self, input_dim: int = 320, hidden_size: int = 256, num_hidden_layers: int = 6,
                 num_attention_heads: int = 4, intermediate_size: int = 1024, hidden_act: str = "gelu",
                 dropout: float = 0.1, layer_norm_eps: float = 1e-5, vocab_size: int = 32, blank_id: int = 0,
                 initializer_range: float = 0.02, **kwargs):
        super().__init__(**kwargs)
        self.input_dim, self.hidden_size, self.num_hidden_layers = input_dim, hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size, self.hidden_act = num_attention_heads, intermediate_size, hidden_act
        self.dropout, self.layer_norm_eps, self.vocab_size, self.blank_id = dropout, layer_norm_eps, vocab_size, blank_id
        self.initializer_range = initializer_range


class CTCMLP(nn.Module):
    """The dense FFN: fc2(act(fc1(x))) — the slot MoE surgery replaces (adapter `fc_mlp`)."""

    def __init__(self, cfg: CTCConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CTCAttention(nn.Module):
    def __init__(self, cfg: CTCConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of {cfg.num_attention_heads} heads")
        self.heads, self.p = cfg.num_attention_heads, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        B, T, H = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)  # 3 × (B, h, T, d)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :],  # (B, 1, 1, T) keys
                                           dropout_p=self.p if self.training else 0.0)  # (B, h, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, H))


class CTCBlock(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)) (pre-LN Transformer block)."""

    def __init__(self, cfg: CTCConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CTCAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CTCMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        x = x + self.drop(self.self_attn(self.attn_norm(x), keep))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


def sinusoids(length: int, dim: int) -> Tensor:
    """(length, dim) sinusoidal positions (Vaswani et al. 2017, §3.5)."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]  # (T, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))  # (dim/2,)
    out = torch.zeros(length, dim)
    out[:, 0::2], out[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return out


class CTCEncoderForASR(PreTrainedModel):
    config_class = CTCConfig
    base_model_prefix = "encoder"
    main_input_name = "input_features"
    _supports_sdpa = True

    def __init__(self, config: CTCConfig):
        super().__init__(config)
        self.proj = nn.Linear(config.input_dim, config.hidden_size)
        self.layers = nn.ModuleList(CTCBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.drop = nn.Dropout(config.dropout)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_features: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                **kwargs) -> CausalLMOutput:
        """input_features (B, T, input_dim); attention_mask (B, T), 1 = frame; labels (B, L), -100 = padding.
        Returns CTC log-probs as `logits` (B, T, V) and, with labels, the CTC loss (mean over utterances of
        the per-utterance loss divided by its target length, as torch's reduction="mean")."""
        B, T, _ = input_features.shape
        keep = (torch.ones(B, T, dtype=torch.bool, device=input_features.device) if attention_mask is None
                else attention_mask.bool())  # (B, T)
        x = self.proj(input_features) + sinusoids(T, self.config.hidden_size).to(input_features)  # (B, T, H)
        x = self.drop(x)
        for layer in self.layers:
            x = layer(x, keep)
        logp = self.head(self.norm(x)).float().log_softmax(-1)  # (B, T, V)
        loss = None if labels is None else ctc_loss(logp, keep.sum(-1), labels, self.config.blank_id)
        return CausalLMOutput(loss=loss, logits=logp)


def ctc_loss(logp: Tensor, frames: Tensor, labels: Tensor, blank: int) -> Tensor:
    """CTC (Graves et al. 2006) of log-probs (B, T, V) with `frames` (B,) valid steps and labels (B, L)
    padded with -100; utterances whose target cannot fit are zeroed (zero_infinity)."""
    valid = labels != -100  # (B, L)
    targets = labels[valid]  # (ΣL,) concatenated targets
    return F.ctc_loss(logp.transpose(0, 1), targets, frames, valid.sum(-1), blank=blank, reduction="mean",
                      zero_infinity=True)


AutoConfig.register(CTCConfig.model_type, CTCConfig)
