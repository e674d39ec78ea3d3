"""Quantized checkpoints of tiny models, laid out as the Hub's (DeepSeek-V3's and Qwen3-FP8's block FP8,
llm-compressor's compressed-tensors FP8 and int8, GPT-OSS's MXFP4 experts), each with the float checkpoint of exactly
the values it encodes: the oracle moekit's reading of quantized checkpoints is tested against."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

# what these checkpoints quantize: the weights of linear projections and experts (not embeddings, norms, routers or
# the output head), by their stored names
QUANTIZED = re.compile(r".*(proj|proj_with_mqa|\.w[123])\.weight$|.*\.experts\.(gate_up_proj|down_proj|up_proj)$")
QMAX = {torch.float8_e4m3fn: 448.0}  # the largest value of each 8-bit float type


def _blocks(w: Tensor, block: tuple[int, int] | None) -> Tensor:
    """The values of each block of `w` (..., O, I): (..., ⌈O/bo⌉, ⌈I/bi⌉, bo·bi), a partial block padded with 0;
    (1, O·I) where `block` is None."""
    if block is None:
        return w.reshape(1, -1)
    rows, cols = w.shape[-2:]
    padded = torch.zeros(*w.shape[:-2], -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1])
    padded[..., :rows, :cols] = w
    return padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0])).transpose(-3, -2).flatten(-2)


def block_scales(w: Tensor, block: tuple[int, int] | None, scale_dtype: torch.dtype, qmax: float = 448.0) -> Tensor:
    """Scales (..., ⌈O/bo⌉, ⌈I/bi⌉) (one per tensor where `block` is None) that map each block's largest |w| to
    `qmax`, rounded to `scale_dtype` (UE8M0: float8_e8m0fnu or its bytes, uint8, rounded up to a power of two)."""
    s = _blocks(w.abs(), block).amax(-1).clamp(min=1e-8) / qmax
    if scale_dtype in (torch.uint8, torch.float8_e8m0fnu):
        exponent = torch.ceil(torch.log2(s)) + 127
        return exponent.to(torch.uint8) if scale_dtype == torch.uint8 else exponent.to(torch.uint8).view(scale_dtype)
    return s.to(scale_dtype)


def reference_values(q: Tensor, s: Tensor, block: tuple[int, int] | None, z: Tensor | None = None) -> Tensor:
    """W[..., o, i] = (q[..., o, i] - z[..., o // bo, i // bi]) · s[..., o // bo, i // bi] in float32 (z: 0 where None),
    by index arithmetic (written apart from moekit.checkpoint.quantized.dequantize, which it checks)."""
    scale = torch.exp2(s.view(torch.uint8).float() - 127) if s.dtype in (torch.uint8, torch.float8_e8m0fnu) \
        else s.float()
    zero = torch.zeros_like(scale) if z is None else z.float()
    if block is None:
        return (q.float() - zero.reshape(())) * scale.reshape(())
    rows, cols = q.shape[-2:]
    r = (torch.arange(rows) // block[0])[:, None]
    c = (torch.arange(cols) // block[1])[None, :]
    return (q.float() - zero[..., r, c]) * scale[..., r, c]


def _resolved(block: tuple[int | None, int | None] | None, shape: torch.Size) -> tuple[int, int] | None:
    return None if block is None else (block[0] or shape[-2], block[1] or shape[-1])


def quantize(w: Tensor, block: tuple[int | None, int | None] | None, scale_dtype: torch.dtype,
             qdtype: torch.dtype, bits: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    """(values in `qdtype`, scales, the float32 weight they encode) of `w` (..., O, I); a None entry of `block` is the
    whole dimension; integers of `bits` bits (stored in int8) span ±(2^(bits-1) - 1)."""
    resolved = _resolved(block, w.shape)
    qmax = QMAX[qdtype] if qdtype.is_floating_point else 2.0 ** (bits - 1) - 1
    s = block_scales(w.float(), resolved, scale_dtype, qmax)
    x = (w.float() / reference_values(torch.ones(w.shape), s, resolved)).clamp(-qmax, qmax)
    q = x.to(qdtype) if qdtype.is_floating_point else x.round().to(qdtype)
    return q, s, reference_values(q, s, resolved)  # float32: q · s is exact there, not in bf16


def quantize_asymmetric(w: Tensor, block: tuple[int | None, int | None] | None, scale_dtype: torch.dtype,
                        bits: int = 8) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(int8 values, scales, int8 zero points, the float32 weight (q - z) · s) of `w` (..., O, I): each block's range
    [min, max] (0 included) mapped onto the `bits`-bit integers [-2^(bits-1), 2^(bits-1) - 1]."""
    resolved = _resolved(block, w.shape)
    lo_q, hi_q = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    values = _blocks(w.float(), resolved)
    lo, hi = values.amin(-1).clamp(max=0), values.amax(-1).clamp(min=0)
    s = ((hi - lo).clamp(min=1e-8) / (hi_q - lo_q)).to(scale_dtype)
    z = (lo_q - lo / s.float()).round().clamp(lo_q, hi_q).to(torch.int8)
    x = w.float() / reference_values(torch.ones(w.shape), s, resolved) + reference_values(torch.ones(w.shape),
                                                                                          z.float(), resolved)
    q = x.round().clamp(lo_q, hi_q).to(torch.int8)
    return q, s, z, reference_values(q, s, resolved, z)


def _save_scaled(model: nn.Module, folder: Path, float_folder: Path, fused: bool,
                 quantize_one: Callable[[Tensor], tuple[dict[str, Tensor], Tensor]], quantization_config: dict) -> Path:
    """`quantize_one(w)`: ({suffix: what W + suffix stores (the values under "", or packed), its scales, zero points,
    ...}, the float32 weight they encode)."""
    model.save_pretrained(folder)
    stored = model.state_dict() if fused else load_file(folder / "model.safetensors")
    quantized, values = {}, {}
    for name, w in stored.items():
        w = w.detach().contiguous()
        if QUANTIZED.fullmatch(name) and w.dim() >= 2:
            stored_as, values[name] = quantize_one(w)
            quantized |= {name + suffix: t for suffix, t in stored_as.items()}
        else:
            quantized[name] = values[name] = w
    if fused:  # only the model's own names: tied tensors once, as save_pretrained keeps them
        kept = set(load_file(folder / "model.safetensors"))
        for k in [k for k in values if k not in kept and ".experts." not in k]:
            values.pop(k)
            quantized = {n: t for n, t in quantized.items() if not n.startswith(k)}
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.save_pretrained(float_folder)
    save_file(values, float_folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def save_fp8(model: nn.Module, folder: str | Path, float_folder: str | Path, block: tuple[int, int] | None = (16, 16),
             scale_dtype: torch.dtype = torch.float32, fused: bool = False) -> Path:
    """Save `model` as an FP8 checkpoint in `folder` (its projections and experts F8_E4M3 with `*_scale_inv` scales,
    config.json's quantization_config quant_method fp8) and, in `float_folder`, the float checkpoint of the values it
    encodes (the same names, the quantized ones in float32, no quantization_config). `fused`: the experts stored as
    the model holds them (transformers 5's fused (E, ...) tensors) rather than one tensor per expert as transformers
    saves them."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              **({"weight_block_size": list(block)} if block else {})}

    def one(w: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        q, s, values = quantize(w, block, scale_dtype, torch.float8_e4m3fn)
        return {"": q, "_scale_inv": s}, values

    return _save_scaled(model, Path(folder), Path(float_folder), fused, one, config)


STRATEGIES = {"tensor": None, "channel": (1, None), "group": (1, 16), "block": (16, 16)}  # compressed-tensors' scales


def save_compressed(model: nn.Module, folder: str | Path, float_folder: str | Path, strategy: str = "channel",
                    kind: str = "float", scale_dtype: torch.dtype = torch.bfloat16, symmetric: bool = True,
                    packed: int | None = None, fused: bool = False) -> Path:
    """Save `model` as llm-compressor saves an FP8-dynamic (`kind` float) or W8A8 (int) checkpoint: each projection's
    weight F8_E4M3 or I8 beside `*_scale` (`strategy`: one per tensor, row, 16 columns of a row or 16×16 block) and,
    int without `symmetric`, `*_zero_point`; quantization_config quant_method compressed-tensors. `packed` bits: as
    it saves W4A16 (pack-quantized): the integers packed into int32 `*_packed` beside `*_shape` (and zero points of
    rows or groups packed along the rows) by compressed-tensors' own pack_to_int32. `fused`: the experts stored as the
    model holds them. In `float_folder`: the float checkpoint of its values."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    block = STRATEGIES[strategy]
    bits = packed or 8
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": symmetric, "dynamic": False,
               "group_size": 16 if strategy == "group" else None, "actorder": None,
               "block_structure": list(block) if strategy == "block" else None}
    activations = None if packed else {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True,
                                       "symmetric": True}
    config = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
              "format": "pack-quantized" if packed else {"float": "float-quantized", "int": "naive-quantized"}[kind],
              "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                   "input_activations": activations}}}
    qdtype = {"float": torch.float8_e4m3fn, "int": torch.int8}[kind]

    def one(w: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        if symmetric:
            (q, s, values), z = quantize(w, block, scale_dtype, qdtype, bits), None
        else:
            q, s, z, values = quantize_asymmetric(w, block, scale_dtype, bits)
        if not packed:
            return {"": q, "_scale": s, **({} if z is None else {"_zero_point": z})}, values
        out = {"_packed": pack_to_int32(q, bits), "_shape": torch.tensor(q.shape), "_scale": s}
        if z is not None:  # rows and groups: packed along the rows, as compressed-tensors stores them
            out["_zero_point"] = pack_to_int32(z, bits, packed_dim=0) if strategy in ("channel", "group") else z
        return out, values

    return _save_scaled(model, Path(folder), Path(float_folder), fused, one, config)

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
PACKED_EXPERTS = re.compile(r".*\.experts\.(gate_up_proj|down_proj)$")  # what GPT-OSS ships in MXFP4


def mxfp4_pack(w: Tensor) -> tuple[Tensor, Tensor]:
    """(blocks (..., O, I/32, 16), scales (..., O, I/32)) of a weight (..., I, O): each 32 values of a column share the
    power of two 2^e that brings their largest |value| to at most 6, each value the nearest FP4 value of w / 2^e."""
    groups = w.float().transpose(-1, -2).unflatten(-1, (-1, 32))  # (..., O, G, 32)
    e = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6))  # (..., O, G)
    nibble = ((groups / torch.exp2(e)[..., None])[..., None] - FP4).abs().argmin(-1)  # (..., O, G, 32)
    blocks = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return blocks, (e + 127).to(torch.uint8)


def mxfp4_values(blocks: Tensor, scales: Tensor) -> Tensor:
    """The weight (..., I, O) that MXFP4 blocks and scales encode, value by value (written apart from
    moekit.checkpoint.quantized.unpack_mxfp4, which it checks)."""
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, rows, groups * 32)
    for j in range(groups * 32):
        byte = blocks[..., j // 32, (j % 32) // 2].long()
        nibble = byte & 0x0F if j % 2 == 0 else byte >> 4
        out[..., j] = FP4[nibble] * torch.exp2(scales[..., j // 32].float() - 127)
    return out.transpose(-1, -2)


def save_mxfp4(model: nn.Module, folder: str | Path, float_folder: str | Path) -> Path:
    """Save `model` (GPT-OSS) with its experts in MXFP4 in `folder`, as GPT-OSS's checkpoints are (`X_blocks`,
    `X_scales`; config.json's quantization_config quant_method mxfp4), and in `float_folder` the float checkpoint of
    the values it encodes."""
    folder, float_folder = Path(folder), Path(float_folder)
    model.save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    packed, values = {}, {}
    for name, w in stored.items():
        if PACKED_EXPERTS.fullmatch(name):
            blocks, scales = mxfp4_pack(w)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            values[name] = mxfp4_values(blocks, scales).contiguous()
        else:
            packed[name] = values[name] = w
    save_file(packed, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.save_pretrained(float_folder)
    save_file(values, float_folder / "model.safetensors", metadata={"format": "pt"})
    return folder
