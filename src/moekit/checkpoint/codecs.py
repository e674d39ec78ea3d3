"""Model state that a method adds to a model (a field of moekit.moe.state.ModelState) and how a checkpoint keeps it:
the one extension point of the checkpoint formats for state they do not know.

A StateCodec names its field and its file. It either rides along another format (`write` beside the weights of a
moekit or transformers checkpoint when the field is set; `read` re-applies the file to the model loaded from such a
checkpoint: the disabled experts of moekit.selection.prune) or is a format of its own (`save` writes the whole
checkpoint of a model whose field is set; `load` reads a checkpoint that holds its file: SIMoE's simoe.json).

Codecs are found as entry points of the group `moekit.state_codecs` (pyproject.toml), loaded the first time a
checkpoint is saved or loaded: checkpoint/ never imports the modules that define them, and another package adds one
the same way.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from torch import nn

from moekit.errors import CheckpointError
from moekit.moe.state import model_state

GROUP = "moekit.state_codecs"


@dataclass(frozen=True)
class StateCodec:
    field: str  # the ModelState field it keeps
    file: str  # its file in a checkpoint directory
    write: Callable[[nn.Module, Path], None] | None = None  # beside another format's files (field set)
    read: Callable[[nn.Module, Path], nn.Module] | None = None  # applies `file` to a model loaded beside it
    save: Callable[[nn.Module, Path], None] | None = None  # the whole checkpoint into an existing folder (field set)
    load: Callable[[Path], nn.Module] | None = None  # a checkpoint holding `file`, in the codec's own format


@functools.cache
def codecs() -> tuple[StateCodec, ...]:
    """Every registered codec (entry points of GROUP), in name order."""
    found = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        codec = ep.load()
        if not isinstance(codec, StateCodec):
            raise CheckpointError(f"entry point {ep.name} = {ep.value} of {GROUP} is not a StateCodec")
        found.append(codec)
    return tuple(found)


def is_set(model: nn.Module, codec: StateCodec) -> bool:
    return bool(getattr(model_state(model), codec.field))


def own_format(folder: str | Path) -> StateCodec | None:
    """The codec whose own format `folder` holds (its file is there), if any."""
    return next((c for c in codecs() if c.load is not None and (Path(folder) / c.file).is_file()), None)


def own_writer(model: nn.Module) -> StateCodec | None:
    """The codec that saves `model` in its own format (its field is set), if any."""
    return next((c for c in codecs() if c.save is not None and is_set(model, c)), None)


def write_state(model: nn.Module, folder: Path) -> None:
    """The files of every riding codec whose field is set on `model`, into `folder`."""
    for c in codecs():
        if c.write is not None and is_set(model, c):
            c.write(model, folder)


def read_state(model: nn.Module, folder: str | Path) -> nn.Module:
    """`model` (loaded from `folder`) with the state of every riding codec whose file `folder` holds."""
    for c in codecs():
        if c.read is not None and (Path(folder) / c.file).is_file():
            model = c.read(model, folder)
    return model
