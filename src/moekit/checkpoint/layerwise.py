"""Running a model whose weights stay in its checkpoint, a part at a time.

`LayerStream` builds the model on the meta device (parameters only: buffers such as rotary frequencies are real) and
loads any submodule's weights from the checkpoint on demand, mapping the checkpoint's names to the model's with
transformers' own conversion (so the Hub's classic per-expert tensors become the fused experts of transformers 5,
exactly as from_pretrained does; transformers==5.23.0 is pinned for this private function:
transformers.core_model_loading.convert_and_load_state_dict_in_model), and drops them back to the meta device.
Memory then holds what is loaded now, not the model: routing analysis and pruning of models larger than memory run
one decoder layer at a time (moekit.routing.streamed).

`streamed_weights` runs a whole forward that way, each block loaded just before it runs and dropped after it: router
rows from prompts in a streaming upcycle (moekit.moe.prompts)."""
from __future__ import annotations

import contextlib
import copy
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit.checkpoint.files import ShardReader
from moekit.errors import CheckpointError, UnsupportedModelError
from moekit.moe.prompts import cheap_rows, check_model, hidden_rows
from moekit.moe.spec import MoESpec
from moekit.routing.sites import expert_count, expert_rows
from moekit.surgery import Slot


def streamed_prompt_rows(model: nn.Module, reader: ShardReader, slots: list[Slot], spec: MoESpec,
                         tokenizer) -> dict[str, Tensor]:
    """`prompt_rows` of the checkpoint `reader`, `model` its architecture with parameters on the meta device and
    real buffers (moekit.checkpoint.dense.meta_model(buffers=True)): weights read as the forward needs them (`streamed_weights`)."""
    check_model(model, slots, tokenizer, spec)
    names = {id(p): n for n, p in model.named_parameters()}
    if spec.router_init == "cheap_embed":
        row = cheap_rows(_read(reader, names[id(model.get_input_embeddings().weight)]), spec, tokenizer)
        return {s.path: row for s in slots}
    with streamed_weights(model, reader, slots[0].stack):
        return hidden_rows(model, slots, spec, tokenizer)


def _read(reader: ShardReader, name: str) -> Tensor:
    if name not in reader:
        raise CheckpointError(f"{reader.folder} has no tensor {name}, which the router prompts need")
    return reader.get(name).float()


@contextlib.contextmanager
def streamed_weights(model: nn.Module, reader: ShardReader, stack: str) -> Iterator[None]:
    """Let `model.base_model` run on the weights of `reader` in float32: its parameters outside the blocks of `stack`
    assigned now, each block's state assigned by a pre-hook just before the block runs and put back on the meta
    device by a hook after it (and on exit)."""
    base = {id(p) for p in model.base_model.parameters()}
    outside = {n: _read(reader, n) for n, p in model.named_parameters()
               if id(p) in base and not n.startswith(stack + ".")}
    model.load_state_dict(outside, strict=False, assign=True)
    blocks = model.get_submodule(stack)
    prefix = {id(b): f"{stack}.{i}." for i, b in enumerate(blocks)}

    def load(block, args, kwargs):
        block.load_state_dict({k: _read(reader, prefix[id(block)] + k) for k in block.state_dict()}, assign=True)

    def drop(block, *_):
        block.load_state_dict({k: torch.empty_like(v, device="meta") for k, v in block.state_dict().items()},
                              assign=True)

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(load, with_kwargs=True),
                                           b.register_forward_hook(drop))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for b in blocks:
            drop(b)


@contextlib.contextmanager
def _no_load_bars() -> Iterator[None]:
    """transformers' "Loading weights" bar off while a part loads (only moekit.cli draws progress)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def model_names(model: nn.Module, keys: list[str]) -> dict[str, tuple[str, str | None]]:
    """{checkpoint key: (the model's name for it, the source pattern of the WeightConverter that builds that tensor
    from several keys, or None)}, by
    transformers' own renaming for the family on load (NemotronH's backbone.* -> model.*, GPT-NeoX's embed_out ->
    lm_head, a vision-language model's language_model.model.* -> model.language_model.*; OLMo-Hybrid's q/k/v
    convolutions concatenated into one)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    mapping = get_model_conversion_mapping(model)
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for k in keys:
        out[k] = rename_source_key(k, renamings, converters, prefix, meta)
    return out


def chunked(model: nn.Module) -> dict[str, list[str]]:
    """{source pattern: its target patterns} of the conversions transformers loads `model` with that split one stored
    tensor along dim 0 (Chunk(dim=0) alone) into several, named literally: HRM-Text's attn.gqkv_proj.weight into
    self_attn.{gate,q,k,v}_proj.weight. `model_names` names such a tensor by the first target."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    return {c.source_patterns[0]: list(c.target_patterns) for c in get_model_conversion_mapping(model)
            if isinstance(c, WeightConverter) and len(c.source_patterns) == 1 and len(c.target_patterns) > 1
            and [(type(o), getattr(o, "dim", None)) for o in c.operations] == [(Chunk, 0)]
            and "\\" not in "".join(c.target_patterns)}  # no group references


_EXPERT = re.compile(r".+\.experts\.(\d+)\..+")  # the Hub's per-expert names: their expert


def zero_rows(experts: nn.Module, param: Tensor) -> int:
    """Rows of a fused expert tensor that a checkpoint need not hold: LongCat-Flash's zero-computation experts.
    transformers 5.23 gives its gate_up_proj a row for each of them after the routed experts' (its down_proj has
    the routed experts' alone); the forward never reads them, and the Hub's checkpoints hold the routed experts
    only. moekit fills them with zeros; 0 for every other family."""
    return (getattr(experts, "zero_expert_num", 0) or 0) if param.shape[0] == expert_count(experts) else 0


def expert_sources(model: nn.Module, names: dict[str, tuple[str, str | None]]) -> tuple[dict, dict]:
    """How transformers builds a model's tensors from a checkpoint, for reading some experts alone (`names`:
    `model_names`):
    ({tensor: [[the checkpoint keys of expert e, in the order transformers concatenates them] for e in 0 .. E-1]}
    for those built from the Hub's per-expert tensors as every family does (MergeModulelist(dim=0) of each source
    pattern's experts, then Concatenate(dim=1) of the patterns: Mixtral's w1 and w3 into gate_up_proj,
    DeepSeek-V4's `ffn.experts.{e}.w1`, ...),
    {tensor: (the one checkpoint key it is read from, [the operations transformers applies to it])} for those
    stored whole, as they are or with operations that leave the first (expert) dimension alone (Inkling 2's
    Interleave(dim=1) of w13_weight, Qwen3-VL-MoE's Transpose(1, 2)))."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, Interleave, MergeModulelist, Transpose, WeightConverter

    order, whole = {}, {}  # source pattern -> its place among its converter's / the converter's operations
    for c in get_model_conversion_mapping(model):
        ops = getattr(c, "operations", [])
        kinds = [(type(o), getattr(o, "dim", None)) for o in ops]
        if isinstance(c, WeightConverter) and kinds in ([(MergeModulelist, 0)],
                                                        [(MergeModulelist, 0), (Concatenate, 1)]):
            order.update({p: i for i, p in enumerate(c.source_patterns)})
        elif isinstance(c, WeightConverter) and len(c.source_patterns) == 1 and all(
                (isinstance(o, Interleave) and o.dim >= 1) or (isinstance(o, Transpose) and min(o.dim0, o.dim1) >= 1)
                for o in ops):
            whole[c.source_patterns[0]] = ops
    grouped: dict[str, dict[int, list[tuple[int, str]]]] = {}
    stored = {}
    for k, (name, pattern) in names.items():
        if pattern in order and (m := _EXPERT.fullmatch(k)):
            grouped.setdefault(name, {}).setdefault(int(m.group(1)), []).append((order[pattern], k))
        elif pattern is None or pattern in whole:
            stored[name] = (k, whole.get(pattern, []))
    per_expert = {name: [[k for _, k in sorted(by[e])] for e in range(len(by))] for name, by in grouped.items()
                  if sorted(by) == list(range(len(by)))}
    return per_expert, stored


def _along_experts(op, part: Tensor, want: torch.Size) -> Tensor:
    """transformers' conversion `op` (`expert_sources`) of some experts' tensor `part` (n, ...), whose experts are
    `want`-shaped in the model: a Transpose that checks dimensions compares one expert's shape, not the layer's."""
    if getattr(op, "check_dims", False) and part.shape[1:] == want:
        return part
    if hasattr(op, "check_dims"):
        return part.transpose(op.dim0, op.dim1).contiguous()
    return next(iter(op.convert({"part": [part]}, ["part"], ["part"]).values()))


def _shallow(module: nn.Module, params: dict, children: dict | None = None) -> nn.Module:
    """A shallow copy of `module` holding `params` (and `children`, else the original's), without the original's
    hooks or replaced forward."""
    part = copy.copy(module)
    part.__dict__.pop("forward", None)  # an instance's replaced forward stays with the original
    part._parameters, part._forward_hooks, part._forward_pre_hooks = params, OrderedDict(), OrderedDict()
    if children is not None:
        part._modules = children
    return part


class LayerStream:
    """The model of a checkpoint directory with its weights left in the checkpoint until `load`ed (module docstring).
    `model`: the checkpoint's model with its parameters on the meta device, in the dtype they load in, and real
    buffers (moekit.checkpoint.dense.meta_model(buffers=True), then `in_dtype`)."""

    def __init__(self, folder: str | Path, model: nn.Module):
        self.folder = Path(folder)
        self.model = model
        self.reader = ShardReader(self.folder)
        # {checkpoint key: the model parameter it loads into}: a part's tensors are found under the model's names
        names = model_names(self.model, self.reader.keys())
        self._names = {k: name for k, (name, _) in names.items()}
        self._per_expert, self._stored = expert_sources(self.model, names)

    def load(self, path: str, device: str | torch.device = "cpu", skip: tuple[str, ...] = ()) -> nn.Module:
        """Load the parameters and persistent buffers of submodule `path` (a model name: "model.layers.3") from the
        checkpoint tensors under the same prefix, on `device`, except those of the submodules `skip` (experts that
        load in parts: `load_experts`), left on the meta device; CheckpointError if the checkpoint lacks some."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        prefix = f"{path}." if path else ""
        skipped = tuple(f"{s}." for s in skip)
        module = self.model.get_submodule(path)
        done = set()
        for name, experts in module.named_modules():
            if not f"{prefix}{name}.".startswith(skipped):
                done |= self._fill_experts(f"{prefix}{name}", experts, device)
        tensors = {k: self.reader.get(k).to(device) for k, name in self._names.items()
                   if (name.startswith(prefix) or k.startswith(prefix)) and k not in done
                   and not name.startswith(skipped)}
        config = LoadStateDictConfig(dtype=self.dtype, weight_mapping=get_model_conversion_mapping(self.model))
        with _no_load_bars():
            convert_and_load_state_dict_in_model(self.model, tensors, config)
        if not path:  # the whole model: a tied output head follows its loaded embedding (Kimi-K2.5's)
            self.model.tie_weights()
        left = [n for n, t in module.state_dict().items() if t.is_meta and not f"{prefix}{n}".startswith(skipped)]
        if left:
            raise CheckpointError(f"{self.folder} has no weights for {prefix}{left[0]} (and {len(left) - 1} more "
                                  "of that part); the checkpoint does not match its config")
        if not skip:
            return module.to(device)
        for name, sub in module.named_modules():  # what `module.to` moves, but the skipped (meta) parameters
            if f"{prefix}{name}.".startswith(skipped):
                continue
            for n, p in sub.named_parameters(recurse=False):
                setattr(sub, n, nn.Parameter(p.to(device), p.requires_grad))
            for n, b in sub.named_buffers(recurse=False):
                setattr(sub, n, b.to(device))
        return module

    def load_experts(self, path: str, start: int, stop: int, device: str | torch.device = "cpu") -> nn.Module:
        """The fused experts module at `path` (parameters (E, ...) on the meta device) as a module of its experts
        start .. stop - 1 only: a shallow copy with those slices of its parameters, read from the checkpoint an
        expert at a time, and num_experts = stop - start; without the original's hooks. Stored fused (one tensor
        of every expert, quantized or not) or per expert (the Hub's names, as `_fill_experts` reads them);
        UnsupportedModelError for experts that transformers builds another way (then load the whole layer)."""
        experts = self.model.get_submodule(path)
        total = expert_count(experts)
        chunk = self._rows_part(path, experts, start, stop, total, device) \
            if expert_rows(experts, total) else self._fused_part(path, experts, start, stop, device)
        chunk.num_experts = stop - start
        if hasattr(experts, "zero_expert_num"):  # LongCat-Flash: its routed experts first, then the zero ones
            routed = max(0, min(stop, experts.num_routed_experts) - start)
            chunk.num_routed_experts, chunk.total_experts = routed, stop - start
            chunk.zero_expert_num = stop - start - routed
        return chunk

    def _fused_part(self, path: str, experts: nn.Module, start: int, stop: int, device) -> nn.Module:
        """`experts` (at `path`, parameters (E, ...)) with experts start .. stop - 1 only (`load_experts`)."""
        params = {}
        for n, p in experts.named_parameters(recurse=False):
            key, ops = self._stored.get(f"{path}.{n}", (None, []))
            hub = self._hub_experts(f"{path}.{n}", p, zero_rows(experts, p))
            if hub is None and (key is None or self.reader.headers[key].shape[0] != p.shape[0]):
                raise UnsupportedModelError(
                    f"{path}.{n} is not stored as one tensor of every expert or under the Hub's per-expert names, "
                    "so moekit cannot read some of its experts alone; load the whole layer (experts_per_load=None)")
            shape = p.shape[1:] if hub is not None else self.reader.headers[key].shape[1:]
            experts_here = range(start, min(stop, p.shape[0]))  # LongCat's down_proj: its routed experts' only
            part = torch.empty((len(experts_here), *shape), dtype=self.dtype, device=device)  # an expert at a time
            for i, e in enumerate(experts_here):
                if hub is not None and e >= len(hub):  # a zero expert's row (zero_rows)
                    part[i].zero_()
                else:
                    part[i] = torch.cat([self.reader.get(k) for k in hub[e]]) if hub is not None else \
                        self.reader.get(key, e)
            for op in ops:  # transformers' own, along dimensions after the experts'
                part = _along_experts(op, part, p.shape[1:])
            if part.shape[1:] != p.shape[1:]:
                raise UnsupportedModelError(f"{path}.{n}: {key} {list(self.reader.headers[key].shape)} does not "
                                            f"convert to {list(p.shape)}; load the whole layer (experts_per_load=None)")
            params[n] = nn.Parameter(part, requires_grad=False)
        return _shallow(experts, params)

    def _rows_part(self, path: str, module: nn.Module, start: int, stop: int, total: int, device) -> nn.Module:
        """A shallow copy of `module` (at `path`) and its children whose parameters hold expert e's rows e·n ..
        (e+1)·n - 1 (DBRX's experts: `expert_rows`) with those of experts start .. stop - 1 only, read at once."""
        params = {}
        for n, p in module.named_parameters(recurse=False):
            key, ops = self._stored.get(f"{path}.{n}", (None, None))
            if key is None or ops or tuple(self.reader.headers[key].shape) != tuple(p.shape):
                raise UnsupportedModelError(f"{path}.{n} is not stored as the model holds it, so moekit cannot read "
                                            "some of its experts alone; load the whole layer (experts_per_load=None)")
            rows = p.shape[0] // total
            t = self.reader.get_rows(key, start * rows, stop * rows).to(device=device, dtype=self.dtype)
            params[n] = nn.Parameter(t, requires_grad=False)
        return _shallow(module, params, {n: self._rows_part(f"{path}.{n}", c, start, stop, total, device)
                                         for n, c in module.named_children()})

    def load_outside(self, stack: str, skip: tuple[str, ...], device: str | torch.device = "cpu") -> list[str]:
        """Load every parameter outside the module `stack` and the modules `skip` (the output head): what a model's
        forward uses before its first decoder layer (embeddings, Gemma 4's per-layer embeddings, input scales).
        Returns their names, for `drop_params`."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        inside = tuple(f"{p}." for p in (stack, *skip))
        tensors = {k: self.reader.get(k).to(device) for k, name in self._names.items() if not name.startswith(inside)}
        config = LoadStateDictConfig(dtype=self.dtype, weight_mapping=get_model_conversion_mapping(self.model))
        with _no_load_bars():
            convert_and_load_state_dict_in_model(self.model, tensors, config)
        names = [n for n, _ in self.model.named_parameters() if not n.startswith(inside)]
        left = [n for n in names if self.model.get_parameter(n).is_meta]
        if left:
            raise CheckpointError(f"{self.folder} has no weights for {left[0]} (and {len(left) - 1} more outside "
                                  f"{stack}); the checkpoint does not match its config")
        for n in names:
            module, _, leaf = n.rpartition(".")
            param = self.model.get_parameter(n)
            if param.device != torch.device(device):
                setattr(self.model.get_submodule(module), leaf, nn.Parameter(param.to(device), False))
        return names

    def drop_params(self, names: list[str]) -> None:
        """Put these parameters back on the meta device."""
        for n in names:
            module, _, leaf = n.rpartition(".")
            p = self.model.get_parameter(n)
            setattr(self.model.get_submodule(module), leaf, nn.Parameter(torch.empty_like(p, device="meta"), False))

    def _hub_experts(self, name: str, param: Tensor, missing: int = 0) -> list[list[str]] | None:
        """The per-expert checkpoint keys of fused expert tensor `name` (`expert_sources`) where they are as many as
        its experts (or as many less the `missing` last ones: `zero_rows`) and concatenate to its shape; None for
        anything else."""
        keys = self._per_expert.get(name)
        if keys is None or len(keys) not in (param.shape[0], param.shape[0] - missing):
            return None
        shapes = [self.reader.headers[k].shape for k in keys[0]]
        if any([self.reader.headers[k].shape for k in ks] != shapes for ks in keys) or \
                (sum(s[0] for s in shapes), *shapes[0][1:]) != tuple(param.shape[1:]):
            return None
        return keys

    def _fill_experts(self, path: str, experts: nn.Module, device) -> set[str]:
        """Fused expert tensors stored under the Hub's per-expert names (`_hub_experts`), filled one expert at a
        time (transformers' conversion would hold every expert's tensors and the stacked result at once: twice the
        layer); returns the checkpoint keys read, none for anything else (left to transformers). Tested equal to
        transformers' loading for every family moekit reads."""
        done = set()
        for n, p in experts.named_parameters(recurse=False):
            keys = self._hub_experts(f"{path}.{n}", p, zero_rows(experts, p)) if p.is_meta else None
            if keys is None:
                continue
            fused = torch.empty(p.shape, dtype=self.dtype, device=device)  # (E, ...)
            fused[len(keys):].zero_()  # rows past the keys: zero_rows
            for e, ks in enumerate(keys):
                fused[e] = torch.cat([self.reader.get(k) for k in ks])
            setattr(experts, n, nn.Parameter(fused, False))
            done.update(k for ks in keys for k in ks)
        return done

    def drop(self, path: str) -> None:
        """Put the weights of submodule `path` back on the meta device (their memory is freed)."""
        module = self.model.get_submodule(path)
        module.load_state_dict({k: torch.empty_like(v, device="meta") for k, v in module.state_dict().items()},
                               assign=True)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> LayerStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def in_dtype(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """`model` (parameters on the meta device) with its parameters in `dtype` (None: as they are), in eval mode;
    buffers such as rotary frequencies keep their own dtype."""
    if dtype is not None:
        for name, p in list(model.named_parameters()):
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, nn.Parameter(torch.empty_like(p, dtype=dtype, device="meta"),
                                                                    requires_grad=p.requires_grad))
        model.tie_weights()
    return model.eval()
