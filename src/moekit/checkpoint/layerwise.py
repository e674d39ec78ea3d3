"""Running a model whose weights stay in its checkpoint: the weights outside the decoder blocks (embeddings, final
norm) are read once, each block's just before it runs and dropped after it, so memory holds those weights, one block
and the activations. Used for router rows from prompts in a streaming upcycle (moekit.moe.prompts)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
