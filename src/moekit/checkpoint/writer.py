"""Sharded safetensors written as the tensors are produced, without holding them.

Every output tensor's name, shape and dtype is planned first (from a model on the meta device), so each
shard's header is final before any data exists: the writer writes the headers, then each tensor (or one
slice of it along dim 0, e.g. one expert of a stacked (E, ...) tensor) with pwrite at its planned offset,
in any order. Shards fill up to `max_shard_bytes` as transformers does (a larger tensor gets a shard of its
own), named as transformers names them, with model.safetensors.index.json when there are several. `close`
checks that every byte was written exactly once.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moekit.checkpoint.files import DTYPE_NAMES, INDEX, SINGLE
from moekit.errors import CheckpointError

DEFAULT_SHARD = 5 * 10**9  # transformers' default max_shard_size ("5GB")


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / 1000 -> bytes (decimal units as transformers, binary with 'i')."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or not 0 < value < float("inf") or value * units[unit] >= 2**63:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB; under 8 EiB)")
    return int(value * units[unit])


@dataclass
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _Slot:
    file: Path
    start: int  # absolute offset of the tensor's data
    planned: Planned
    written: set = field(default_factory=set)  # slices written (None = the whole tensor)


class ShardWriter:
    """Write the planned tensors of one checkpoint into `folder` (see the module docstring)."""

    def __init__(self, folder: str | Path, plan: list[Planned], max_shard_bytes: int = DEFAULT_SHARD,
                 metadata: dict[str, str] | None = None):
        self.folder = Path(folder)
        names = [p.name for p in plan]
        if len(set(names)) != len(names):
            raise ValueError("a tensor is planned twice")
        shards: list[list[Planned]] = [[]]
        size = 0
        for p in plan:
            if shards[-1] and size + p.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(p)
            size += p.nbytes
        self.files = [SINGLE] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                        for i in range(1, len(shards) + 1)]
        self.slots: dict[str, _Slot] = {}
        self._fd_of: dict[Path, int] = {}
        self._read_fd: dict[Path, int] = {}
        for fname, tensors in zip(self.files, shards):
            self._open(self.folder / fname, tensors, metadata or {"format": "pt"})
        self.total = sum(p.nbytes for p in plan)

    def _open(self, path: Path, tensors: list[Planned], metadata: dict) -> None:
        header, offsets, offset = {"__metadata__": metadata}, [], 0
        for p in tensors:
            header[p.name] = {"dtype": DTYPE_NAMES[p.dtype], "shape": list(p.shape),
                              "data_offsets": [offset, offset + p.nbytes]}
            offsets.append(offset)
            offset += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._fd_of[path] = fd
        _pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(fd, 8 + len(raw) + offset)
        for p, begin in zip(tensors, offsets):
            self.slots[p.name] = _Slot(path, 8 + len(raw) + begin, p)

    def write(self, name: str, tensor: torch.Tensor | list[torch.Tensor], index: int | None = None) -> None:
        """Write tensor `name` (cast to its planned dtype), or its `index`-th slice along dim 0; a list of
        tensors is written as their concatenation along dim 0."""
        slot = self.slots.get(name)
        if slot is None:
            raise CheckpointError(f"tensor {name} was not planned for this checkpoint")
        p, parts = slot.planned, tensor if isinstance(tensor, list) else [tensor]
        shape = p.shape if index is None else p.shape[1:]
        got = (sum(t.shape[0] for t in parts), *parts[0].shape[1:]) if parts[0].dim() else ()
        if tuple(got) != tuple(shape) or (index is not None and not 0 <= index < p.shape[0]):
            raise CheckpointError(f"{name}: got {list(got)} for slice {index}, planned {list(p.shape)}")
        if index in slot.written or (slot.written and (index is None or None in slot.written)):
            raise CheckpointError(f"{name} (slice {index}) is written twice")
        slot.written.add(index)
        start = slot.start + (0 if index is None else index * (p.nbytes // p.shape[0]))
        for t in parts:
            data = t.detach().to(device="cpu", dtype=p.dtype).contiguous().reshape(-1).view(torch.uint8)
            _pwrite(self._fd_of[slot.file], memoryview(data.numpy()), start)
            start += data.numel()

    def read(self, name: str, index: int | None, rows: tuple[int, int]) -> torch.Tensor:
        """Rows [a, b) of slice `index` of tensor `name` (of the tensor itself when `index` is None) as written (in
        its planned dtype): a layer just written is read back from the page cache, e.g. to measure it
        (moekit.checkpoint.stream)."""
        slot = self.slots[name]
        p = slot.planned
        inner = p.shape if index is None else p.shape[1:]  # the (rows, ...) tensor read from
        row = math.prod(inner[1:]) * p.dtype.itemsize
        start = slot.start + (0 if index is None else index * (p.nbytes // p.shape[0])) + rows[0] * row
        size = (rows[1] - rows[0]) * row
        if slot.file not in self._read_fd:
            self._read_fd[slot.file] = os.open(slot.file, os.O_RDONLY)
        buf = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < size:
            done += os.preadv(self._read_fd[slot.file], [view[done:]], start + done)
        return buf.view(p.dtype).reshape(rows[1] - rows[0], *inner[1:])

    def abort(self) -> None:
        """Close the files after a failure (the caller removes the directory)."""
        for fd in [*self._fd_of.values(), *self._read_fd.values()]:
            os.close(fd)
        self._fd_of.clear()
        self._read_fd.clear()

    def close(self) -> None:
        """Check completeness, write the index (several shards) and close the files."""
        missing = [n for n, s in self.slots.items()
                   if None not in s.written and len(s.written) != (s.planned.shape[0] if s.planned.shape else 1)]
        for fd in self._fd_of.values():
            os.fsync(fd)
        self.abort()
        if missing:
            raise CheckpointError(f"internal error: tensors never written: {missing[:3]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {n: s.file.name for n, s in self.slots.items()}}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2))


def _pwrite(fd: int, data, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
