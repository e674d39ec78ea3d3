"""Quantized checkpoints read as the float model they encode: block-scaled FP8 (config.json's `quantization_config`
with `quant_method: fp8`, as DeepSeek-V3/R1, Kimi-K2, Qwen3's -FP8 models and MiniMax-M2 ship their weights),
compressed-tensors' integer and FP8 formats (llm-compressor's FP8-dynamic, W8A8 and W4A16, and Kimi-K2-Thinking's
INT4 experts: `compressed_tensors`, `unpack_ints`) and MXFP4 experts (`quant_method: mxfp4`, GPT-OSS's: `Mxfp4`).

A quantized weight W (F8_E4M3 or F8_E5M2, shape (..., O, I)) is stored beside `W_scale_inv`, one scale per block of
`weight_block_size` [bo, bi] (DeepSeek-V3's 128 × 128): shape (..., ⌈O/bo⌉, ⌈I/bi⌉), or one scale for the whole
tensor where the config gives no block size. Its value is

    W[..., o, i] = q[..., o, i] · s[..., ⌊o/bo⌋, ⌊i/bi⌋]     (in float32; DeepSeek-V3's weight_dequant)

so the last block of a dimension that is not a multiple of the block is a partial one. Scales are float32, bf16 or
fp16, or UE8M0 powers of two (F8_E8M0, or bytes b meaning 2^(b-127)). Everything else of the checkpoint (embeddings,
norms, routers, the output head) is stored unquantized.

transformers 5.23 dequantizes such a checkpoint on a machine without a GPU with a block size it derives from the
scale grid (rows ÷ scale rows): where a dimension is not a multiple of the block (DeepSeek-V3's kv_a_proj_with_mqa, 576
rows in 5 blocks of 128) that raises, or, where the division happens to come out even, uses the wrong blocks
(tests/test_quantized.py shows it). moekit therefore reads every FP8 checkpoint through its own reader
(moekit.checkpoint.files.ShardReader; `quantization` there reads config.json), streamed and in memory alike, and
the others too. Checkpoints quantized any other way (bitsandbytes, GPTQ, AWQ, NVFP4, compressed-tensors' 3-bit, ...)
are refused in one line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from moekit.errors import CheckpointError

SCALE = "_scale_inv"  # W's scales are stored as W + SCALE
# static activation and KV-cache scales: for 8-bit compute, not for the weights
IGNORED = (".activation_scale", ".input_scale", ".k_scale", ".v_scale")
WEIGHT_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")
ZERO_DTYPES = ("I8", "I32", "I64", "F32", "BF16", "F16")


@dataclass(frozen=True)
class Scaled:
    """8-bit weights beside their scales: block-scaled FP8 (`W_scale_inv`, module docstring) or compressed-tensors'
    float- and naive-quantized formats (`W_scale`, and for int8 optional zero points `W_zero_point`:
    `compressed_tensors`). `block` is a scale's (rows, columns), a None entry meaning the whole dimension (per-channel
    scales: (1, None)); None for one scale per tensor. `bits`: compressed-tensors' pack-quantized format, whose
    weight W is stored as int32 words `W_packed` (..., O, ⌈I·bits/32⌉) beside its shape `W_shape` (`unpack_ints`),
    and whose zero points of scales per row or group are packed so along O (..., ⌈O·bits/32⌉, G)."""

    block: tuple[int | None, int | None] | None
    suffix: str = SCALE
    label: str = "FP8 weights"
    weights: tuple[str, ...] = WEIGHT_DTYPES  # the dtypes a scaled weight may be stored in (packed: its values)
    zero: str | None = None  # W's zero points, where its format has them: W = (q - z) · s
    bits: int | None = None  # packed: bits per value, 32/bits values a word

    @property
    def packed_zero(self) -> bool:
        """Whether the zero points are packed along O (scales per row or per group of a row, as compressed-tensors
        packs them)."""
        return self.bits is not None and self.block is not None and self.block[0] == 1

    def __str__(self) -> str:
        b = self.block
        blocks = "one scale per tensor" if b is None else "one scale per row" if b == (1, None) else \
            f"one scale per {b[1]} columns of a row" if b[0] == 1 else f"blocks of {b[0]}×{b[1]}"
        return f"{self.label} ({blocks}), read dequantized"

    @property
    def suffixes(self) -> tuple[str, ...]:
        """What a weight's scales (and zero points) are stored as: W + each suffix."""
        return (self.suffix, self.zero) if self.zero else (self.suffix,)

    def resolve(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """The block of a weight of `shape` (..., O, I), its None entries made the whole dimension."""
        if self.block is None:
            return None
        return self.block[0] or shape[-2], self.block[1] or shape[-1]

    def grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the scales of a weight of `shape`."""
        block = self.resolve(shape)
        if block is None:
            return ()
        *lead, rows, cols = shape
        return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))

    def zero_grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the zero points of a weight of `shape` as stored (packed along O where `packed_zero`)."""
        grid = self.grid(shape)
        return (*grid[:-2], math.ceil(grid[-2] * self.bits / 32), grid[-1]) if self.packed_zero else grid


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 experts (config.json `quant_method: mxfp4`, as GPT-OSS ships them): a weight X of (..., I, O) is stored
    transposed as `X_blocks` (..., O, I/32, 16), two FP4 (E2M1) values a byte, low nibble first, and `X_scales`
    (..., O, I/32), one UE8M0 byte b per 32 values meaning 2^(b-127)."""

    def __str__(self) -> str:
        return "MXFP4 experts (32 FP4 values per power-of-two scale), read dequantized"


PACKED = ("_blocks", "_scales")  # MXFP4's two tensors of a weight X: X + PACKED[i]
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 by nibble


def parse_quantization(config: dict, where: str | Path) -> Scaled | Mxfp4 | None:
    """The quantization a config.json (`config`, parsed) declares, None for a float checkpoint; CheckpointError for
    one moekit does not read (READ), or an FP8 config whose block size is not two positive integers."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}/config.json: quantization_config must be a mapping, got {q!r:.80}")
    method = q.get("quant_method")
    if method == "mxfp4":
        return Mxfp4()
    if method == "compressed-tensors":
        return compressed_tensors(q, where)
    if method != "fp8":
        raise CheckpointError(
            f"{where}: its weights are quantized with {method!r} (config.json quantization_config); {READ}: load it "
            "with transformers, dequantize it and save_pretrained the float model first")
    block = q.get("weight_block_size")
    if block is None:
        return Scaled(None)
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"{where}/config.json: quantization_config.weight_block_size must be two positive "
                              f"integers, got {block!r:.80}")
    return Scaled((block[0], block[1]))


READ = ("moekit reads float checkpoints, block-scaled FP8 (quant_method fp8), MXFP4 (mxfp4) and compressed-tensors' "
        "8-bit float-quantized and naive-quantized and 2-, 4- and 8-bit pack-quantized ones")
# compressed-tensors' formats moekit reads: (weight type, label, stored dtypes, bits it reads)
CT_FORMATS = {"float-quantized": ("float", "compressed-tensors FP8 weights", ("F8_E4M3",), (8,)),
              "naive-quantized": ("int", "compressed-tensors int8 weights", ("I8",), (8,)),
              # packed: a weight listed in its scales' dtype, which compressed-tensors decompresses it to
              "pack-quantized": ("int", "compressed-tensors packed int{} weights", ("F32", "BF16", "F16"), (2, 4, 8))}
PACKED_WORDS, PACKED_SHAPE = "_packed", "_shape"  # a pack-quantized weight W is stored as W + each


def compressed_tensors(q: dict, where: str | Path) -> Scaled:
    """The Scaled format of a compressed-tensors config (llm-compressor's FP8-dynamic, W8A8 and W4A16 checkpoints;
    Kimi-K2-Thinking's INT4 experts): one weight scheme for every config group, scales `W_scale` per tensor, channel
    (row), group of columns or block, and for integers zero points `W_zero_point` where it stores them (W = (q - z) ·
    s, as compressed-tensors decompresses); 8-bit values one a byte, or (pack-quantized) 2, 4 or 8 bits packed into
    int32 words; anything else (`_unread`) is refused naming what it is. GPTQ's activation order "weight" (alias
    "static") only changed the order of calibration, not the format (compressed-tensors' ActivationOrdering), and is
    read; "group" stores a column permutation and is refused."""
    kind = CT_FORMATS.get(q.get("format"))
    groups = q.get("config_groups")
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    w = schemes[0] if schemes and isinstance(schemes[0], dict) and all(x == schemes[0] for x in schemes) else None
    why = _unread(q, w, kind)
    if why or w is None or kind is None:
        raise CheckpointError(f"{where}: a compressed-tensors checkpoint moekit cannot read ({why}); {READ}: load it "
                              "with transformers, dequantize it and save_pretrained the float model first")
    strategy = w["strategy"]
    size = w.get("group_size") if strategy == "group" else w.get("block_structure")
    if strategy == "group" and not (type(size) is int and size > 0) or strategy == "block" and not (
            isinstance(size, list) and len(size) == 2 and all(type(b) is int and b > 0 for b in size)):
        key = "group_size" if strategy == "group" else "block_structure"
        raise CheckpointError(f"{where}/config.json: the {strategy} strategy's {key} is {size!r:.80}")
    block = (1, size) if strategy == "group" else tuple(size) if strategy == "block" else \
        (1, None) if strategy == "channel" else None  # tensor: one scale
    bits = w["num_bits"] if q["format"] == "pack-quantized" else None
    return Scaled(block, "_scale", kind[1].format(bits), kind[2], "_zero_point" if kind[0] == "int" else None, bits)


def _unread(q: dict, w: dict | None, kind: tuple | None) -> str:
    """Why moekit cannot read a compressed-tensors config with weight scheme `w` in format `kind` ("" if it can)."""
    sparsity = q.get("sparsity_config")
    sparse = sparsity.get("format", "dense") if isinstance(sparsity, dict) else "dense"
    if kind is None:
        return f"its format is {q.get('format')!r}"
    if w is None:
        return "its config groups quantize weights in different ways"
    if sparse != "dense":
        return f"its sparsity format is {sparse!r}"
    bits = w.get("num_bits")
    if w.get("type") != kind[0] or type(bits) is not int or bits not in kind[3]:
        return f"its weights are {bits}-bit {w.get('type')} (moekit reads {' or '.join(map(str, kind[3]))}-bit " \
               f"{kind[0]} in {q.get('format')})"
    if w.get("symmetric") is False and kind[0] == "float":
        return "its FP8 weights have zero points (symmetric: false)"
    if w.get("actorder") not in (None, False, "weight", "static"):
        return f"its weights are reordered (actorder {w.get('actorder')!r}: a column permutation, g_idx)"
    if w.get("strategy") not in ("tensor", "channel", "group", "block"):
        return f"its weight strategy is {w.get('strategy')!r}"
    return ""


def split_packed(headers: dict, folder: str | Path) -> dict:
    """Replace each MXFP4 pair X_blocks, X_scales of `headers` {name: TensorInfo}, in place, by X as the model holds it
    (shape (..., I, O), bf16: every FP4 value times a power of two is one) and return {X: (blocks, scales)}, every
    pair checked (uint8, shapes that agree)."""
    packed = {}
    for name in [k for k in headers if k.endswith("_blocks")]:
        base = name[:-len("_blocks")]
        blocks, scales = headers.pop(name), headers.pop(base + "_scales", None)
        if scales is None or blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) < 3 \
                or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            beside = f"no {base}_scales" if scales is None else f"{scales.dtype} {list(scales.shape)}"
            raise CheckpointError(f"{folder}: {name} is {blocks.dtype} {list(blocks.shape)} beside {beside}; MXFP4 "
                                  "needs U8 blocks (..., O, G, 16) and U8 scales (..., O, G)")
        *lead, rows, groups, _ = blocks.shape
        shape = (*lead, groups * 32, rows)
        headers[base] = replace(blocks, dtype="BF16", shape=shape, nbytes=math.prod(shape) * 2)
        packed[base] = (blocks, scales)
    return packed


def unpack_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """The float32 weight (..., I, O) of MXFP4 `blocks` (..., O, G, 16) and `scales` (..., O, G) (Mxfp4)."""
    lut = torch.tensor(FP4_VALUES)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # (..., O, G, 16, 2)
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # (..., O, G, 32)
    return values.flatten(-2).transpose(-1, -2).contiguous()  # (..., I, O), laid out as the model holds it


def split_words(headers: dict, fmt: Scaled, folder: str | Path, read) -> dict:
    """Replace each pack-quantized pair W_packed, W_shape of `headers` {name: TensorInfo}, in place, by W as it is
    read (of the shape W_shape holds, `read(name, info)` reading that small tensor; in its scales' float dtype, as
    compressed-tensors decompresses it) and return {W: the TensorInfo of its words}, every pair checked (int32 words,
    a shape whose rows are the words' and whose columns fill them)."""
    words = {}
    for name in [k for k in headers if k.endswith(PACKED_WORDS)]:
        base = name[:-len(PACKED_WORDS)]
        info, shape_info = headers.pop(name), headers.pop(base + PACKED_SHAPE, None)
        shape = [int(x) for x in read(base + PACKED_SHAPE, shape_info).tolist()] if shape_info is not None and \
            shape_info.dtype in ("I64", "I32") and tuple(shape_info.shape) == (len(info.shape),) else None  # small
        if info.dtype != "I32" or len(info.shape) < 2 or shape is None or \
                list(shape[:-1]) != list(info.shape[:-1]) or math.ceil(shape[-1] * fmt.bits / 32) != info.shape[-1]:
            beside = f"no {base}{PACKED_SHAPE}" if shape_info is None else f"{base}{PACKED_SHAPE} = {shape}" \
                if shape is not None else f"{base}{PACKED_SHAPE} {shape_info.dtype} {list(shape_info.shape)}"
            raise CheckpointError(f"{folder}: {name} is {info.dtype} {list(info.shape)} beside {beside}; "
                                  f"{fmt.bits}-bit pack-quantized weights need I32 words (..., O, ⌈I·{fmt.bits}/32⌉) "
                                  "beside an I64 or I32 shape [..., O, I]")
        scale = headers.get(base + fmt.suffix)
        dtype = scale.dtype if scale is not None and scale.dtype in fmt.weights else "F32"
        listed = replace(info, dtype=dtype, shape=tuple(shape))
        headers[base] = replace(listed, nbytes=math.prod(shape) * listed.torch_dtype.itemsize)
        words[base] = info
    return words


def unpack_ints(words: Tensor, bits: int, count: int) -> Tensor:
    """The int8 values (..., count) of int32 `words` (..., W) as compressed-tensors packs them: 32/bits values a word
    (bits 2, 4 or 8), value j of a row in word j // (32/bits) at bit (j mod 32/bits)·bits, stored plus 2^(bits-1);
    the last word's unused values are padding. One value of every word at a time: the int8 output and one int32
    word's worth (a quarter of the output at 4 bits) in memory (measured on a 28672 × 8192 weight: 0.46 GB over its
    words, against 2.07 GB broadcasting every shift at once, in the same time)."""
    n, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    out = torch.empty(*words.shape, n, dtype=torch.int8)  # (..., W, 32/bits)
    for i in range(n):
        out[..., i] = ((words >> (i * bits)) & mask) - offset  # the sign bits an arithmetic shift brings are masked
    out = out.flatten(-2)
    return out if out.shape[-1] == count else out[..., :count].contiguous()


def split_scales(headers: dict, fmt: Scaled, folder: str | Path) -> dict:
    """Take the scales and zero points (and static activation and KV-cache scales) out of `headers` {name:
    TensorInfo}, in place, and return {weight name: (its scales' TensorInfo, its zero points' or None)}, every one
    checked: a weight of `fmt.weights`, scales of a float dtype or UE8M0 in the shape `fmt` gives its blocks, zero
    points of that shape."""
    scales = {}
    for name in [k for k in headers if k.endswith(fmt.suffixes) or k.endswith(IGNORED)]:
        info = headers.pop(name)
        if not name.endswith(fmt.suffixes):
            continue
        suffix = next(x for x in fmt.suffixes if name.endswith(x))
        base = name[:-len(suffix)]
        weight = headers.get(base)
        if weight is None:
            raise CheckpointError(f"{folder}: {name} scales no tensor ({base} is missing)")
        grid = fmt.grid if suffix == fmt.suffix else fmt.zero_grid
        want = grid(weight.shape) if len(weight.shape) >= 2 else None
        ok_shape = info.shape == want or (fmt.block is None and math.prod(info.shape) == 1)
        dtypes = SCALE_DTYPES if suffix == fmt.suffix else ZERO_DTYPES
        if weight.dtype not in fmt.weights or info.dtype not in dtypes or not ok_shape:
            raise CheckpointError(
                f"{folder}: {name} is {info.dtype} {list(info.shape)} beside the {weight.dtype} {list(weight.shape)} "
                f"weight it belongs to; {fmt.label} with block {list(fmt.block or [])} need a "
                f"{' or '.join(fmt.weights)} weight and {suffix} of {', '.join(dtypes)} shaped "
                f"{list(want or ['≥ 2 dimensions'])}")
        scale, zero = scales.get(base, (None, None))
        scales[base] = (info, zero) if suffix == fmt.suffix else (scale, info)
    missing = next((k for k, (scale, _) in scales.items() if scale is None), None)
    if missing is not None:
        raise CheckpointError(f"{folder}: {missing} has zero points but no {missing}{fmt.suffix}")
    return scales


def dequantize(q: Tensor, s: Tensor, block: tuple[int, int] | None, z: Tensor | None = None) -> Tensor:
    """The float32 weight (q - z) · s of 8-bit values `q` (..., O, I), their scales `s` and zero points `z` (None: 0),
    both (..., ⌈O/bo⌉, ⌈I/bi⌉) (module docstring), `block` resolved (Scaled.resolve)."""
    if s.dtype == torch.uint8:  # UE8M0 exponents stored as bytes
        s = torch.exp2(s.float() - 127)
    w = q.float()
    if block is None:
        return (w - (0 if z is None else z.float().reshape(()))) * s.float().reshape(())
    if z is not None:
        _blockwise(w, z.float(), block, Tensor.sub_)
    _blockwise(w, s.float(), block, Tensor.mul_)
    return w


def _blockwise(w: Tensor, t: Tensor, block: tuple[int, int], op) -> None:
    """w = op(w, t) in place, t's entry [..., o // bo, i // bi] applied to w[..., o, i]."""
    rows, cols = w.shape[-2:]
    t = t.repeat_interleave(block[0], dim=-2)[..., :rows, :]  # (..., O, ⌈I/bi⌉)
    full, rest = divmod(cols, block[1])  # whole column blocks, and the columns of a last partial one
    op(w[..., :full * block[1]].unflatten(-1, (full, block[1])), t[..., :full, None])
    if rest:
        op(w[..., full * block[1]:], t[..., full:])
