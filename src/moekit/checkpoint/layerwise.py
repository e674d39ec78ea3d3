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
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from moekit.checkpoint.files import ShardReader
from moekit.errors import CheckpointError
from moekit.moe.prompts import cheap_rows, check_model, hidden_rows
from moekit.moe.spec import MoESpec
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


def model_names(model: nn.Module, keys: list[str]) -> dict[str, tuple[str, bool]]:
    """{checkpoint key: (the model's name for it, whether a WeightConverter builds that tensor from several keys)}, by
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
        name, converted = rename_source_key(k, renamings, converters, prefix, meta)
        out[k] = (name, converted is not None)
    return out


class LayerStream:
    """The model of a checkpoint directory with its weights left in the checkpoint until `load`ed (module docstring).
    `model`: the checkpoint's model with its parameters on the meta device, in the dtype they load in, and real
    buffers (moekit.checkpoint.dense.meta_model(buffers=True), then `in_dtype`)."""

    def __init__(self, folder: str | Path, model: nn.Module):
        self.folder = Path(folder)
        self.model = model
        self.reader = ShardReader(self.folder)
        # {checkpoint key: the model parameter it loads into}: a part's tensors are found under the model's names
        self._names = {k: name for k, (name, _) in model_names(self.model, self.reader.keys()).items()}

    def load(self, path: str, device: str | torch.device = "cpu") -> nn.Module:
        """Load the parameters and persistent buffers of submodule `path` (a model name: "model.layers.3") from the
        checkpoint tensors under the same prefix, on `device`; CheckpointError if the checkpoint lacks some."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        prefix = f"{path}." if path else ""
        module = self.model.get_submodule(path)
        done = set()
        for name, experts in module.named_modules():
            done |= self._fill_experts(f"{prefix}{name}", experts, device)
        tensors = {k: self.reader.get(k).to(device) for k, name in self._names.items()
                   if (name.startswith(prefix) or k.startswith(prefix)) and k not in done}
        config = LoadStateDictConfig(dtype=self.dtype, weight_mapping=get_model_conversion_mapping(self.model))
        with _no_load_bars():
            convert_and_load_state_dict_in_model(self.model, tensors, config)
        left = [n for n, t in module.state_dict().items() if t.is_meta]
        if left:
            raise CheckpointError(f"{self.folder} has no weights for {prefix}{left[0]} (and {len(left) - 1} more "
                                  "of that part); the checkpoint does not match its config")
        return module.to(device)

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

    def _fill_experts(self, path: str, experts: nn.Module, device) -> set[str]:
        """Fused experts (gate_up_proj (E, 2I, H), down_proj (E, H, I)) of a checkpoint with the Hub's per-expert
        tensors, filled one expert at a time (transformers' conversion would hold every expert's tensors and the
        stacked result at once: twice the layer); returns the checkpoint keys read. The per-expert names are
        Mixtral's w1 (gate), w3 (up), w2 (down) under block_sparse_moe, or gate_proj, up_proj, down_proj; anything
        else is left to transformers. Tested equal to transformers' loading for every family moekit reads."""
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        n = getattr(experts, "num_experts", None)
        if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
                and gate_up.is_meta and isinstance(n, int) and f"{path}.gate_up_proj" not in self.reader):
            return set()
        block = path.rpartition(".")[0]
        for parent, names in ((block, ("gate_proj", "up_proj", "down_proj")),
                              (block.rpartition(".")[0] + ".block_sparse_moe", ("w1", "w3", "w2"))):
            keys = [[f"{parent}.experts.{e}.{p}.weight" for p in names] for e in range(n)]
            if all(k in self.reader for ks in keys for k in ks):
                break
        else:
            return set()
        I = gate_up.shape[1] // 2
        want = [(I, gate_up.shape[2]), (I, gate_up.shape[2]), tuple(down.shape[1:])]
        if any(tuple(self.reader.headers[k].shape) != w for ks in keys for k, w in zip(ks, want)):
            return set()
        fused = torch.empty(gate_up.shape, dtype=self.dtype, device=device)  # (E, 2I, H)
        stacked = torch.empty(down.shape, dtype=self.dtype, device=device)  # (E, H, I)
        for e, (g, u, d) in enumerate(keys):
            fused[e, :I], fused[e, I:], stacked[e] = self.reader.get(g), self.reader.get(u), self.reader.get(d)
        experts.gate_up_proj, experts.down_proj = nn.Parameter(fused, False), nn.Parameter(stacked, False)
        return {k for ks in keys for k in ks}

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
