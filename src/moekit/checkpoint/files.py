"""Safetensors checkpoints as untrusted input: which files hold the weights, what their headers say, and
reading one tensor (or one expert's slice of it) at a time.

Nothing here maps a file or allocates more than the tensor asked for. A shard name must be a plain file name
that resolves inside the checkpoint directory (no `..`, no absolute path, no symbolic link leading out, no
device or FIFO); every header is parsed and checked as safetensors itself does (size, JSON, dtypes, shapes,
data offsets that cover the data exactly), and the index must agree with the headers. Anything else is one
CheckpointError naming the file. Tensors are read with pread into their own buffer (no mmap), so the
resident memory of a streaming pass is what it holds, not what it has read.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit._fs import read_small
from moekit.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 << 20  # safetensors' own limit
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
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


def _shard(folder: Path, name: object) -> Path:
    """`folder/name`, refused unless it is a regular file inside `folder`."""
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
        raise CheckpointError(f"{folder / INDEX}: shard name {name!r} is not a plain file name inside the checkpoint")
    path = folder / name
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    if real.parent != root:
        raise CheckpointError(f"{path} leads outside the checkpoint directory {folder}")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        raise CheckpointError(f"{folder}: weight file {name} is missing") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file")
    return path


def weight_map(folder: str | Path) -> dict[str, Path] | None:
    """{tensor name: shard} from model.safetensors.index.json (None without an index), shard names checked."""
    folder = Path(folder)
    if not (folder / INDEX).exists():
        return None
    try:
        index = json.loads(read_small(folder / INDEX, "index", CheckpointError))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{folder / INDEX} is not valid JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{folder / INDEX} has no weight_map")
    shards = {name: _shard(folder, name) for name in set(wmap.values()) if isinstance(name, str)}
    return {key: shards.get(name) or _shard(folder, name) for key, name in wmap.items()}


def weight_files(folder: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, validated (see the module docstring)."""
    folder = Path(folder)
    wmap = weight_map(folder)
    if wmap is not None:
        return sorted(set(wmap.values()))
    if (folder / SINGLE).exists() or (folder / SINGLE).is_symlink():
        return [_shard(folder, SINGLE)]
    raise CheckpointError(f"no safetensors weights in {folder}")


def read_header(f: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, validated as safetensors does (no tensor data is read)."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > min(MAX_HEADER, size - 8):
                raise ValueError("invalid header length")
            header = json.loads(fh.read(n))
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
                and isinstance(begin, int) and isinstance(end, int)
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


def read_headers(folder: str | Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape, file and offset, from the shard headers (no tensor data is read)."""
    folder = Path(folder)
    wmap = weight_map(folder)
    out: dict[str, TensorInfo] = {}
    for f in weight_files(folder):
        for key, info in read_header(f).items():
            if key in out:
                raise CheckpointError(f"{folder}: tensor {key} is stored twice ({out[key].file.name}, {f.name})")
            out[key] = info
    if wmap is not None:
        wrong = [k for k, f in wmap.items() if k not in out or out[k].file != f]
        if wrong:
            raise CheckpointError(f"{folder / INDEX} lists tensors its shards do not hold: {wrong[:3]}")
    return out


class ShardReader:
    """Reads a validated checkpoint one tensor (or one slice along dim 0) at a time with pread."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.headers = read_headers(self.folder)
        self._fds: dict[Path, int] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.headers

    def keys(self) -> list[str]:
        return list(self.headers)

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` in its stored dtype, or its `index`-th slice along dim 0."""
        info = self.headers.get(name)
        if info is None:
            raise CheckpointError(f"{self.folder} has no tensor {name}")
        shape, start, nbytes = info.shape, info.start, info.nbytes
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise CheckpointError(f"{self.folder}: {name} {list(shape)} has no slice {index}")
            nbytes //= shape[0]
            start, shape = start + index * nbytes, shape[1:]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        fd = self._fd(info.file)
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise CheckpointError(f"{info.file} ended while reading {name} (truncated while in use?)")
            done += n
        return buf.view(info.torch_dtype).reshape(shape)

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
