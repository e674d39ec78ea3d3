"""CTranslate2 Whisper checkpoints (faster-whisper's format) -> Hugging Face `WhisperForConditionalGeneration`.

A CTranslate2 (CT2) Whisper folder holds `model.bin` (the weights), `config.json` (decoding settings:
suppress_ids, suppress_ids_begin, lang_ids, alignment_heads) and the vocabulary: `vocabulary.json` (a JSON
list) or, from older converters, `vocabulary.txt` (one token a line); a token's id is its position.

`model.bin`, binary version 6, little-endian; a string is a u16 byte count (counting a final NUL), the UTF-8
bytes and that NUL:

    u32 version | string spec name | u32 spec revision | u32 n
    n x (string name | u8 rank | rank x u32 dim | u8 dtype | u32 byte count | row-major data)
    u32 m | m x (string alias | string name of the variable it stands for)

dtype: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16. Names are scopes joined by "/", e.g.
`encoder/layer_0/self_attention/linear_0/weight`; rank-0 variables are flags and sizes. A quantized
`<x>/weight` (int8, int16) comes with `<x>/weight_scale` (one per output row, or one in all): float =
int / scale. Self-attention stores q, k, v fused row-wise in `linear_0`, cross-attention k, v in `linear_1`.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moekit.errors import AssetError
from moekit._fs import output, reserve

BINARY_VERSION = 6
DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16, 5: torch.bfloat16}
# flags of CT2's Whisper decoder and the value that HF Whisper computes with (GELU is CT2 activation 3)
WHISPER_FLAGS = {"decoder/activation": 3, "decoder/pre_norm": 1, "decoder/alibi": 0,
                 "decoder/scale_embeddings": 0, "decoder/start_from_zero_embedding": 0}
IGNORED = {"decoder/alignment_heads", "decoder/alignment_layer"}  # CT2's own defaults; config.json has the real ones
SPECIALS = ("<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startofprev|>",
            "<|notimestamps|>")


@dataclass
class Checkpoint:
    """The variables of a CT2 `model.bin`; aliases are the same tensor under a second name."""

    spec: str
    revision: int
    variables: dict[str, torch.Tensor]
    used: set[str] = field(default_factory=set)

    def weight(self, name: str) -> torch.Tensor:
        """Variable `name` as float32, dequantized with `<name>_scale` when it has one."""
        value = self._take(name)
        if f"{name}_scale" in self.variables:
            scale = self._take(f"{name}_scale").float()
            return value.float() / (scale.reshape(-1, *[1] * (value.dim() - 1)) if scale.dim() else scale)
        if not value.is_floating_point():
            raise AssetError(f"CT2 variable {name} is {value.dtype} but has no {name}_scale to dequantize it")
        return value.float()

    def flag(self, name: str) -> float:
        return self._take(name).item()

    def _take(self, name: str) -> torch.Tensor:
        if name not in self.variables:
            raise AssetError(f"CT2 {self.spec} checkpoint has no variable {name}")
        self.used.add(name)
        return self.variables[name]


class _Cursor:
    """Reads fields from a byte buffer; running past its end is an AssetError."""

    def __init__(self, buf: bytes, source: str):
        self.buf, self.pos, self.source = buf, 0, source

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise AssetError(f"{self.source} is truncated: needs {self.pos + n} bytes, has {len(self.buf)}")
        self.pos += n
        return memoryview(self.buf)[self.pos - n:self.pos]

    def unpack(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.unpack("H")))
        if not raw.endswith(b"\0"):
            raise AssetError(f"{self.source}: malformed string at byte {self.pos} (no final NUL)")
        try:
            return raw[:-1].decode()
        except UnicodeDecodeError:
            raise AssetError(f"{self.source}: malformed string at byte {self.pos} (not UTF-8)") from None

    def variable(self) -> tuple[str, torch.Tensor]:
        name = self.string()
        shape = [self.unpack("I") for _ in range(self.unpack("B"))]
        type_id, nbytes = self.unpack("B"), self.unpack("I")
        if type_id not in DTYPES:
            raise AssetError(f"{self.source}: variable {name} has unknown dtype id {type_id}")
        dtype = DTYPES[type_id]
        if nbytes != math.prod(shape) * dtype.itemsize:
            raise AssetError(f"{self.source}: variable {name} {shape} {dtype} has {nbytes} bytes")
        data = torch.from_numpy(np.frombuffer(self.take(nbytes), dtype=np.uint8).copy())
        if not nbytes:  # a zero-size variable: a view of no bytes as a wider dtype is refused by torch
            return name, torch.empty(shape, dtype=dtype)
        return name, data.view(dtype).reshape(shape)


def read_model_bin(paths: Path | Sequence[Path]) -> Checkpoint:
    """Read a CT2 `model.bin`, or its pieces concatenated in order (a model split over packages)."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    source = " + ".join(map(str, paths))
    try:
        buf = b"".join(p.read_bytes() for p in paths)
    except OSError as e:
        raise AssetError(f"cannot read CT2 model {source}: {e}") from None
    cur = _Cursor(buf, source)
    version = cur.unpack("I")
    if version != BINARY_VERSION:
        raise AssetError(f"{source} is not a CTranslate2 model.bin of binary version {BINARY_VERSION} "
                         f"(its header says {version})")
    spec, revision = cur.string(), cur.unpack("I")
    variables = dict(cur.variable() for _ in range(cur.unpack("I")))
    for _ in range(cur.unpack("I")):
        alias, name = cur.string(), cur.string()
        if name not in variables:
            raise AssetError(f"{source}: alias {alias} names no variable ({name})")
        variables[alias] = variables[name]
    if cur.pos != len(buf):
        raise AssetError(f"{source}: {len(buf) - cur.pos} unexpected bytes after the aliases")
    return Checkpoint(spec, revision, variables)


def _linear(ck: Checkpoint, src: str, dsts: list[str]) -> dict[str, torch.Tensor]:
    """CT2 linear `src` (split row-wise into equal parts when fused) -> HF linears `dsts`. Whisper's k_proj
    has no bias: a key bias adds the same amount to all of a query's scores, which softmax ignores."""
    weight, bias = ck.weight(f"{src}/weight"), ck.weight(f"{src}/bias")
    if weight.shape[0] % len(dsts):
        raise AssetError(f"CT2 {src}: {weight.shape[0]} rows do not split into {len(dsts)} projections")
    out = {}
    for dst, w, b in zip(dsts, weight.chunk(len(dsts)), bias.chunk(len(dsts))):
        out[f"{dst}.weight"] = w
        if not dst.endswith("k_proj"):
            out[f"{dst}.bias"] = b
    return out


def _norm(ck: Checkpoint, src: str, dst: str) -> dict[str, torch.Tensor]:
    return {f"{dst}.weight": ck.weight(f"{src}/gamma"), f"{dst}.bias": ck.weight(f"{src}/beta")}


def _attention(ck: Checkpoint, src: str, module: str, groups: tuple[tuple[str, ...], ...]) -> dict[str, torch.Tensor]:
    """CT2 attention block `src` -> HF attention `module`; `src`/linear_i holds the projections groups[i]."""
    out = _norm(ck, f"{src}/layer_norm", f"{module}_layer_norm")
    for i, group in enumerate(groups):
        out |= _linear(ck, f"{src}/linear_{i}", [f"{module}.{p}" for p in group])
    return out


SELF_ATTENTION = (("q_proj", "k_proj", "v_proj"), ("out_proj",))
CROSS_ATTENTION = (("q_proj",), ("k_proj", "v_proj"), ("out_proj",))


def _layer(ck: Checkpoint, src: str, dst: str, cross: bool) -> dict[str, torch.Tensor]:
    """One encoder (cross=False) or decoder layer."""
    out = _attention(ck, f"{src}/self_attention", f"{dst}.self_attn", SELF_ATTENTION)
    if cross:
        out |= _attention(ck, f"{src}/attention", f"{dst}.encoder_attn", CROSS_ATTENTION)
    out |= _linear(ck, f"{src}/ffn/linear_0", [f"{dst}.fc1"]) | _linear(ck, f"{src}/ffn/linear_1", [f"{dst}.fc2"])
    return out | _norm(ck, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")


def _num_layers(ck: Checkpoint, stack: str) -> int:
    return len({m.group(1) for n in ck.variables if (m := re.match(rf"{stack}/layer_(\d+)/", n))})


def whisper_state_dict(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """HF `WhisperForConditionalGeneration` weights (float32) from a CT2 WhisperSpec checkpoint."""
    sd = {f"model.encoder.{c}.{p}": ck.weight(f"encoder/{c}/{p}") for c in ("conv1", "conv2")
          for p in ("weight", "bias")}
    for stack in ("encoder", "decoder"):
        sd[f"model.{stack}.embed_positions.weight"] = ck.weight(f"{stack}/position_encodings/encodings")
        sd |= _norm(ck, f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        for i in range(_num_layers(ck, stack)):
            sd |= _layer(ck, f"{stack}/layer_{i}", f"model.{stack}.layers.{i}", cross=stack == "decoder")
    sd["model.decoder.embed_tokens.weight"] = ck.weight("decoder/embeddings/weight")
    sd["proj_out.weight"] = ck.weight("decoder/projection/weight")
    return sd


def _check_whisper(ck: Checkpoint) -> None:
    """Refuse checkpoints that are not Whisper or compute differently from HF Whisper."""
    if ck.spec != "WhisperSpec":
        raise AssetError(f"CT2 model is a {ck.spec}, not a WhisperSpec")
    for name, expected in WHISPER_FLAGS.items():
        if name in ck.variables and ck.flag(name) != expected:
            raise AssetError(f"CT2 Whisper flag {name} is {ck.flag(name)}; HF Whisper needs {expected}")
    ck.used |= IGNORED & ck.variables.keys()


def read_vocabulary(ct2_dir: Path) -> list[str]:
    """The tokens of a CT2 folder in id order (vocabulary.json, else vocabulary.txt)."""
    try:
        if (ct2_dir / "vocabulary.json").is_file():
            tokens = json.loads((ct2_dir / "vocabulary.json").read_text(encoding="utf-8"))
            if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
                raise ValueError("vocabulary.json must hold a JSON list of token strings")
            return tokens
        text = (ct2_dir / "vocabulary.txt").read_text(encoding="utf-8")
    except (OSError, ValueError, RecursionError) as e:
        raise AssetError(f"cannot read the vocabulary of CT2 model {ct2_dir}: {e}") from None
    return text.removesuffix("\n").split("\n")


def rebuild_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Byte-level BPE merges from a vocabulary in rank order (tiktoken ranks): each multi-character token
    is run through BPE using only lower-ranked tokens; the two parts it ends with are its merge. Tokens
    that do not end in two parts (e.g. an empty placeholder) get no merge."""
    rank = {t: i for i, t in enumerate(tokens)}
    merges = []
    for r, token in enumerate(tokens):
        parts = list(token)
        while len(parts) > 2:
            pairs = [(rank.get(a + b, r), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= r:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer(tokens: Sequence[str]):
    """A `WhisperTokenizer`: BPE on tokens before <|endoftext|> (merges rebuilt from ranks), the tokens from
    <|endoftext|> to <|notimestamps|> special, timestamps <|0.00|>... added (not special), as HF does."""
    import transformers as tf
    from tokenizers import AddedToken

    ids = special_ids(tokens)
    eot, nts = ids["<|endoftext|>"], ids["<|notimestamps|>"]
    tok = tf.WhisperTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=rebuild_merges(tokens[:eot]),
                              extra_special_tokens=list(tokens[eot:nts + 1]))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in tokens[nts + 1:]])
    return tok


def special_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Ids of Whisper's control tokens; the vocabulary must be duplicate-free and hold them all."""
    ids = {t: i for i, t in enumerate(tokens)}
    if len(ids) != len(tokens):
        raise AssetError(f"the CT2 vocabulary repeats {len(tokens) - len(ids)} token(s)")
    missing = [t for t in SPECIALS if t not in ids]
    if missing:
        raise AssetError(f"the CT2 vocabulary lacks Whisper's {', '.join(missing)}")
    return {t: ids[t] for t in SPECIALS}


def whisper_config(ck: Checkpoint, tokens: Sequence[str], options: dict):
    """The HF `WhisperConfig` of a CT2 Whisper checkpoint (sizes from the variables' shapes)."""
    import transformers as tf

    shape = {n: v.shape for n, v in ck.variables.items()}
    ids = special_ids(tokens)
    embed, conv1 = shape["decoder/embeddings/weight"], shape["encoder/conv1/weight"]
    if embed[0] != len(tokens):
        raise AssetError(f"the CT2 vocabulary has {len(tokens)} tokens but the embeddings {embed[0]} rows")
    ffn = {s: shape[f"{s}/layer_0/ffn/linear_0/weight"][0] for s in ("encoder", "decoder")}
    return tf.WhisperConfig(
        vocab_size=embed[0], d_model=embed[1], num_mel_bins=conv1[1], activation_function="gelu",
        encoder_layers=_num_layers(ck, "encoder"), decoder_layers=_num_layers(ck, "decoder"),
        encoder_attention_heads=int(ck.flag("encoder/num_heads")), encoder_ffn_dim=ffn["encoder"],
        decoder_attention_heads=int(ck.flag("decoder/num_heads")), decoder_ffn_dim=ffn["decoder"],
        max_source_positions=shape["encoder/position_encodings/encodings"][0],
        max_target_positions=shape["decoder/position_encodings/encodings"][0],
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=options.get("suppress_ids"), begin_suppress_tokens=options.get("suppress_ids_begin"),
        tie_word_embeddings=torch.equal(ck.variables["decoder/projection/weight"],
                                        ck.variables["decoder/embeddings/weight"]))


def generation_config(config, tokens: Sequence[str], options: dict, multilingual: bool):
    """Whisper's `GenerationConfig`: language and task tokens for multilingual models (so that
    `generate(..., language="en", task="transcribe")` works; without a language, generate detects it and
    transcribes, as HF's Whisper checkpoints do), <|notimestamps|> after the prompt."""
    import transformers as tf

    ids = special_ids(tokens)
    gen = tf.GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, max_length=config.max_target_positions,
        suppress_tokens=config.suppress_tokens, begin_suppress_tokens=config.begin_suppress_tokens,
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=multilingual, return_timestamps=False, max_initial_timestamp_index=50)
    if options.get("alignment_heads"):
        gen.alignment_heads = [list(h) for h in options["alignment_heads"]]
    if multilingual:  # language tokens sit between <|startoftranscript|> and <|translate|>
        langs = range(ids["<|startoftranscript|>"] + 1, ids["<|translate|>"])
        gen.lang_to_id = {tokens[i]: i for i in langs}
        gen.task_to_id = {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]}
        gen.task = "transcribe"  # the default task, instead of the deprecated forced_decoder_ids
    return gen


def whisper_model(ck: Checkpoint, tokens: Sequence[str], options: dict, multilingual: bool | None = None):
    """A float32 `WhisperForConditionalGeneration` (with its generation config) from a CT2 checkpoint.
    `multilingual=None` follows Whisper: multilingual when the vocabulary has >= 51865 tokens."""
    import transformers as tf
    from transformers.initialization import no_init_weights

    _check_whisper(ck)
    state = whisper_state_dict(ck)  # first: a missing variable is named here
    config = whisper_config(ck, tokens, options)
    unused = sorted(set(ck.variables) - ck.used)
    if unused:
        raise AssetError(f"CT2 Whisper checkpoint has variables this converter does not know: {unused[:5]}")
    with no_init_weights():
        model = tf.WhisperForConditionalGeneration(config)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise AssetError(f"CT2 Whisper weights do not fit {config.model_type}: {e}") from None
    model.tie_weights()  # proj_out shares the token embeddings when the checkpoint aliases them
    multilingual = len(tokens) >= 51865 if multilingual is None else multilingual
    model.generation_config = generation_config(config, tokens, options, multilingual)
    return model.eval()


def convert_whisper(ct2_dir: str | Path, out_dir: str | Path, overwrite: bool = False,
                    model_bin: Path | Sequence[Path] | None = None, multilingual: bool | None = None) -> Path:
    """Convert a CT2 Whisper folder into a HF model folder `out_dir` (atomically): float32 safetensors
    weights, config, generation config, tokenizer and feature extractor (`WhisperProcessor` loads them).
    `model_bin`: the pieces of a split model.bin, in order, instead of `ct2_dir/model.bin`;
    `multilingual`: see `whisper_model`."""
    ct2_dir, out = Path(ct2_dir), Path(out_dir)
    with reserve(out, [ct2_dir], overwrite):  # checked (and locked) before the model is read
        return _convert(ct2_dir, out, overwrite, model_bin, multilingual)


def _convert(ct2_dir: Path, out: Path, overwrite: bool, model_bin, multilingual: bool | None) -> Path:
    import transformers as tf

    ck = read_model_bin(model_bin or ct2_dir / "model.bin")
    try:
        options = json.loads((ct2_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise AssetError(f"cannot read the config.json of CT2 model {ct2_dir}: {e}") from None
    tokens = read_vocabulary(ct2_dir)
    model = whisper_model(ck, tokens, options, multilingual)
    features = tf.WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    processor = tf.WhisperProcessor(feature_extractor=features, tokenizer=build_tokenizer(tokens))
    with output(out, overwrite=overwrite) as tmp, contextlib.redirect_stderr(io.StringIO()):  # silence bars
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out
