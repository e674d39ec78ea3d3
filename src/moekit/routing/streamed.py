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
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit._fs import available_memory, remove, scratch
from moekit.checkpoint.layerwise import LayerStream, in_dtype
from moekit.errors import MoekitError, UnsupportedModelError
from moekit.progress import report
from moekit.routing.capture import RoutingCapture
from moekit.routing.sites import find_sites
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
    """The hidden states of every batch between two layers: in memory, or (`spill`) in a temporary folder, one file
    per batch, removed when the store closes (or, after a SIGKILL, by the next store that spills: moekit._fs.scratch)."""

    def __init__(self, spill: bool):
        self._folder = scratch(SPILL) if spill else None
        self._kept: dict[int, Tensor] = {}

    def put(self, b: int, h: Tensor) -> None:
        if self._folder is None:
            self._kept[b] = h
        else:
            torch.save(h, self._folder / f"{b}.pt")

    def get(self, b: int) -> Tensor:
        if self._folder is None:
            return self._kept[b]
        return torch.load(self._folder / f"{b}.pt", weights_only=True)

    def close(self) -> None:
        self._kept.clear()
        if self._folder is not None:
            remove(self._folder)


def decoder_stack(model: nn.Module, sites: list | None = None) -> tuple[str, nn.ModuleList]:
    """(path, layers) of the model's decoder layers: the ModuleList named `layers` with the text config's
    num_hidden_layers entries (a vision-language model's language model too), the one holding the MoE `sites` where
    another stack has as many (a vision tower)."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model: only decoder-only models "
                                    "stream layer by layer; capture it with the whole model loaded")
    stacks = [(name, module) for name, module in model.named_modules()
              if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) == n]
    stacks.sort(key=lambda stack: not any(s.name.startswith(stack[0] + ".") for s in sites or []))  # stable
    if stacks:
        return stacks[0]
    raise UnsupportedModelError(f"{type(model).__name__}: no decoder layer stack ({n} layers named `layers`) to "
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
                     trust_remote_code: bool = False, spill: bool | None = None) -> RoutingTrace:
    """The RoutingTrace (with saliency sums) of `batches` through the checkpoint `folder`, one decoder layer
    resident at a time (module docstring), its meta naming the model (config_sha256: trace.config_digest). Progress:
    "recording" per decoder layer."""
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
                for i in range(len(stack)):
                    _run_layer(stream, f"{path}.{i}", batches, calls, store, cap, i, device)
                    report("recording", i + 1, len(stack), f"{path}.{i}")
                for b, batch in enumerate(batches):
                    cap.record(batch.input_ids, batch.attention_mask, batch.language, batch=b)
            return cap.trace(config_sha256=config_digest(model.config))
        finally:
            store.close()


def _run_layer(stream: LayerStream, path: str, batches: list[Batch], calls: list, store: HiddenStates,
               cap: RoutingCapture, index: int, device) -> None:
    layer = stream.load(path, device)
    try:
        with torch.no_grad():
            for b, batch in enumerate(batches):
                cap.begin(b, batch.attention_mask, batch.language)
                args, kwargs = calls[b][index]
                out = layer(store.get(b).to(device), *args, **kwargs)
                store.put(b, (out[0] if isinstance(out, tuple) else out).cpu())
    finally:
        stream.drop(path)


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
