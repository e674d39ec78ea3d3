"""Routing capture of a model larger than memory, straight from its checkpoint, one decoder layer at a time.

The model is built on the meta device (moekit.checkpoint.layerwise.LayerStream). One pass with every decoder layer
stubbed records, per calibration batch, the input of the first layer (the embeddings, the only weights loaded for
it) and what the model passes each layer besides its hidden states (attention masks, rotary embeddings: exactly
the family's own forward). Then, layer by layer: its weights are read from the checkpoint, every batch runs
through it with RoutingCapture's hooks (decisions and saliency sums), its outputs become the next layer's inputs,
and its weights are dropped. Memory holds one layer, the embeddings while the first pass runs, and the hidden
states of the calibration set (in memory when they fit, else in a temporary folder that is always removed). The
trace equals the in-memory capture's: the same layers run the same arithmetic on the same inputs.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit._fs import available_memory, remove, scratch
from moekit.checkpoint.layerwise import LayerStream, in_dtype
from moekit.errors import ConfigError, MoekitError, UnsupportedModelError
from moekit.progress import report
from moekit.routing.capture import RoutingCapture
from moekit.routing.sites import RouterSite, find_sites, one_slot
from moekit.routing.trace import RoutingTrace, config_digest


@dataclass
class Batch:
    language: str
    input_ids: Tensor  # (B, S)
    attention_mask: Tensor  # (B, S)


class _Stop(Exception):
    """Raised by the first pass once the last decoder layer has been reached."""


class _StatePassed(Exception):
    """Raised where a family's forward unpacks or indexes what a (stubbed) decoder layer returned."""


class _Returned(torch.Tensor):
    """What a stubbed layer returns in the first pass: its input, refusing to be unpacked or indexed. A family whose
    layers return more than their hidden states (`hidden, state = layer(...)`: state passed from layer to layer) would
    otherwise unpack a batch of two as (row 0, row 1) and go on with the wrong tensors."""

    def __iter__(self):
        raise _StatePassed

    def __getitem__(self, index):
        raise _StatePassed


SPILL = "moekit-hidden"  # the spill folder: .moekit-hidden.moekit-tmp-PID-XXXXXXXX in the temporary directory


class HiddenStates:
    """A tensor (or tuple of tensors) per batch: the hidden states of every batch between two layers, or what experts
    that load in parts take and return; in memory, or (`spill`) in a temporary folder, one file per batch, removed
    when the store closes (or, after a SIGKILL, by the next store that spills: moekit._fs.scratch)."""

    def __init__(self, spill: bool):
        self._folder = scratch(SPILL) if spill else None
        self._kept: dict[int, Tensor | tuple[Tensor, ...]] = {}

    @property
    def spilled(self) -> bool:
        return self._folder is not None

    def put(self, b: int, h: Tensor | tuple[Tensor, ...]) -> None:
        if self._folder is None:
            self._kept[b] = h
        else:
            torch.save(h, self._folder / f"{b}.pt")

    def has(self, b: int) -> bool:
        return b in self._kept if self._folder is None else (self._folder / f"{b}.pt").is_file()

    def get(self, b: int):
        if self._folder is None:
            return self._kept[b]
        return torch.load(self._folder / f"{b}.pt", weights_only=True)

    def close(self) -> None:
        self._kept.clear()
        if self._folder is not None:
            remove(self._folder)


def stack_lengths(text_config) -> set[int]:
    """How many entries a text config's decoder stack may have: its num_hidden_layers, or LongCat-Flash's num_layers
    (half its num_hidden_layers: each of its layers holds two attention sublayers)."""
    lengths = {getattr(text_config, "num_hidden_layers", None),
               getattr(text_config, "num_layers", None) if hasattr(text_config, "zero_expert_num") else None}
    return {n for n in lengths if isinstance(n, int)}


def decoder_stack(model: nn.Module, sites: list | None = None) -> tuple[str, nn.ModuleList]:
    """(path, layers) of the model's decoder layers: the ModuleList named `layers` (DBRX: `blocks`) with the text
    config's num_hidden_layers entries (a vision-language model's language model too; LongCat-Flash's num_layers,
    half its num_hidden_layers: each of its layers holds two attention sublayers), the one holding the MoE `sites`
    where another stack has as many (a vision tower)."""
    text = model.config.get_text_config()
    n, lengths = getattr(text, "num_hidden_layers", None), stack_lengths(text)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model: only decoder-only models "
                                    "stream layer by layer; capture it with the whole model loaded")
    stacks = [(name, module) for name, module in model.named_modules()
              if name.endswith(("layers", "blocks")) and isinstance(module, nn.ModuleList) and len(module) in lengths]
    stacks.sort(key=lambda stack: not any(s.name.startswith(stack[0] + ".") for s in sites or []))  # stable
    if stacks:
        return stacks[0]
    raise UnsupportedModelError(f"{type(model).__name__}: no decoder layer stack ({n} `layers` or `blocks`) to "
                                "stream layer by layer; capture it with the whole model loaded")


@contextlib.contextmanager
def _stubbed(layers: nn.ModuleList, calls: list[tuple[tuple, dict]]) -> Iterator[None]:
    """Every layer returns its input unchanged and records (args, kwargs) of its call; the last one stops the
    forward (nothing after the stack runs)."""
    def stub(*args, **kwargs):
        calls.append((args[1:], kwargs))
        hidden = (args[0] if args else kwargs["hidden_states"]).as_subclass(torch.Tensor)
        if len(calls) == len(layers):
            raise _Stop(hidden)
        return hidden.as_subclass(_Returned)

    for layer in layers:
        layer.forward = stub
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextlib.contextmanager
def _transformers_forward(model: nn.Module) -> Iterator[None]:
    """An error raised in transformers' own code (the innermost frame of its traceback there, not in moekit or torch)
    while the family's forward runs becomes one line: a family whose forward fails as transformers ships it (in 5.23,
    Qwen3-Omni-MoE's thinker reads a config field its config does not have once it is given an attention mask)."""
    try:
        yield
    except MoekitError:
        raise
    except Exception as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or f"{os.sep}transformers{os.sep}" not in tb.tb_frame.f_code.co_filename:
            raise
        raise UnsupportedModelError(
            f"{type(model).__name__}'s own forward fails in transformers ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}); moekit cannot record the routing of a model transformers cannot "
            "run") from e


def first_pass(stream: LayerStream, batches: list[Batch], layers: nn.ModuleList, device) -> tuple[list, list]:
    """([first layer input (B, S, H) per batch], [[(args, kwargs) per layer] per batch]) with only the weights
    outside the decoder stack and the output head loaded (the embeddings, and what some families use before their
    first layer: Gemma 4's per-layer embeddings), dropped after."""
    model = stream.model
    stack = next(n for n, m in model.named_modules() if m is layers)
    head = [n for n, m in model.named_modules() if m is model.get_output_embeddings()]
    loaded = stream.load_outside(stack, tuple(head), device)
    inputs, calls = [], []
    try:
        for batch in batches:
            recorded: list[tuple[tuple, dict]] = []
            with _stubbed(layers, recorded), torch.no_grad(), _transformers_forward(model):
                try:
                    model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                          use_cache=False)
                except _Stop as stop:
                    inputs.append(stop.args[0].cpu())
                except _StatePassed:  # the model unpacked or indexed what its layer returned
                    raise UnsupportedModelError(
                        f"{type(model).__name__}'s decoder layers return more than their hidden states (state "
                        "passed from layer to layer), which capture one layer at a time cannot rebuild; capture it "
                        "with the whole model loaded instead") from None
            calls.append([_detached(c) for c in recorded])
    finally:
        stream.drop_params(loaded)
    return inputs, calls


def _detached(call: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """A layer call's extra arguments without the first pass's hidden state: the first layer's input, which every
    stub passed on, is stored once per batch."""
    args, kwargs = call
    return args, {k: v for k, v in kwargs.items() if k != "hidden_states"}


def needs_spill(batches: list[Batch], hidden: int, dtype: torch.dtype) -> bool:
    """Whether the calibration set's hidden states (every position of every batch) would take more than a quarter
    of the memory available now."""
    positions = sum(b.input_ids.numel() for b in batches)
    return positions * hidden * dtype.itemsize * 2 > available_memory() // 4  # inputs and outputs of a layer


def _meta_model(folder: Path, dtype: torch.dtype | None, trust_remote_code: bool) -> nn.Module:
    """A dense or transformers MoE checkpoint's model (moekit.checkpoint.dense.streamable_model), or a moekit
    checkpoint's (moekit.checkpoint.format.build_from_meta), with its parameters on the meta device in `dtype`."""
    if (folder / "moekit.json").is_file():
        from moekit.checkpoint.format import build_from_meta

        return in_dtype(build_from_meta(folder, buffers=True)[0], dtype)
    from moekit.checkpoint.dense import streamable_model

    return streamable_model(folder, dtype, trust_remote_code)


def collect_streamed(folder: str | Path, batches: list[Batch], layers: str | None = None,
                     dtype: torch.dtype | None = None, device: str | torch.device = "cpu", saliency: bool = True,
                     trust_remote_code: bool = False, spill: bool | None = None,
                     experts_per_load: int | None = None) -> RoutingTrace:
    """The RoutingTrace (with saliency sums) of `batches` through the checkpoint `folder`, one decoder layer
    resident at a time (module docstring), its meta naming the model (config_sha256: trace.config_digest). A
    layer's experts load `experts_per_load` at a time (None: `per_load`'s choice by the memory available; the
    meta's experts_per_load says the fewest chosen where some layer loads in parts). Progress: "recording" per
    decoder layer."""
    with LayerStream(folder, _meta_model(Path(folder), dtype, trust_remote_code)) as stream:
        model = stream.model
        sites = find_sites(model, layers)  # a model without an MoE layer moekit reads is refused before anything runs
        path, stack = decoder_stack(model, sites)
        inputs, calls = first_pass(stream, batches, stack, device)
        hidden = model.config.get_text_config().hidden_size
        store = HiddenStates(needs_spill(batches, hidden, stream.dtype) if spill is None else spill)
        try:
            for b, h in enumerate(inputs):
                store.put(b, h)
            inputs.clear()
            with RoutingCapture(model, layers, saliency=saliency) as cap:
                owner = {i: int(m.group(1)) for i, s in enumerate(cap.sites)
                         if (m := re.match(rf"{re.escape(path)}\.(\d+)\.", s.name + "."))}
                if len(owner) != len(cap.sites):
                    raise UnsupportedModelError(f"MoE layers outside {path}: stream only decoder-only models")
                in_parts = _in_parts_of(model, cap, stream.dtype, device, experts_per_load, store.spilled)
                for i in range(len(stack)):
                    parts = {k: p for k, p in in_parts.items() if p.path.startswith(f"{path}.{i}.")}
                    _run_layer(stream, f"{path}.{i}", batches, calls, store, cap, i, device, parts)
                    report("recording", i + 1, len(stack), f"{path}.{i}")
                for b, batch in enumerate(batches):
                    cap.record(batch.input_ids, batch.attention_mask, batch.language, batch=b)
            parted = {"experts_per_load": min(p.per_load for p in in_parts.values())} if in_parts else {}
            return cap.trace(config_sha256=config_digest(model.config), **parted)
        finally:
            store.close()


def per_load(site: RouterSite, dtype: torch.dtype, device, given: int | None = None) -> int:
    """How many of a site's experts load at a time: `given` (at most all), else all of them where they take at most
    a quarter of the memory available (of the GPU on one), else as many as fit in it (at least one)."""
    if given is not None:
        return min(given, site.num_experts)
    device = torch.device(device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    one = site.params_per_expert * dtype.itemsize
    return site.num_experts if one * site.num_experts <= free // 4 else max(1, free // 4 // one)


def _in_parts_of(model: nn.Module, cap: RoutingCapture, dtype: torch.dtype, device, given: int | None,
                 spill: bool) -> dict[int, _InParts]:
    """{site index: _InParts} of every MoE layer (recorded or not) whose experts load in parts; `cap` numbers the
    recorded ones (given_norms)."""
    if given is not None and given < 1:
        raise ConfigError(f"experts_per_load must be at least 1, got {given}")
    names = {id(m): n for n, m in model.named_modules()}
    recorded = {id(s.block): i for i, s in enumerate(cap.sites)}
    parts = {}
    for site in find_sites(model):
        n = per_load(site, dtype, device, given)
        if n < site.num_experts and id(site.experts) not in names:
            raise UnsupportedModelError(f"{site.name}: its experts are two modules of its block (JetMoE's input_linear "
                                        "and output_linear), which moekit cannot load a few experts at a time; load "
                                        "each layer whole")
        if n < site.num_experts:
            i = recorded.get(id(site.block), -1 - len(parts))  # a layer not recorded: an index no site has
            parts[i] = _InParts(i, site, names[id(site.experts)], n, spill)
    return parts


def _run_layer(stream: LayerStream, path: str, batches: list[Batch], calls: list, store: HiddenStates,
               cap: RoutingCapture, index: int, device, parts: dict[int, _InParts]) -> None:
    """Every batch through decoder layer `path`; the experts of `parts` (this layer's sites whose experts load in
    parts) run on every batch's inputs a part at a time first (`_experts_first`)."""
    layer = stream.load(path, device, skip=tuple(p.path for p in parts.values()))
    try:
        with torch.no_grad(), contextlib.ExitStack() as answering:
            for part in parts.values():
                answering.enter_context(part.answering())
            for _ in parts:  # each run reaches the next site whose experts have not run yet
                _experts_first(stream, layer, batches, calls, store, cap, index, parts, device)
            for b, batch in enumerate(batches):
                cap.begin(b, batch.attention_mask, batch.language)
                for i, part in parts.items():
                    part.batch = b
                    if b in part.norms:
                        cap.given_norms[i] = part.norms.pop(b)
                out = _call(layer, b, calls, store, index, device)
                store.put(b, (out[0] if isinstance(out, tuple) else out).cpu())
    finally:
        stream.drop(path)


def _call(layer: nn.Module, b: int, calls: list, store: HiddenStates, index: int, device):
    args, kwargs = calls[b][index]
    return layer(store.get(b).to(device), *args, **kwargs)


class _Reached(Exception):
    """Raised by experts that load in parts when a batch reaches them before they have run on it."""

    def __init__(self, site: int, inputs: tuple[Tensor, Tensor, Tensor]):
        super().__init__(site)
        self.site, self.inputs = site, inputs


class _InParts:
    """A site whose fused experts (at `path`) load `per_load` at a time. While `answering` (one decoder layer): what
    they return for each batch, computed first over every batch (`_in_parts`), kept like the hidden states."""

    def __init__(self, index: int, site: RouterSite, path: str, per_load: int, spill: bool):
        self.index, self.site, self.path, self.per_load, self.spill = index, site, path, per_load, spill
        self.takes_routing = site.experts_take_routing  # read before `answering` replaces the experts' forward
        self.outputs = HiddenStates(False)  # batch -> the experts' output (T, H), while answering
        self.done: set[int] = set()
        self.norms: dict[int, Tensor] = {}  # batch -> ‖f‖ (T, k) of each token's routed experts, for the saliency
        self.batch = 0  # the batch running now

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """The experts return the batch's output once computed; before, they raise _Reached with their inputs: (x,
        ids, weights), or for Llama 4's experts, which take every expert's copy of x scaled by its score (E·T, H),
        x (T, H), the block's input, and the router's scores (T, E): not the E copies (E times the hidden states).
        Llama 4's block sums its experts' output (E, T, H) over the experts itself: it is given the sum, then zeros."""
        experts = self.site.experts
        signature, kept = inspect.signature(experts.forward), {}

        def keep_input(block, args) -> None:
            kept["x"] = args[0]

        def keep_scores(router, args, out) -> None:  # Llama 4's router: (scores (T, E), logits (T, E))
            kept["scores"] = out[0]

        def forward(*args, **kwargs):
            inputs = list(signature.bind(*args, **kwargs).arguments.values())[:3]
            shape, inputs[0] = inputs[0].shape, inputs[0].reshape(-1, inputs[0].shape[-1])  # DBRX's: (B, S, H)
            if self.batch in self.done:  # a copy: a block may add to what its experts return in place
                out = self.outputs.get(self.batch).to(inputs[0].device, copy=True)
                if not self.takes_routing:  # (T, H) summed, then (E - 1)·T rows of zeros: Llama 4's sum is it
                    out = torch.cat([out, out.new_zeros(shape[0] - out.shape[0], out.shape[1])])
                return out.reshape(shape)
            if not self.takes_routing:
                inputs = [kept["x"].reshape(-1, inputs[0].shape[-1]), kept["scores"]]  # (T, H), (T, E)
            raise _Reached(self.index, tuple(t.cpu() for t in inputs))

        self.outputs, self.done, self.norms = HiddenStates(self.spill), set(), {}
        experts.forward = forward
        hooks = [] if self.takes_routing else [self.site.block.register_forward_pre_hook(keep_input),
                                               self.site.router.register_forward_hook(keep_scores)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            del experts.forward
            self.outputs.close()


def _experts_first(stream: LayerStream, layer: nn.Module, batches: list[Batch], calls: list, store: HiddenStates,
                   cap: RoutingCapture, index: int, parts: dict[int, _InParts], device) -> None:
    """Run every batch through the layer until it reaches experts that have not run on it (nothing recorded: the
    capture is muted), then run those experts on every batch's inputs, `per_load` experts loaded at a time."""
    reached: dict[int, HiddenStates] = {}  # site -> batch -> (x (T, H), ids (T, k), weights (T, k))
    try:
        with cap.muted():
            for b in range(len(batches)):
                for part in parts.values():
                    part.batch = b
                try:
                    _call(layer, b, calls, store, index, device)
                except _Reached as r:
                    reached.setdefault(r.site, HiddenStates(parts[r.site].spill)).put(b, r.inputs)
            for site, inputs in reached.items():
                _in_parts(stream, parts[site], inputs, [b for b in range(len(batches)) if inputs.has(b)],
                          cap.saliency and site >= 0, device)
    finally:
        for inputs in reached.values():
            inputs.close()


def _in_parts(stream: LayerStream, part: _InParts, inputs: HiddenStates, batches: list[int], norms: bool,
              device) -> None:
    """The experts' output for every batch (and ‖f‖ of each routed slot), `part.per_load` experts at a time."""
    total = part.site.num_experts
    for start in range(0, total, part.per_load):
        stop = min(total, start + part.per_load)
        experts = stream.load_experts(part.path, start, stop, device)
        for b in batches:
            inputs_b = [t.to(device) for t in inputs.get(b)]
            if part.takes_routing:
                out, f = _routed_part(experts, start, stop, *inputs_b, part.outputs.get(b) if start else None, norms)
            else:
                out, f = _every_expert_part(experts, start, stop, *inputs_b, part.outputs.get(b) if start else None,
                                            norms)
            part.outputs.put(b, (out.to(inputs_b[0].dtype) if stop == total else out).cpu())  # last: the output
            if f is not None:
                part.norms[b] = part.norms.get(b, 0) + f.cpu()
        del experts
    if norms and not part.takes_routing:  # (E, T) norms of every expert: those of the routed slots
        for b in batches:
            _, ids, _ = part.site.decision((inputs.get(b)[1], None))  # the top-k of the router's scores (T, E)
            part.norms[b] = part.norms[b].t().gather(1, ids)  # (T, k)
    part.done.update(batches)


def _routed_part(experts: nn.Module, start: int, stop: int, x: Tensor, ids: Tensor, w: Tensor, acc: Tensor | None,
                 norms: bool) -> tuple[Tensor, Tensor | None]:
    """(Σ w·f (T, H) float32 so far, ‖f‖ (T, k) of the slots routed here (0 elsewhere) or None) of experts taking
    (x, ids, weights): the (token, slot) pairs routed to the loaded experts go through them as one-slot decisions,
    and a token's weighted outputs are summed in float32 (as transformers' grouped_mm sums its k slots), cast to
    the input's dtype after the last part."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if acc is None else acc.to(x.device)
    t, s = ((ids >= start) & (ids < stop)).nonzero(as_tuple=True)  # (P,) tokens, slots
    local = (ids[t, s] - start).unsqueeze(1)  # (P, 1) expert ids among the loaded ones
    f = torch.zeros(ids.shape, device=x.device) if norms else None
    if len(t):
        acc.index_add_(0, t, one_slot(experts, x[t], local, w[t, s].unsqueeze(1)).float())
        if norms:
            f[t, s] = one_slot(experts, x[t], local, torch.ones_like(w[t, s]).unsqueeze(1)).float().norm(dim=-1)
    return acc, f


def _every_expert_part(experts: nn.Module, start: int, stop: int, x: Tensor, scores: Tensor, acc: Tensor | None,
                       norms: bool) -> tuple[Tensor, Tensor | None]:
    """(Σ over the experts so far of their output (T, H), in float32; ‖f‖ (E, T) of the loaded experts on x (0
    elsewhere) or None) of Llama 4's experts, which take every expert's copy of x (T, H) scaled by its score (T, E),
    expert e on rows e·T .. e·T + T - 1: the loaded experts' rows are made as Llama 4 makes them (x repeated, times
    the score column: the same products) and go through them; the sum over experts in float32, as for every family
    in parts (Llama 4's own sums in the model's dtype)."""
    T, E, n = x.shape[0], scores.shape[1], stop - start
    rows = x.repeat(n, 1) * scores[:, start:stop].transpose(0, 1).reshape(-1, 1)  # (n·T, H)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if acc is None else acc.to(x.device)
    acc += experts(rows).float().view(n, T, -1).sum(dim=0)
    f = None
    if norms:
        f = torch.zeros(E, T, device=x.device)
        f[start:stop] = experts(x.repeat(n, 1)).float().view(n, T, -1).norm(dim=-1)
    return acc, f


def batches_of(tokenizer, texts: dict[str, list[str]], max_length: int, batch_size: int) -> list[Batch]:
    """Every language's texts tokenized in batches of `batch_size` (padded, truncated to `max_length`)."""
    out = []
    for lang, lines in texts.items():
        for i in range(0, len(lines), batch_size):
            enc = tokenizer(lines[i:i + batch_size], return_tensors="pt", padding=True, truncation=True,
                            max_length=max_length)
            out.append(Batch(lang, enc["input_ids"], enc["attention_mask"]))
    return out


def collect_in_memory(model: nn.Module, batches: list[Batch], layers: str | None = None,
                      saliency: bool = True) -> RoutingTrace:
    """The RoutingTrace (with saliency sums) of `batches` through a loaded model, batch by batch, its meta naming the
    model (config_sha256: trace.config_digest) (progress: "recording" batches)."""
    device = next(model.parameters()).device
    with RoutingCapture(model, layers, saliency=saliency) as cap:
        for b, batch in enumerate(batches):
            cap.begin(b, batch.attention_mask, batch.language)
            with torch.no_grad(), _transformers_forward(model):
                model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
            cap.record(batch.input_ids, batch.attention_mask, batch.language, batch=b)
            report("recording", b + 1, len(batches), batch.language)
    return cap.trace(config_sha256=config_digest(model.config))
