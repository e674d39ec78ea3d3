"""Safetensors checkpoints as untrusted input: which files hold the weights, and what their headers say.

Nothing here allocates a tensor. A shard name must be a plain file name that resolves inside the checkpoint
directory (no `..`, no absolute path, no symbolic link leading out, no device or FIFO); every shard's header
must parse and its data must cover the file exactly (safetensors checks that), and the index must agree
with the headers. Anything else is one CheckpointError naming the file.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from moekit._fs import read_small
from moekit.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a shard header declares it."""

    dtype: str  # safetensors dtype name: F32, BF16, F16, I64, ...
    shape: tuple[int, ...]
    file: Path


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


def read_headers(folder: str | Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape and file, from the shard headers (no tensor data is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    wmap = weight_map(folder)
    out: dict[str, TensorInfo] = {}
    for f in weight_files(folder):
        try:
            with safe_open(f, framework="pt") as h:
                for key in h.keys():
                    s = h.get_slice(key)
                    out[key] = TensorInfo(s.get_dtype(), tuple(s.get_shape()), f)
        except Exception as e:  # noqa: BLE001  (SafetensorError and OSError from a damaged file)
            raise CheckpointError(f"{f} is not a readable safetensors file ({e})") from None
    if wmap is not None:
        wrong = [k for k, f in wmap.items() if k not in out or out[k].file != f]
        if wrong:
            raise CheckpointError(f"{folder / INDEX} lists tensors its shards do not hold: {wrong[:3]}")
    return out
