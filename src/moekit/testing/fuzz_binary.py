"""Binary inputs for moekit.testing.fuzz: safetensors shards, routing traces (.npz), CTranslate2 model.bin and
GGUF: a valid tiny seed of each, mutators that know their layout (header JSON, length prefixes, zip and .npy
headers, integer fields), and the library call that reads them."""
from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

from moekit.testing.fuzz import INTERESTING, Reader, copy_seed, json_bytes, mutate_bytes, mutate_text, mutate_tree


# ---------------------------------------------------------------------------------------------- safetensors


def _safetensors(header: dict, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw) if length is None else length % 2**64) + raw + data


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _write_tensors(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


def _tensors(scale: int = 1) -> dict:
    import torch

    g = torch.Generator().manual_seed(scale)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(2, generator=g).bfloat16(),
            "c.ids": torch.arange(3 * scale), "d.half": torch.ones(2, 2, 1).half(), "e.empty": torch.zeros(0, 5),
            "f.mask": torch.tensor([True, False])}


def _header_case(rng: random.Random, blob: bytes) -> bytes:
    """A shard with its header mutated as a tree, as one tensor's entry, as its length prefix, or as bytes."""
    header, data = _split(blob)
    r = rng.random()
    if r < 0.45:
        return _safetensors(mutate_tree(rng, header), data)
    if r < 0.7:
        key = rng.choice([k for k in header if k != "__metadata__"])
        entry = header[key]
        field = rng.choice(["dtype", "shape", "data_offsets"])
        entry[field] = rng.choice([
            rng.choice(["F8_E4M3", "U64", "F32", "I8", "C64", "", None, 3]),
            [2**62, 2**62], [2**40], [-1, 3], [3, 4, 0], [], [1.5], ["3"],
            [0, 2**63], [entry["data_offsets"][1], entry["data_offsets"][0]], [0, 0], [-8, 4]])
        start = (entry["data_offsets"] or [0])[0] if isinstance(entry["data_offsets"], list) else 0
        if rng.random() < 0.3 and isinstance(start, int):  # a lie that is consistent in the header
            entry["data_offsets"] = [start, start + 4 * 2**40]
        return _safetensors(header, data)
    if r < 0.85:
        n = len(json.dumps(header).encode())
        return _safetensors(header, data, rng.choice([0, 1, 7, n - 1, n + 1, len(blob), 2**63, 2**64 - 1, 100 << 20]))
    return mutate_bytes(rng, blob, [(0, 8)])


def _read_shards(case: Path) -> None:
    from moekit.checkpoint.files import ShardReader

    with ShardReader(case / "model") as reader:
        for k in reader.keys():
            reader.get(k)
            if reader.headers[k].shape and reader.headers[k].shape[0]:
                reader.get(k, 0)


def _build_single(seed: Path) -> None:
    (seed / "model").mkdir()
    _write_tensors(seed / "model" / "model.safetensors", _tensors())


def _mutate_single(rng: random.Random, seed: Path, case: Path) -> None:
    copy_seed(seed, case)
    f = case / "model" / "model.safetensors"
    f.write_bytes(_header_case(rng, f.read_bytes()))


def _build_sharded(seed: Path) -> None:
    (seed / "model").mkdir()
    wmap = {}
    for i, part in enumerate((("a.weight", "b.bias", "c.ids"), ("d.half", "e.empty", "f.mask"))):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        _write_tensors(seed / "model" / name, {k: v for k, v in _tensors().items() if k in part})
        wmap |= dict.fromkeys(part, name)
    index = {"metadata": {"total_size": 100}, "weight_map": wmap}
    (seed / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    (seed / "outside.safetensors").write_bytes((seed / "model" / name).read_bytes())


def _link_shard(rng: random.Random, case: Path) -> None:
    """A shard replaced by a link (leading out, dangling, to a device, to a folder) or by a folder or FIFO."""
    f = case / "model" / rng.choice(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    f.unlink()
    kind = rng.randrange(6)
    if kind == 4:
        f.mkdir()
    elif kind == 5:
        os.mkfifo(f)
    else:
        f.symlink_to(["../outside.safetensors", "missing.safetensors", "/dev/zero", "."][kind])


def _mutate_sharded(rng: random.Random, seed: Path, case: Path) -> None:
    copy_seed(seed, case)
    index = case / "model" / "model.safetensors.index.json"
    r = rng.random()
    if r < 0.6:
        data = json.loads(index.read_text())
        if rng.random() < 0.5:
            key = rng.choice(list(data["weight_map"]))
            data["weight_map"][key] = rng.choice(["../outside.safetensors", "/etc/hostname", "", ".", "..",
                                                  "model.safetensors.index.json", "sub/x.safetensors", 3, None,
                                                  "model-00002-of-00002.safetensors", "missing.safetensors"])
            index.write_text(json.dumps(data))
        else:
            index.write_bytes(json_bytes(rng, data))
    elif r < 0.8:
        _link_shard(rng, case)
    else:
        shard = case / "model" / "model-00002-of-00002.safetensors"
        shard.write_bytes(_header_case(rng, shard.read_bytes()))


# ---------------------------------------------------------------------------------------------- routing traces


def _build_trace(seed: Path) -> None:
    import numpy as np

    from moekit.routing.trace import SALIENCY, RoutingTrace

    rng = np.random.default_rng(0)
    L, N, k, E = 2, 6, 2, 4
    saliency = rng.random((2, L, E, len(SALIENCY)))  # (languages, layers, experts, sums); counts are whole numbers
    saliency[..., 0] = rng.integers(0, 5, (2, L, E))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(L * N)]).reshape(L, N, k).astype(np.int16)
    RoutingTrace(["model.layers.0.mlp", "model.layers.1.mlp"], np.array([E, E]), ["en", "fr"], ids,
                 rng.random((L, N, k)).astype(np.float32), np.arange(N, dtype=np.int32),
                 np.array([0, 0, 0, 1, 1, 1], dtype=np.int32), np.array([0, 1, 2, 0, 1, 2], dtype=np.int32),
                 np.array([0, 0, 0, 1, 1, 1], dtype=np.int16), {"model": "tiny", "max_length": 8},
                 saliency).save(seed / "t.npz")


def _array_damage(rng: random.Random, a):
    """An array of another dtype, shape or with hostile values."""
    import numpy as np

    op = rng.randrange(7)
    if op == 0:
        return a.astype(rng.choice([np.float16, np.float64, np.int8, np.int64, np.uint64, np.bool_, np.complex64,
                                    "U3", "S2", "datetime64[s]"]))
    if op == 1:
        b = a.reshape(-1) if a.ndim == 0 else a
        return rng.choice([b.reshape(-1), b[..., None], b[:0], b[:1], np.array(b.flat[0] if b.size else 0),
                           np.concatenate([b, b]), b.T])
    if op == 2 and a.size and a.dtype.kind in "iuf":
        b = a.astype(np.float64 if a.dtype.kind == "f" else np.int64).copy()
        b.flat[rng.randrange(b.size)] = rng.choice([-2, -1, 2**15 - 1, 2**31 - 1, -2**31, 99] +
                                                   ([np.nan, np.inf, -np.inf, 1e300] if a.dtype.kind == "f" else []))
        return b.astype(a.dtype)
    if op == 3:
        return np.array(json.dumps(mutate_tree(rng, a.tolist())))
    if op == 4:
        return np.array(rng.choice(["", "x", "{", "[1]", "{'a': (1,) * 3}", "{" * 10**4, "__import__('os')", "1e999"]))
    if op == 5:
        return np.zeros(rng.choice([(0,), (2, 0, 3), (1, 1, 1, 1)]), dtype=a.dtype)
    return np.array(rng.choice(INTERESTING[:20]), dtype=object)


def _npz_case(rng: random.Random, src: Path, out: Path) -> None:
    import numpy as np

    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for _ in range(rng.choice([1, 1, 2])):
        key = rng.choice(sorted(arrays))
        op = rng.random()
        if op < 0.1:
            del arrays[key]
        elif op < 0.15:
            arrays["extra"] = arrays[key]
        elif key == "meta" and op < 0.5:
            arrays[key] = np.array(json_bytes(rng, json.loads(str(arrays[key]))).decode("utf-8", "replace"))
        else:
            try:
                with np.errstate(all="ignore"):
                    arrays[key] = _array_damage(rng, arrays[key])
            except (ValueError, TypeError, OverflowError):  # a cast numpy refuses (a string to complex)
                arrays[key] = np.array("x")
    with open(out, "wb") as f:
        (np.savez_compressed if rng.random() < 0.5 else np.savez)(f, **arrays)


def _npy_lie(rng: random.Random, src: Path, out: Path) -> None:
    """An uncompressed .npz whose member's .npy header declares another shape or dtype than its data holds."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        names = zin.namelist()
        victim = rng.choice(names)
        for name in names:
            data = zin.read(name)
            if name == victim:
                n = struct.unpack("<H", data[8:10])[0]
                header = data[10:10 + n].decode("latin1")
                shape = rng.choice(["(4398046511104,)", "(1099511627776, 4)", "(-1,)", "(2, 3, 2)", "()", "(0,)",
                                    "(9223372036854775807,)"])
                descr = rng.choice(["'<i2'", "'<f8'", "'|O'", "'<U100000000'", "'<V8'", "None", "'<i2'"])
                header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}"
                header = header.ljust(n - 1) + "\n" if len(header) < n else header + "\n"
                data = data[:8] + struct.pack("<H", len(header)) + header.encode("latin1") + data[10 + n:]
            zout.writestr(name, data)


def _zip_fields(blob: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the size and offset fields in a zip's local and central headers."""
    out, i = [], blob.find(b"PK")
    while i != -1:
        sig = blob[i:i + 4]
        if sig == b"PK\x03\x04":
            out += [(i + 18, 4), (i + 22, 4), (i + 26, 2), (i + 28, 2)]
        elif sig == b"PK\x01\x02":
            out += [(i + 20, 4), (i + 24, 4), (i + 28, 2), (i + 42, 4)]
        elif sig == b"PK\x05\x06":
            out += [(i + 10, 2), (i + 12, 4), (i + 16, 4)]
        i = blob.find(b"PK", i + 2)
    return out


def _mutate_trace(rng: random.Random, seed: Path, case: Path) -> None:
    r, src, out = rng.random(), seed / "t.npz", case / "t.npz"
    if r < 0.6:
        _npz_case(rng, src, out)
    elif r < 0.75:
        _npy_lie(rng, src, out)
    else:
        blob = src.read_bytes()
        out.write_bytes(mutate_bytes(rng, blob, _zip_fields(blob)))


def _read_trace(case: Path) -> None:
    from moekit.routing.trace import RoutingTrace

    RoutingTrace.load(case / "t.npz")


# ---------------------------------------------------------------------------------------------- CTranslate2


def _ct2_string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def ct2_bytes(variables: dict, aliases=(), spec: str = "WhisperSpec", revision: int = 3) -> tuple[bytes, list]:
    """A CTranslate2 model.bin (binary version 6, moekit.assets.ct2's docstring) and the (offset, width) of its integer
    fields (counts, ranks, dims, dtype ids, byte counts, string lengths)."""
    import torch

    ids = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4, torch.bfloat16: 5}
    out, fields = bytearray(struct.pack("<I", 6)), [(0, 4)]

    def put(data: bytes, *widths: int) -> None:
        at = len(out)
        for w in widths:
            fields.append((at, w))
            at += w
        out.extend(data)

    put(_ct2_string(spec), 2)
    put(struct.pack("<II", revision, len(variables)), 4, 4)
    for name, t in variables.items():
        put(_ct2_string(name), 2)
        put(struct.pack("<B", t.dim()) + b"".join(struct.pack("<I", d) for d in t.shape), 1, *[4] * t.dim())
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        put(struct.pack("<BI", ids[t.dtype], len(raw)), 1, 4)
        out.extend(raw)
    put(struct.pack("<I", len(aliases)), 4)
    for a, n in aliases:
        put(_ct2_string(a), 2)
        put(_ct2_string(n), 2)
    return bytes(out), fields


def _ct2_variables() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    return {"decoder/activation": torch.tensor(3, dtype=torch.int8), "decoder/num_heads": torch.tensor(2, dtype=torch.int16),
            "encoder/layer_0/ffn/linear_0/weight": (w * 50).to(torch.int8),
            "encoder/layer_0/ffn/linear_0/weight_scale": torch.full((6,), 50.0),
            "encoder/layer_0/ffn/linear_0/bias": torch.randn(6, generator=g).half(),
            "decoder/embeddings/weight": torch.randn(5, 4, generator=g).bfloat16(),
            "encoder/conv1/weight": torch.randn(2, 3, 3, generator=g), "decoder/ids": torch.arange(4, dtype=torch.int32)}


def _build_ct2(seed: Path) -> None:
    blob, fields = ct2_bytes(_ct2_variables(), aliases=[("decoder/projection/weight", "decoder/embeddings/weight")])
    (seed / "model.bin").write_bytes(blob)
    (seed / "fields.json").write_text(json.dumps(fields))
    from moekit.assets.ct2 import SPECIALS

    (seed / "vocabulary.json").write_text(json.dumps(["a", "b", "Ġthe", *SPECIALS, "<|en|>"]))


def _mutate_ct2(rng: random.Random, seed: Path, case: Path) -> None:
    blob, vocab = (seed / "model.bin").read_bytes(), json.loads((seed / "vocabulary.json").read_text())
    r = rng.random()
    if r < 0.8:
        fields = [tuple(f) for f in json.loads((seed / "fields.json").read_text())]
        blob = mutate_bytes(rng, blob, fields + fields)  # field overwrites twice as likely as byte damage
    (case / "model.bin").write_bytes(blob)
    if r >= 0.8 and rng.random() < 0.5:
        (case / "vocabulary.txt").write_bytes(mutate_text(rng, "\n".join(vocab) + "\n"))
    else:
        (case / "vocabulary.json").write_bytes(json_bytes(rng, vocab) if r >= 0.8 else json.dumps(vocab).encode())


def _read_ct2(case: Path) -> None:
    from moekit.assets import ct2

    ck = ct2.read_model_bin(case / "model.bin")
    ck.weight("encoder/layer_0/ffn/linear_0/weight")
    ck.weight("decoder/projection/weight")
    ck.flag("decoder/activation")
    ct2.special_ids(ct2.read_vocabulary(case))


# ---------------------------------------------------------------------------------------------- GGUF


def write_gguf(path: Path, hidden: int = 16, inter: int = 32, heads: int = 2, kv: int = 1) -> None:
    """A tiny one-layer Llama GGUF (float32 tensors, a sentencepiece-style vocabulary of 40), as llama.cpp lays it
    out, written by the `gguf` package that transformers reads it with."""
    import gguf
    import numpy as np

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(32)] + ["▁a", "▁b", "c", "d", "e"]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_name, "tiny"), (w.add_context_length, 32), (w.add_embedding_length, hidden),
                       (w.add_block_count, 1), (w.add_feed_forward_length, inter), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv), (w.add_rope_dimension_count, hidden // heads),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 1e4), (w.add_vocab_size, len(tokens)),
                       (w.add_tokenizer_model, "llama"), (w.add_token_list, tokens),
                       (w.add_token_scores, [0.0] * len(tokens)), (w.add_token_types, [2, 3, 3] + [6] * 32 + [1] * 5),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_unk_token_id, 0)):
        add(value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,), "output": (len(tokens), hidden)}
    kv_rows = hidden // heads * kv
    shapes |= {f"blk.0.{n}": s for n, s in (("attn_q", (hidden, hidden)), ("attn_k", (kv_rows, hidden)),
               ("attn_v", (kv_rows, hidden)), ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
               ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter)), ("attn_norm", (hidden,)),
               ("ffn_norm", (hidden,)))}
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_fields(path: Path) -> list[tuple[int, int]]:
    """(offset, width) of every integer in the GGUF's header, metadata and tensor infos (lengths, counts, value
    types, dims, data types, data offsets), located by the `gguf` package's own reader."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    base = reader.data.__array_interface__["data"][0]
    out = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype.kind in "iu" and part.size:
                out.append((part.__array_interface__["data"][0] - base, part.dtype.itemsize))
    return out


def _build_gguf(seed: Path) -> None:
    write_gguf(seed / "m.gguf")
    (seed / "fields.json").write_text(json.dumps(_gguf_fields(seed / "m.gguf")))


def _mutate_gguf(rng: random.Random, seed: Path, case: Path) -> None:
    fields = [tuple(f) for f in json.loads((seed / "fields.json").read_text())]
    (case / "m.gguf").write_bytes(mutate_bytes(rng, (seed / "m.gguf").read_bytes(), fields * 3))


def _read_gguf(case: Path) -> None:
    from moekit.assets import convert_gguf

    convert_gguf(case / "m.gguf", case / "out")


BINARY = [Reader("safetensors", _build_single, _mutate_single, _read_shards),
          Reader("safetensors-index", _build_sharded, _mutate_sharded, _read_shards),
          Reader("trace", _build_trace, _mutate_trace, _read_trace),
          Reader("ct2", _build_ct2, _mutate_ct2, _read_ct2),
          Reader("gguf", _build_gguf, _mutate_gguf, _read_gguf, output="out")]
