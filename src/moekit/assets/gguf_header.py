"""Every count a GGUF file declares, checked against the bytes that hold it, before gguf's reader loops over it.

gguf's GGUFReader (gguf 0.x) reads a metadata array's or the tensor table's declared length and loops that many
times, appending a view per item; past the end of the file its views are empty, so a damaged length of 2**40 runs
for hours and takes gigabytes (bench/fuzz.py, gguf cases 505 and 930: 4.3 GiB after 60 s). This walk reads the
header, the key-value metadata and the tensor infos (GGUF v2/v3: little- or big-endian) with struct on a memory map,
and refuses a count whose smallest possible encoding does not fit in the rest of the file. It never reads tensor data.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from moekit.errors import AssetError

SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUFValueType
STRING, ARRAY = 8, 9
MIN_ITEM = {STRING: 8, ARRAY: 12, **{t: struct.calcsize(c) for t, c in SCALAR.items()}}  # bytes of the smallest item
MAX_DIMS = 8  # GGML_MAX_DIMS is 4


class _Walk:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.off = data, path, 0
        version = struct.unpack_from("<I", data, 4)[0]
        self.order = ">" if version & 0xFFFF == 0 else "<"  # as gguf's reader tells a big-endian file

    def fail(self, what: str) -> AssetError:
        return AssetError(f"GGUF checkpoint {self.path}: {what} at byte {self.off} does not fit in its "
                          f"{len(self.data):,} bytes")

    def read(self, code: str, what: str) -> int:
        size = struct.calcsize(code)
        if self.off + size > len(self.data):
            raise self.fail(what)
        (value,) = struct.unpack_from(self.order + code, self.data, self.off)
        self.off += size
        return value

    def count(self, what: str, item: int) -> int:
        """A declared count whose items (at least `item` bytes each) fit in the rest of the file."""
        n = self.read("Q", what)
        if n * item > len(self.data) - self.off:
            raise self.fail(f"{what} {n:,}")
        return n

    def skip(self, n: int, what: str) -> None:
        if self.off + n > len(self.data):
            raise self.fail(what)
        self.off += n

    def string(self, what: str) -> None:
        self.skip(self.count(f"{what} length", 1), what)

    def value(self, kind: int, what: str) -> None:
        if kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            item = self.read("I", f"{what} item type")
            if item not in MIN_ITEM:
                raise AssetError(f"GGUF checkpoint {self.path}: {what} has items of unknown type {item}")
            n = self.count(f"{what} array length", MIN_ITEM[item])
            if item in SCALAR:
                self.skip(n * MIN_ITEM[item], what)
            else:
                for _ in range(n):
                    self.value(item, what)
        elif kind in SCALAR:
            self.skip(MIN_ITEM[kind], what)
        else:
            raise AssetError(f"GGUF checkpoint {self.path}: {what} has unknown value type {kind}")


def check_gguf_counts(path: Path) -> None:
    """Refuse (AssetError) a GGUF file whose header, metadata or tensor table declares more than its bytes hold."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or f.seek(0, 2) < 24:
            raise AssetError(f"GGUF checkpoint {path}: not a GGUF file (no GGUF magic and header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            walk = _Walk(data, path)
            walk.off = 8
            tensors = walk.count("tensor count", 24)  # name length, dims count, type, offset
            entries = walk.count("metadata count", 12)  # key length, value type
            for i in range(entries):
                walk.string(f"metadata key {i}")
                walk.value(walk.read("I", f"metadata value type {i}"), f"metadata entry {i}")
            for i in range(tensors):
                walk.string(f"tensor {i} name")
                dims = walk.read("I", f"tensor {i} dimension count")
                if dims > MAX_DIMS:
                    raise AssetError(f"GGUF checkpoint {path}: tensor {i} declares {dims} dimensions")
                walk.skip(8 * dims + 12, f"tensor {i} info")
