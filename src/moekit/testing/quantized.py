"""Block-scaled FP8 checkpoints of tiny models, laid out as the Hub's FP8 checkpoints (DeepSeek-V3, Qwen3-FP8), each
with the float checkpoint of exactly the values it encodes: the oracle moekit's reading of FP8 is tested against."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

# what an FP8 checkpoint quantizes: the weights of linear projections and experts (not embeddings, norms, routers or
# the output head), by their stored names
QUANTIZED = re.compile(r".*(proj|proj_with_mqa|\.w[123])\.weight$|.*\.experts\.(gate_up_proj|down_proj|up_proj)$")
FP8_MAX = 448.0  # the largest float8_e4m3fn


def block_scales(w: Tensor, block: tuple[int, int] | None, scale_dtype: torch.dtype) -> Tensor:
    """Scales (..., ⌈O/bo⌉, ⌈I/bi⌉) (one per tensor where `block` is None) that map each block's largest |w| to
    FP8_MAX, rounded to `scale_dtype` (UE8M0: float8_e8m0fnu or its bytes, uint8, rounded up to a power of two)."""
    if block is None:
        amax = w.abs().amax().reshape(1)
    else:
        rows, cols = w.shape[-2:]
        padded = torch.zeros(*w.shape[:-2], -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1])
        padded[..., :rows, :cols] = w.abs()
        amax = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0])).amax(dim=(-3, -1))
    s = amax.clamp(min=1e-8) / FP8_MAX
    if scale_dtype in (torch.uint8, torch.float8_e8m0fnu):
        exponent = torch.ceil(torch.log2(s)) + 127
        return exponent.to(torch.uint8) if scale_dtype == torch.uint8 else exponent.to(torch.uint8).view(scale_dtype)
    return s.to(scale_dtype)


def reference_values(q: Tensor, s: Tensor, block: tuple[int, int] | None) -> Tensor:
    """W[..., o, i] = q[..., o, i] · s[..., o // bo, i // bi] in float32, by index arithmetic (written apart from
    moekit.checkpoint.quantized.dequantize, which it checks)."""
    scale = torch.exp2(s.view(torch.uint8).float() - 127) if s.dtype in (torch.uint8, torch.float8_e8m0fnu) \
        else s.float()
    if block is None:
        return q.float() * scale.reshape(())
    rows, cols = q.shape[-2:]
    r = torch.arange(rows) // block[0]
    c = torch.arange(cols) // block[1]
    return q.float() * scale[..., r[:, None], c[None, :]]


def save_fp8(model: nn.Module, folder: str | Path, float_folder: str | Path, block: tuple[int, int] | None = (16, 16),
             scale_dtype: torch.dtype = torch.float32, fused: bool = False) -> Path:
    """Save `model` as an FP8 checkpoint in `folder` (its projections and experts F8_E4M3 with `*_scale_inv` scales,
    config.json's quantization_config quant_method fp8) and, in `float_folder`, the float checkpoint of the values it
    encodes (the same names, the quantized ones in float32, no quantization_config). `fused`: the experts stored as
    the model holds them (transformers 5's fused (E, ...) tensors) rather than one tensor per expert as transformers
    saves them."""
    folder, float_folder = Path(folder), Path(float_folder)
    model.save_pretrained(folder)
    stored = model.state_dict() if fused else load_file(folder / "model.safetensors")
    quantized, values = {}, {}
    for name, w in stored.items():
        w = w.detach().contiguous()
        if QUANTIZED.fullmatch(name) and w.dim() >= 2:
            s = block_scales(w.float(), block, scale_dtype)
            expand = reference_values(torch.ones_like(w, dtype=torch.float8_e4m3fn), s, block)  # each value's scale
            q = (w.float() / expand).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            values[name] = reference_values(q, s, block)  # float32: q · s is exact there, not in bf16
        else:
            quantized[name] = values[name] = w
    if fused:  # only the model's own names: tied tensors once, as save_pretrained keeps them
        kept = set(load_file(folder / "model.safetensors"))
        drop = [k for k in values if k not in kept and ".experts." not in k]
        for k in drop:
            values.pop(k), quantized.pop(k)
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": list(block)} if block else {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.save_pretrained(float_folder)
    save_file(values, float_folder / "model.safetensors", metadata={"format": "pt"})
    return folder
