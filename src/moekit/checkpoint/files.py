"""Checkpoints as untrusted input: which files a checkpoint directory may hold, which hold the weights, what
their headers say, and reading one tensor (or one expert's slice of it) at a time.

Every file moekit or transformers reads from a checkpoint (configs, metadata, tokenizer files, shards, indexes)
must be a regular file whose real path lies inside the checkpoint directory (`check_dir`, `contained`): no
`..`, no absolute shard path, no symbolic link leading out or dangling, no device or FIFO. The one exception is
the Hugging Face cache, whose snapshot files are links into the repository's `blobs/`: there the repository's
cache folder is the boundary (`root_of`). Files moekit reads itself are opened once and the opened descriptor
is checked (`open_file`), so nothing swapped in after the check is read. Every safetensors header is parsed and
checked as safetensors itself does (size, JSON, dtypes, shapes, data offsets that cover the data exactly), and
the index must agree with the headers. Anything else is one CheckpointError naming the file. Tensors are read
with pread into their own buffer (no mmap), so the resident memory of a streaming pass is what it holds, not
what it has read.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import stat
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moekit.checkpoint.quantized import (PACKED_WORDS, Mxfp4, Scaled, dequantize, parse_quantization, split_packed,
                                         split_scales, split_words, unpack_ints, unpack_mxfp4)
from moekit.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 << 20  # safetensors' own limit
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F8_E8M0": torch.float8_e8m0fnu}  # FP8 weights and their UE8M0 scales: moekit.checkpoint.quantized
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a shard header declares it."""

    dtype: str  # safetensors dtype name: F32, BF16, F16, I64, ...
    shape: tuple[int, ...]
    file: Path
    start: int = 0  # absolute byte offset of its data in `file`
    nbytes: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def root_of(folder: str | Path) -> Path:
    """The directory a checkpoint's files must lie in: the checkpoint directory itself, or for a snapshot of the
    Hugging Face cache (`models--ORG--NAME/snapshots/REV`, whose files are symbolic links into `../../blobs/`),
    that repository's cache folder `models--ORG--NAME`."""
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def contained(folder: str | Path, name: str, what: str = "file") -> Path:
    """`folder/name`, refused unless it is a regular file whose real path lies inside the checkpoint (root_of)."""
    folder = Path(folder)
    path = folder / name
    real, root = Path(os.path.realpath(path)), root_of(folder)
    if root not in real.parents:
        where = f"the checkpoint directory {folder}" if root == Path(os.path.realpath(folder)) else \
            f"its Hugging Face cache folder {root}"
        raise CheckpointError(f"{path} leads outside {where}; copy the file into the checkpoint instead of linking it")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        broken = " (a dangling symbolic link)" if os.path.islink(path) else ""
        raise CheckpointError(f"{folder}: {what} {name} is missing{broken}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file")
    return path


def check_dir(folder: str | Path) -> Path:
    """A checkpoint directory whose top-level files (what moekit and transformers read: configs, metadata,
    tokenizer files, weights) are all regular files inside it (symbolic links included: `contained`); subfolders
    must lie inside it too. Raises CheckpointError naming the first that is not."""
    folder = Path(folder)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise CheckpointError(f"cannot read the checkpoint directory {folder}: {os.strerror(e.errno or 0)}") from None
    root = root_of(folder)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            continue
        if e.is_symlink() and os.path.isdir(e.path):  # False for a link loop (DirEntry.is_dir raises ELOOP)
            if root not in Path(os.path.realpath(e.path)).parents:
                raise CheckpointError(f"{e.path} leads outside the checkpoint directory {folder}")
            continue
        contained(folder, e.name)
    return folder


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")  # what peft saves


def refuse_adapter(folder: str | Path) -> None:
    """Refuse a directory holding a PEFT adapter: transformers' from_pretrained would apply it to the weights beside
    it while every reader of the weights themselves (streaming, upcycling, pruning) would not, so one directory would
    give two models. moekit reads whole models only."""
    found = [name for name in ADAPTER_FILES if os.path.lexists(Path(folder) / name)]
    if found:
        raise CheckpointError(f"{folder} holds a PEFT adapter ({found[0]}); moekit reads only whole models: merge it "
                              "into its base model first (peft's merge_and_unload, then save_pretrained) and give that "
                              "directory")


def open_file(folder: str | Path, name: str, what: str = "file") -> int:
    """A read-only descriptor of `folder/name`, checked after opening: the file it opened is a regular file, and
    it is the one at a real path inside the checkpoint (so nothing swapped in after the check is read)."""
    path = contained(folder, name, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {os.strerror(e.errno or 0)}") from None
    st = os.fstat(fd)
    try:
        real = Path(os.path.realpath(path))
        here = os.stat(real)
        ok = stat.S_ISREG(st.st_mode) and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino) \
            and root_of(folder) in real.parents
    except OSError:
        ok = False
    if not ok:
        os.close(fd)
        raise CheckpointError(f"{path} changed while it was being opened; it is not read")
    return fd


def read_text(folder: str | Path, name: str, what: str, limit: int = 64 << 20) -> str:
    """The UTF-8 text of a small checkpoint file (config, metadata, index), read through `open_file`."""
    fd = open_file(folder, name, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{what} {Path(folder) / name} is {size / 2**20:.0f} MiB; more than "
                                  f"{limit >> 20} MiB is refused")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"cannot read {what} {Path(folder) / name}: {e}") from None


def copy_file(folder: str | Path, name: str, dst: Path) -> None:
    """Copy `folder/name` to `dst` from a descriptor checked by `open_file` (symbolic links inside the checkpoint,
    such as the Hugging Face cache's, are followed; nothing else is)."""
    fd = open_file(folder, name)
    try:
        with os.fdopen(os.dup(fd), "rb") as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    finally:
        os.close(fd)


def _plain_name(folder: Path, name: object) -> str:
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", "..") \
            or "\x00" in name:
        where = "an absolute path" if isinstance(name, str) and os.path.isabs(name) else "not a plain file name"
        raise CheckpointError(f"{folder / INDEX}: shard name {name!r} is {where}; the index must name files "
                              "inside the checkpoint directory")
    return name


def weight_map(folder: str | Path) -> dict[str, Path] | None:
    """{tensor name: shard} from model.safetensors.index.json (None without an index), shard names checked."""
    folder = Path(folder)
    if not ((folder / INDEX).exists() or (folder / INDEX).is_symlink()):
        return None
    try:
        index = json.loads(read_text(folder, INDEX, "index"))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{folder / INDEX} is not valid JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{folder / INDEX} has no weight_map")
    names = [_plain_name(folder, name) for name in wmap.values()]  # all strings before any is hashed
    shards = {name: contained(folder, name, "weight file") for name in sorted(set(names))}
    return {key: shards[name] for key, name in wmap.items()}


def weight_files(folder: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, validated (see the module docstring)."""
    folder = Path(folder)
    wmap = weight_map(folder)
    if wmap is not None:
        return sorted(set(wmap.values()))
    if (folder / SINGLE).exists() or (folder / SINGLE).is_symlink():
        return [contained(folder, SINGLE, "weight file")]
    raise CheckpointError(f"no safetensors weights in {folder}")


def read_header(f: Path, fd: int) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file (open as `fd`), validated as safetensors does (no tensor data is read)."""
    try:
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if size < 8 or n > min(MAX_HEADER, size - 8):
            raise ValueError("invalid header length")
        header = json.loads(os.pread(fd, n, 8))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{f} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f} is not a readable safetensors file (header is not a mapping)")
    out, spans = {}, []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = v["dtype"], tuple(v["shape"]), v["data_offsets"]
            ok = dtype in DTYPES and all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end \
                and isinstance(begin, int) and isinstance(end, int) and math.prod(d or 1 for d in shape) < 2**63
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize if ok else -1
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or end - begin != nbytes:
            raise CheckpointError(f"{f} is not a readable safetensors file (bad entry for {key!r})")
        out[key] = TensorInfo(dtype, shape, f, 8 + n + begin, nbytes)
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{f} is not a readable safetensors file (tensor data overlaps or has gaps)")
        position = end
    if 8 + n + position != size:
        raise CheckpointError(f"{f} is not a readable safetensors file (truncated or padded: the header covers "
                              f"{8 + n + position} of {size} bytes)")
    return out


def read_headers(folder: str | Path, fds: dict[Path, int] | None = None) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape, file and offset, from the shard headers (no tensor data is read). Each shard
    is opened once (`open_file`); with `fds`, the descriptors are kept there for reading, else closed."""
    folder = Path(folder)
    wmap = weight_map(folder)
    out: dict[str, TensorInfo] = {}
    opened = {} if fds is None else fds
    try:
        for f in weight_files(folder):
            opened[f] = open_file(folder, f.name, "weight file")
            for key, info in read_header(f, opened[f]).items():
                if key in out:
                    raise CheckpointError(f"{folder}: tensor {key} is stored twice ({out[key].file.name}, {f.name})")
                out[key] = info
    finally:
        if fds is None:
            for fd in opened.values():
                os.close(fd)
    if wmap is not None:
        wrong = [k for k, f in wmap.items() if k not in out or out[k].file != f]
        if wrong:
            raise CheckpointError(f"{folder / INDEX} lists tensors its shards do not hold: {wrong[:3]}")
    return out


def quantization(folder: str | Path) -> Scaled | Mxfp4 | None:
    """The quantization config.json declares (moekit.checkpoint.quantized.parse_quantization): None for a float
    checkpoint, or where there is no readable config.json (the loaders report that); CheckpointError for one moekit
    does not read."""
    if not (Path(folder) / "config.json").is_file():
        return None
    try:
        data = json.loads(read_text(folder, "config.json", "config"))
    except (CheckpointError, ValueError, RecursionError):
        return None
    return parse_quantization(data, folder) if isinstance(data, dict) else None


class ShardReader:
    """Reads a validated checkpoint one tensor (or one slice along dim 0) at a time with pread, from the
    descriptors its headers were read from. The weights of a quantized checkpoint (FP8, compressed-tensors, MXFP4) are
    listed and read as the model holds them, dequantized to float32, and their scales and blocks are not listed
    (moekit.checkpoint.quantized); with `dequantize=False` every tensor is listed and read as stored."""

    def __init__(self, folder: str | Path, dequantize: bool = True):
        self.folder = Path(folder)
        self.built: dict[str, list[str]] = {}  # {a model's tensor: the stored tensors it is built from} (rename)
        self._fds: dict[Path, int] = {}
        try:
            fmt = quantization(self.folder)  # any other quantization is refused here
            self.headers = read_headers(self.folder, self._fds)
            self.scaled = fmt if isinstance(fmt, Scaled) and dequantize else None
            # {weight: its int32 words}, {weight: (scales, zero points)}, {weight: (blocks, scales)}: the tensors a
            # quantized weight is read from
            self.words = split_words(self.headers, fmt, self.folder, lambda n, i: self._read(n, i, None)) \
                if self.scaled and fmt.bits else {}
            self.scales = split_scales(self.headers, fmt, self.folder) if self.scaled else {}
            self.packed = split_packed(self.headers, self.folder) if isinstance(fmt, Mxfp4) and dequantize else {}
            if lost := next((w for w in self.words if w not in self.scales), None):
                raise CheckpointError(f"{self.folder}: {lost}{PACKED_WORDS} has no {lost}{fmt.suffix}")
        except BaseException:
            self.close()
            raise

    def __contains__(self, name: str) -> bool:
        return name in self.headers

    def rename(self, names: dict[str, str], built: dict[str, list[str]],
               parts: dict[str, list[str]] | None = None) -> None:
        """Serve stored tensor k as names[k] from now on (one to one; two stored tensors that would get one name are
        refused); `built` records the model tensors that are made of several stored ones, for messages. `parts`:
        {stored tensor: the model tensors it holds along dim 0, in order}, split as torch.chunk splits it (HRM-Text's
        gqkv_proj into gate, q, k and v): each served as its own rows of the stored bytes."""
        renamed: dict[str, str] = {}
        for k in self.headers:
            other = renamed.setdefault(names.get(k, k), k)
            if other != k:
                raise CheckpointError(f"{self.folder} holds both {other} and {k}, which load as one tensor "
                                      f"{names.get(k, k)}")
        for k, targets in (parts or {}).items():
            info = self.headers.pop(k)
            size = -(-info.shape[0] // len(targets))  # torch.chunk's
            row = info.nbytes // info.shape[0]
            for i, name in zip(range(-(-info.shape[0] // size)), targets):  # as many parts as torch.chunk makes
                if name in renamed:
                    raise CheckpointError(f"{self.folder} holds both {renamed[name]} and {k}, which load as {name}")
                n = min(size, info.shape[0] - i * size)
                self.headers[name] = replace(info, shape=(n, *info.shape[1:]), start=info.start + i * size * row,
                                             nbytes=n * row)
        self.headers = {names.get(k, k): v for k, v in self.headers.items()}
        self.words, self.scales, self.packed = ({names.get(k, k): v for k, v in d.items()}
                                                for d in (self.words, self.scales, self.packed))
        self.built = built

    def keys(self) -> list[str]:
        return list(self.headers)

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` in its stored dtype (a quantized weight: dequantized, in float32), or its `index`-th slice
        along dim 0."""
        info = self.headers.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder} has no tensor {name}")
        if name in self.packed:
            blocks, scales = self.packed[name]
            return unpack_mxfp4(self._read(name + "_blocks", blocks, index), self._read(name + "_scales", scales, index))
        if name not in self.scales or self.scaled is None:
            return self._read(name, info, index)
        block = self.scaled.resolve(info.shape)
        if index is not None and block and len(info.shape) == 2:  # a row of a weight in blocks of rows
            return self.get(name)[index]
        at = index if block else None  # blocks: (..., ⌈O/bo⌉, ⌈I/bi⌉); one scale for the tensor: whole
        scale, zero = self.scales[name]
        s = self._read(name + self.scaled.suffix, scale, at)
        z = None if zero is None else self._read(name + str(self.scaled.zero), zero, at)
        if name not in self.words:
            return dequantize(self._read(name, info, index), s, block, z)
        bits = self.scaled.bits
        q = unpack_ints(self._read(name + PACKED_WORDS, self.words[name], index), bits, info.shape[-1])
        if z is not None and self.scaled.packed_zero:  # packed along O: (..., ⌈O·bits/32⌉, G)
            z = unpack_ints(z.transpose(-1, -2), bits, q.shape[-2]).transpose(-1, -2)
        return dequantize(q, s, block, z)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start .. stop - 1 of tensor `name` along dim 0, read at once (a quantized weight: read whole and
        cut)."""
        info = self.headers.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder} has no tensor {name}")
        if name in self.scales or name in self.packed:
            return self.get(name)[start:stop]
        return self._read(name, info, slice(start, stop))

    def _read(self, name: str, info: TensorInfo, index: int | slice | None) -> torch.Tensor:
        shape, start, nbytes = info.shape, info.start, info.nbytes
        if isinstance(index, slice) and shape:  # rows along dim 0
            first, last, _ = index.indices(shape[0])
            row = nbytes // shape[0] if shape[0] else 0
            start, nbytes, shape = start + first * row, max(0, last - first) * row, (max(0, last - first), *shape[1:])
        elif index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise CheckpointError(f"{self.folder}: {name} {list(shape)} has no slice {index}")
            nbytes //= shape[0]
            start, shape = start + index * nbytes, shape[1:]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        fd = self._fds[info.file]
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise CheckpointError(f"{info.file} ended while reading {name} (truncated while in use?)")
            done += n
        return buf.view(info.torch_dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # a reader dropped on an error path (a refused upcycle) closes its files too
        self.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
