"""Streaming checkpoints: upcycle a dense safetensors checkpoint, or export a moekit one to a native MoE
format, reading one tensor at a time and writing it as soon as it exists.

The model is only ever built on the meta device (shapes, names, the MoE layout, the checks of a native
format). The output is planned from it (moekit.checkpoint.writer), then written unit by unit: a tensor
copied from the source (cast to the output dtype; for BTX the mean over the branches), or one MoE layer whose
experts are made one at a time (moekit.checkpoint.parts). Memory holds one dense FFN in float32, one expert
and the per-layer state of the init method (e.g. one SVD block), never a whole layer or model.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit.checkpoint.files import ShardReader
from moekit.checkpoint.format import unique_tensors
from moekit.checkpoint.parts import Item, LayerParts, item_shape, moekit_items, per_expert
from moekit.checkpoint.writer import Planned, ShardWriter
from moekit.errors import CheckpointError, NumericsError
from moekit.moe.ffn import FFNWeights
from moekit.init.base import InitContext
from moekit.moe.diversity import diversity_by_rows
from moekit.moe.build import from_layout, layout
from moekit.moe.layer import MoELayer, moe_layers
from moekit.moe.router import Router
from moekit.moe.spec import MoESpec
from moekit.progress import report
from moekit.surgery import Slot, slot_at
from moekit.checkpoint.upcycle_model import release_freed_memory
from moekit.moe.state import model_state



def check_finite(t: Tensor, what: str) -> None:
    """NumericsError if `t` holds NaN or Inf (min and max in one pass: NaN propagates, no bool copy)."""
    if t.is_floating_point() and t.numel() and not all(map(math.isfinite, map(float, torch.aminmax(t)))):
        bad = int((~torch.isfinite(t)).sum())
        raise NumericsError(f"{what} has {bad} non-finite value{'s' * (bad > 1)} (NaN or Inf); pass "
                            "allow_nonfinite=True to proceed anyway")


# ----------------------------------------------------------------------------------------- units


@dataclass
class Copy:
    """Output tensor `name` = source tensor `source` (the mean over several readers, for BTX branches)."""

    name: str
    source: str
    readers: list[ShardReader]
    finite: bool = True  # refuse NaN/Inf

    def plan(self, dtype: torch.dtype) -> list[Planned]:
        info = self.readers[0].headers[self.source]
        return [Planned(self.name, info.shape, dtype if info.torch_dtype.is_floating_point else info.torch_dtype)]

    def items(self) -> Iterator[Item]:
        tensors = [r.get(self.source) for r in self.readers]
        t = tensors[0] if len(tensors) == 1 or not tensors[0].is_floating_point() else \
            torch.stack([x.float() for x in tensors]).mean(0)  # BTX: branch mean, as moekit.upcycle
        if self.finite:
            check_finite(t, f"{self.readers[0].folder}: {self.source}")
        yield self.name, t, None


@dataclass
class Const:
    name: str
    tensor: Tensor

    def plan(self, dtype: torch.dtype) -> list[Planned]:
        return [Planned(self.name, tuple(self.tensor.shape), dtype)]

    def items(self) -> Iterator[Item]:
        yield self.name, self.tensor, None


@dataclass
class Layer:
    """One MoE layer at `prefix`: `parts()` makes its weights when written, `meta` gives the shapes; `path` is the
    layer's module path (the prefix without its dot unless a format names the MoE block otherwise, e.g. Mixtral's
    block_sparse_moe)."""

    prefix: str
    parts: Callable[[], LayerParts]
    meta: MetaParts
    naming: Callable[[LayerParts], Iterator[Item]]
    path: str = ""

    def __post_init__(self):
        self.path = self.path or self.prefix.removesuffix(".")

    def plan(self, dtype: torch.dtype) -> list[Planned]:
        """Names and shapes from the naming of one meta expert (stacked tensors get the layer's E rows, per-expert
        names one tensor per expert)."""
        shapes: dict[str, tuple[int, ...]] = {}
        E = self.meta.num_experts
        for name, t, i in self.naming(self.meta.one()):
            if per_expert(name):
                for e in range(E):
                    shapes.setdefault(name.format(e), item_shape(t))
            else:
                shapes.setdefault(name, item_shape(t) if i is None else (E, *item_shape(t)))
        return [Planned(self.prefix + name, shape, dtype) for name, shape in shapes.items()]

    def items(self) -> Iterator[Item]:
        for name, t, i in self.naming(self.parts()):
            if per_expert(name):
                yield self.prefix + name.format(i), t, None
            else:
                yield self.prefix + name, t, i


def write_units(folder: Path, units: list, dtype: torch.dtype, max_shard_bytes: int, task: str = "writing",
                diversities: dict[str, float] | None = None) -> int:
    """Plan, then write every unit into `folder`; returns the bytes of tensor data written. Reports each MoE
    layer written as progress of `task` (moekit.progress). With `diversities`, each MoE layer's diversity as
    written is put there under its path."""
    writer = ShardWriter(folder, [p for u in units for p in u.plan(dtype)], max_shard_bytes)
    layers, done = sum(isinstance(u, Layer) for u in units), 0
    try:
        for u in units:
            for name, t, i in u.items():
                writer.write(name, t, i)
            if isinstance(u, Layer):
                if diversities is not None:
                    diversities[u.path] = written_diversity(writer, u)
                release_freed_memory()  # hand this layer's temporaries back before the next (see there)
                done += 1
                report(task, done, layers, u.path)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.total


# the routed down-projections in every format written: stacked (E, H, I), or one (H, I) tensor per expert
ROUTED_DOWN = ("experts.down", "experts.down_proj", "experts.{}.down_proj.weight", "experts.{}.w2.weight")


def routed_down(names, prefix: str) -> tuple[str, bool]:
    """(name, per expert) of the routed down-projections of the MoE layer at `prefix` among `names`."""
    return next((prefix + n, per_expert(n)) for n in ROUTED_DOWN if prefix + n.format(0) in names)


def written_diversity(writer: ShardWriter, layer: Layer, chunk_bytes: int = 1 << 27) -> float:
    """The diversity (moekit.moe.diversity.expert_diversity) of the routed experts of `layer` as just written, read
    back from the page cache in row chunks of about `chunk_bytes`."""
    name, separate = routed_down(writer.slots, layer.prefix)
    E = layer.meta.num_experts
    if separate:
        shape = (E, *writer.slots[name.format(0)].planned.shape)  # (E, H, I)
        return diversity_by_rows(shape, lambda a, b: torch.stack([writer.read(name.format(e), None, (a, b))
                                                                  for e in range(E)]), chunk_bytes)
    shape = writer.slots[name].planned.shape  # (E, H, I)
    return diversity_by_rows(shape, lambda a, b: torch.stack([writer.read(name, e, (a, b)) for e in range(shape[0])]),
                             chunk_bytes)


def planned_bytes(units: list, dtype: torch.dtype) -> int:
    return sum(p.nbytes for u in units for p in u.plan(dtype))


# ------------------------------------------------------------------------------------------ parts


class MetaParts(LayerParts):
    """Shapes only: zeros on the meta device for a recorded layout (moekit.moe.build.layout)."""

    def __init__(self, lay: dict):
        super().__init__(from_layout(lay))  # built under torch.device("meta") by the caller

    def one(self) -> MetaParts:
        """The same parts presenting a single expert (planning costs O(1) whatever E is)."""
        view = copy.copy(self)
        view.num_experts = 1
        return view


class StoredParts(LayerParts):
    """The parts of MoE layer `path` of a moekit checkpoint, read slice by slice."""

    def __init__(self, reader: ShardReader, path: str, lay: dict, router_of: str):
        self.reader, self.path, self.lay, self.router_of = reader, path, lay, router_of
        self.num_experts, self.hidden_size = lay["num_experts"], lay["hidden_size"]

    def expert(self, i: int) -> FFNWeights:
        r, p, lay, I = self.reader, self.path, self.lay, self.lay["intermediate_size"]
        first = r.get(f"{p}.experts.{'gate_up' if lay['gated'] else 'up'}", i)  # (2I | I, H)
        fb = r.get(f"{p}.experts.first_bias", i) if lay["bias"] else None
        gated = lay["gated"]
        return FFNWeights(up=first[I:] if gated else first, down=r.get(f"{p}.experts.down", i), act=lay["act"],
                          gate=first[:I] if gated else None,
                          up_bias=None if fb is None else (fb[I:] if gated else fb),
                          gate_bias=None if fb is None or not gated else fb[:I],
                          down_bias=r.get(f"{p}.experts.down_bias", i) if lay["bias"] else None)

    def shared(self) -> FFNWeights | None:
        s = self.lay["shared"]
        if s is None:
            return None
        get = self.reader.get
        names = {f: f"{self.path}.shared.{f}_proj" for f in ("gate", "up", "down")}
        return FFNWeights(up=get(names["up"] + ".weight"), down=get(names["down"] + ".weight"), act=self.lay["act"],
                          gate=get(names["gate"] + ".weight") if s["gated"] else None,
                          gate_bias=get(names["gate"] + ".bias") if s["bias"][0] else None,
                          up_bias=get(names["up"] + ".bias") if s["bias"][1] else None,
                          down_bias=get(names["down"] + ".bias") if s["bias"][2] else None)

    def router(self) -> Tensor:
        return self.reader.get(f"{self.router_of}.router.weight")

    def shared_gate(self) -> Tensor | None:
        gated = (self.lay["shared"] or {}).get("gate", False)
        return self.reader.get(f"{self.path}.shared_gate.weight") if gated else None


FFN_FIELDS = ("up", "down", "gate", "up_bias", "gate_bias", "down_bias")


class UpcycledParts(LayerParts):
    """The parts an init method makes from one dense FFN: experts in order (prepare on the first), then the shared
    expert, the router (from `router`: drawn from the layer's generator, or a router-sharing group's) and the
    shared expert's gate (from `gate`), made in that order whatever order a format asks for them in, as
    moekit.upcycle draws them. `stored` is the dense FFN as the checkpoint holds it: a tensor an init method
    passes through unchanged (a copy) is written from it, not cast back from float32 (the same bytes, no
    work). New tensors are checked finite unless allowed."""

    def __init__(self, ctx: InitContext, stored: FFNWeights, router: Callable[[], Tensor], finite: bool,
                 gate: Callable[[], Tensor | None]):
        self.ctx, self._router, self._gate, self.finite, self.state = ctx, router, gate, finite, None
        self._tail: tuple | None = None
        self.num_experts, self.hidden_size = ctx.spec.routed_experts, ctx.dense.hidden_size
        self.stored = {id(getattr(ctx.dense, f)): getattr(stored, f) for f in FFN_FIELDS
                       if getattr(ctx.dense, f) is not None}

    def _as_stored(self, e: FFNWeights, what: str) -> FFNWeights:
        changes = {}
        for f in FFN_FIELDS:
            t = getattr(e, f)
            if t is not None and id(t) in self.stored:
                changes[f] = self.stored[id(t)]
            elif t is not None and self.finite:
                check_finite(t, f"{self.ctx.spec.init.method} {what} ({f}) of {self.ctx.path}")
        return replace(e, **changes)

    def expert(self, i: int) -> FFNWeights:
        init = self.ctx.spec.init
        if i == 0:
            self.state = init.prepare(self.ctx)
        with torch.no_grad():
            return self._as_stored(init.expert(self.ctx, self.state, i), f"expert {i}")

    def _finish(self) -> tuple:
        if self._tail is None:
            sh = self.ctx.spec.init.shared(self.ctx)
            self._tail = (None if sh is None else self._as_stored(sh, "shared expert"), self._router(), self._gate())
        return self._tail

    def shared(self) -> FFNWeights | None:
        return self._finish()[0]

    def router(self) -> Tensor:
        return self._finish()[1]

    def shared_gate(self) -> Tensor | None:
        return self._finish()[2]


def draw_router(spec: MoESpec, hidden: int, gen: torch.Generator, rows: Tensor | None = None) -> Tensor:
    """A new router's weight (E, H) in float32, as moekit.moe.build.init_router makes it (from prompt `rows`
    for the prompt inits)."""
    router = Router(hidden, spec.routed_experts, spec.routed_top_k, spec.scoring)
    from moekit.moe.build import init_router

    init_router(router, spec, gen, rows)
    return router.weight.detach()


# ------------------------------------------------------------------------------ meta models, FFNs


def ffn_keys(slot: Slot) -> list[str]:
    """The state-dict keys (relative to the block) that the slot's dense FFN owns: those installing an MoE
    layer removes."""
    block = copy.deepcopy(slot.block)
    before = set(block.state_dict())
    slot.install(nn.Identity(), block)
    return sorted(before - set(block.state_dict()))


def read_ffn(slot: Slot, reader: ShardReader, finite: bool) -> FFNWeights:
    """The slot's dense FFN with real weights from `reader` (the rest of the block stays on meta)."""
    block = copy.deepcopy(slot.block)
    base = f"{slot.stack}.{slot.index}."
    tensors = {}
    for key in ffn_keys(slot):
        if base + key not in reader:
            raise CheckpointError(f"{reader.folder} has no tensor {base + key} (the FFN of {slot.path})")
        tensors[key] = reader.get(base + key)
        if finite:
            check_finite(tensors[key], f"{reader.folder}: {base + key}")
    block.load_state_dict(tensors, strict=False, assign=True)
    return slot.checked_read(block, f"{reader.folder}: {slot.path}")


def layout_for(ffn: FFNWeights, spec: MoESpec, dropout: float, dtype: torch.dtype) -> dict:
    """The moekit.json layout of the MoE layer `spec` makes of `ffn` (as moekit.moe.build.layout records it)."""
    shared = None if not spec.shared_expert else {
        "intermediate_size": ffn.intermediate_size, "gated": ffn.gated,
        "bias": [ffn.gate_bias is not None, ffn.up_bias is not None, ffn.down_bias is not None],
        "gate": spec.shared_gate}
    return {"num_experts": spec.routed_experts, "top_k": spec.routed_top_k, "scoring": spec.scoring,
            "jitter": spec.router.jitter, "hidden_size": ffn.hidden_size,
            "intermediate_size": ffn.intermediate_size // spec.granularity,
            "act": ffn.act, "gated": ffn.gated, "bias": ffn.has_bias, "dropout": dropout,
            "dtype": str(dtype).removeprefix("torch."), "shared": shared}


def meta_moe_model(dense: nn.Module, slots: list[Slot], groups: dict[str, str | None], spec: MoESpec,
                   dtype: torch.dtype) -> tuple[nn.Module, dict[str, dict]]:
    """A copy of the meta dense model with every selected FFN replaced by an empty MoE layer of the spec's
    layout (routers shared by group); and {FFN path: layout}."""
    model = copy.deepcopy(dense)
    layouts, routers = {}, {}
    with torch.device("meta"):
        for s in slots:
            ffn = s.read()
            lay = layouts[s.path] = layout_for(ffn, spec, s.dropout(), dtype)
            moe = from_layout(lay, router=routers.get(groups[s.path]))
            if groups[s.path] is not None:
                routers.setdefault(groups[s.path], moe.router)
            moe.slot = s.describe()
            slot_at(model, s.stack, s.index, s.adapter.name, s.path).install(moe)
    model_state(model).spec = spec
    return model, layouts


def router_owners(model: nn.Module) -> dict[str, str]:
    """{MoE layer path: path of the layer whose router it uses} (itself unless shared)."""
    owner: dict[int, str] = {}
    return {path: owner.setdefault(id(moe.router), path) for path, moe in moe_layers(model)}


def moe_units(model: nn.Module, make_parts: Callable[[str, MoELayer], LayerParts],
              naming: Callable[[str, LayerParts], Iterator[Item]],
              prefix: Callable[[str], str] | None = None) -> dict[str, Layer]:
    """{layer path: Layer unit} of the model's MoE layers (the model on the meta device); `prefix(path)` names a
    layer's tensors (default: its path and a dot)."""
    units = {}
    with torch.device("meta"):
        for path, moe in moe_layers(model):
            meta = MetaParts(layout(moe))
            units[path] = Layer(prefix(path) if prefix else f"{path}.", lambda p=path, m=moe: make_parts(p, m), meta,
                                lambda parts, p=path: naming(p, parts), path)
    return units


def moekit_naming(model: nn.Module) -> Callable[[str, LayerParts], Iterator[Item]]:
    owners = router_owners(model)
    bias = {path: moe.experts.first_bias is not None for path, moe in moe_layers(model)}
    return lambda path, parts: moekit_items(parts, owners[path] == path, bias[path])


def ordered_units(model: nn.Module, layers: dict[str, Layer], copy_of) -> tuple[list, dict[str, str]]:
    """Units in state-dict order (an MoE layer where its first tensor is), tied tensors once; and the aliases."""
    kept, aliases = unique_tensors(model)
    units, placed = [], set()
    for key in kept:
        path = next((p for p in layers if key.startswith(p + ".")), None)
        if path is None:
            units.append(copy_of(key, aliases))
        elif path not in placed:
            units.append(layers[path])
            placed.add(path)
    return units, aliases
