"""The router logs of a training step stay on the device until the Trainer logs them (issue 38: no host sync in a
training step): MoEMethod.extra_loss reads nothing back, and `means` reads every series back in one transfer."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch

from moekit import MoESpec, upcycle
from moekit.methods import method
from moekit.moe.layer import moe_layers
from moekit.moe.losses import load_balance, z_loss
from moekit.testing import tiny_llama
from moekit.training.recipe import AuxConfig
from moekit.training.trainer import means


class NoReadBack(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that copies a tensor's value to the host (.item(), float(), bool() of a tensor)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "equal"):
            raise AssertionError(f"host read-back: {func}")
        return func(*args, **(kwargs or {}))


def test_means_averages_tensor_and_float_series_and_empties_them():
    logs = defaultdict(list, {"a": [torch.tensor(1.0), torch.tensor(2.5)], "b": [0.5, 1.5], "c": [torch.tensor(3.0)]})
    assert means(logs) == {"a": 1.75, "b": 1.0, "c": 3.0} and list(means(defaultdict(list))) == [] and not logs


def test_moe_extra_loss_reads_nothing_back_and_logs_what_it_adds():
    model = upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=2))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12)
    mask[1, 9:] = 0
    model.train()
    model(input_ids=ids, attention_mask=mask)
    trainer = SimpleNamespace(aux=AuxConfig(), aux_logs=defaultdict(list))
    with NoReadBack():
        loss = method("moe").extra_loss(trainer, model, mask)
    infos = [layer.last_routing for _, layer in moe_layers(model)]
    lb = sum(load_balance(i, mask.reshape(-1)) for i in infos)
    z = sum(z_loss(i, mask.reshape(-1)) for i in infos)
    torch.testing.assert_close(loss, 1e-2 * lb + 1e-3 * z)
    logged = means(trainer.aux_logs)
    assert abs(logged["moe/lb"] - lb.item()) < 1e-6 and abs(logged["moe/z"] - z.item()) < 1e-6
    assert all(isinstance(v, float) for v in logged.values()) and len(logged) == 2 + 4 * len(infos)


def test_a_training_step_with_router_losses_reads_nothing_back():
    """The whole step, as tests/test_gpu.py checks it on a GPU with torch's sync debug mode: forward (grouped
    dispatch: the CPU's per-expert loop reads the counts on purpose), router losses and logs, backward. The model
    gets no attention_mask: transformers' own mask preparation reads back with one (and with use_cache=False, to
    look for packed sequences), once per forward and outside moekit; the router losses get the mask."""
    model = upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=1, shared_expert=True))
    for _, layer in moe_layers(model):
        layer.experts.dispatch = "grouped"
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    trainer = SimpleNamespace(aux=AuxConfig(), aux_logs=defaultdict(list))
    with NoReadBack():
        loss = model(input_ids=ids, labels=ids).loss  # no attention_mask: see the docstring
        (loss + method("moe").extra_loss(trainer, model, torch.ones(2, 16))).backward()
    assert all(p.grad is not None for _, layer in moe_layers(model) for p in layer.router.parameters())
