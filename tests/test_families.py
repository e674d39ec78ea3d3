"""Routing capture on every MoE family of the installed transformers (discovered from transformers itself:
moekit.testing.families), in memory and streamed one layer at a time, against an independent forward hook on what
each family passes its own experts. Each family is read exactly or refused with one line that says what is missing;
the families the tiny-model harness cannot build, and those moekit refuses, are listed here with the reason, so a
family that a new transformers adds or fixes shows up as a failure to update this list."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moekit.errors import MoekitError, UnsupportedModelError
from moekit.routing.sites import find_sites
from moekit.routing.streamed import Batch, collect_in_memory, collect_streamed
from moekit.testing.families import moe_model_types, tiny_family_model

FAMILIES = sorted(moe_model_types())
# the shrunk default config does not build or run in transformers 5.23 (the error it raises)
HARNESS_CANNOT_BUILD: dict[str, str] = {}
# moekit cannot read these families' routing (docs/guides/routing.md, "Families")
REFUSED = {
    "doge": "product-key routing over a bank of single-neuron experts (no top-k over E experts)",
}


def _batches():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return [Batch("en", ids, mask), Batch("fr", torch.randint(3, 100, (1, 4), generator=g), torch.ones(1, 4).long())]


def _reference(model, batches):
    """(ids, weights) per MoE layer at the kept positions, from hooks on each family's experts (what they are passed)
    or, where experts are not passed the decision, on the router's output: Llama 4's (scores, logits), or JetMoE's
    logits, of which it takes the top k and their softmax (JetMoeTopKGating)."""
    sites = find_sites(model)
    got = [[] for _ in sites]
    handles = []
    for i, s in enumerate(sites):
        if s.experts_take_routing:
            handles.append(s.experts.register_forward_pre_hook(
                lambda m, args, i=i: got[i].append((args[1].detach().clone(), args[2].detach().clone()))))
        else:
            def hook(m, args, out, i=i, k=s.top_k):
                if len(out) == 5:  # JetMoE
                    top, ids = out[4].topk(k, dim=1)
                    got[i].append((ids, torch.softmax(top, dim=1)))
                    return
                w, ids = out[0].topk(k, dim=-1)
                got[i].append((ids, w))
            handles.append(s.router.register_forward_hook(hook))
    try:
        for b in batches:
            with torch.no_grad():
                model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    finally:
        for h in handles:
            h.remove()
    keep = torch.cat([b.attention_mask.reshape(-1).bool() for b in batches])
    return [(torch.cat([c[0] for c in calls])[keep], torch.cat([c[1] for c in calls])[keep]) for calls in got]


def test_every_discovered_family_is_built_or_listed():
    assert set(HARNESS_CANNOT_BUILD) <= set(FAMILIES) and set(REFUSED) <= set(FAMILIES)
    for family in HARNESS_CANNOT_BUILD:
        with pytest.raises(Exception):  # noqa: B017 - the day it builds, it must join the test below
            tiny_family_model(family)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in HARNESS_CANNOT_BUILD])
def test_capture_in_memory_equals_the_familys_own_decision(family, tmp_path):
    model = tiny_family_model(family)
    if family in REFUSED:
        with pytest.raises(UnsupportedModelError, match="no MoE layer moekit can read") as e:
            find_sites(model)
        assert "\n" not in str(e.value)
        model.save_pretrained(tmp_path)  # streamed: the same refusal, before any layer runs
        with pytest.raises(UnsupportedModelError, match="no MoE layer moekit can read"):
            collect_streamed(tmp_path, _batches(), dtype=torch.float32)
        return
    trace = collect_in_memory(model, _batches())
    for layer, (ids, w) in enumerate(_reference(model, _batches())):
        k = ids.shape[1]
        assert np.array_equal(trace.ids[layer, :, :k], ids.numpy()), family
        np.testing.assert_allclose(trace.weights[layer, :, :k], w.float().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in HARNESS_CANNOT_BUILD and f not in REFUSED])
def test_capture_streamed_equals_in_memory_or_refuses_in_one_line(family, tmp_path):
    model = tiny_family_model(family)
    model.save_pretrained(tmp_path)
    want = collect_in_memory(model, _batches())
    try:
        got = collect_streamed(tmp_path, _batches(), dtype=torch.float32)
    except MoekitError as e:  # a clean refusal, never a crash
        assert "\n" not in str(e) and STREAM_REFUSED.get(family, "<none>") in str(e), (family, str(e))
        return
    assert family not in STREAM_REFUSED
    assert got.layers == want.layers
    assert np.array_equal(got.ids, want.ids), family
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    # a layer's experts loaded 3 at a time (a layer bigger than memory): the same decisions, the same sums up to
    # the order in which each token's expert outputs are added
    try:
        parts = collect_streamed(tmp_path, _batches(), dtype=torch.float32, experts_per_load=3)
    except MoekitError as e:
        assert "\n" not in str(e) and IN_PARTS_REFUSED.get(family, "<none>") in str(e), (family, str(e))
        return
    assert family not in IN_PARTS_REFUSED
    assert np.array_equal(parts.ids, want.ids), family
    np.testing.assert_allclose(parts.weights, want.weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(parts.saliency, got.saliency, rtol=1e-5, atol=1e-6)


def test_longcat_checkpoints_without_zero_expert_rows_read_as_the_model(tmp_path):
    """LongCat-Flash's Hub checkpoints hold its routed experts only, where transformers 5.23 gives gate_up_proj a row
    for each zero-computation expert too (and refuses such a checkpoint as a size mismatch): moekit reads it in
    memory, streamed, and in parts, and records what the model it was saved from computes."""
    import re

    from safetensors.torch import load_file, save_file

    from moekit.checkpoint.dense import load_dense
    from moekit.checkpoint.summary import inspect

    model = tiny_family_model("longcat_flash")
    model.save_pretrained(tmp_path)
    routed = model.config.n_routed_experts
    dropped = 0
    for f in tmp_path.glob("*.safetensors"):
        tensors = load_file(f)
        kept = {k: v for k, v in tensors.items()
                if not ((m := re.search(r"\.experts\.(\d+)\.", k)) and int(m.group(1)) >= routed)}
        dropped += len(tensors) - len(kept)
        save_file(kept, f, metadata={"format": "pt"})
    assert dropped == 2 * model.config.zero_expert_num  # each zero expert's gate_proj and up_proj
    (layer,) = inspect(tmp_path).layers  # read from the config alone
    one = 3 * model.config.hidden_size * model.config.expert_ffn_hidden_size  # a routed expert's gate, up, down
    assert (layer.experts, layer.zero_experts, layer.params_per_expert) == (6, 2, one)
    want = collect_in_memory(model, _batches())
    for got in (collect_in_memory(load_dense(tmp_path), _batches()),
                collect_streamed(tmp_path, _batches(), dtype=torch.float32),
                collect_streamed(tmp_path, _batches(), dtype=torch.float32, experts_per_load=4)):
        assert np.array_equal(got.ids, want.ids) and (got.ids >= routed).any()  # zero experts picked too
        np.testing.assert_allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)


# families whose experts cannot load a few at a time (a layer bigger than memory), with the words of the refusal
IN_PARTS_REFUSED = {"jetmoe": "cannot load a few experts at a time"}  # its experts: two modules of its block
# families whose layers moekit cannot stream one at a time, with the words of the refusal
STREAM_REFUSED = {"glm_moe_dsa": "state passed from layer to layer",  # each layer hands its top-k indices on
                  "hy_v4": "state passed from layer to layer",
                  "zaya": "state passed from layer to layer"}  # its router state


@pytest.mark.parametrize("family", sorted(STREAM_REFUSED))
def test_state_passed_between_layers_is_refused_whatever_the_batch(family, tmp_path):
    """The first pass's stubbed layers return their input; a family that unpacks two values from a layer (`hidden,
    state = layer(...)`) unpacked a batch of two unpadded rows as (row 0, row 1) and went on with the wrong tensors
    (a ValueError deep in Zaya's attention, or a wrong trace). What a stub returns now refuses to be unpacked or
    indexed, so the refusal does not depend on the batch: one and two rows, padded or not."""
    tiny_family_model(family).save_pretrained(tmp_path)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    for batch in (Batch("en", ids, torch.ones_like(ids)), Batch("en", ids[:1], torch.ones_like(ids[:1])),
                  *_batches()):
        with pytest.raises(UnsupportedModelError, match=STREAM_REFUSED[family]) as e:
            collect_streamed(tmp_path, [batch])
        assert "\n" not in str(e.value)


def test_a_family_whose_own_forward_fails_in_transformers_is_refused_in_one_line(tmp_path):
    """Qwen3-Omni-MoE's thinker, as transformers 5.23 ships it, fails in its own forward once it is given an attention
    mask (it reads config.vision_start_token_id, which its config class does not have): routing capture, in memory
    and streamed, says so in one line. The day transformers runs it, both must equal its own decisions instead."""
    model = tiny_family_model("qwen3_omni_moe_thinker", image_text=True)
    model.save_pretrained(tmp_path)
    batches = _batches()
    try:
        with torch.no_grad():
            model(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask)
    except AttributeError:
        for capture in (lambda: collect_in_memory(model, batches),
                        lambda: collect_streamed(tmp_path, batches, dtype=torch.float32)):
            with pytest.raises(UnsupportedModelError, match=r"own forward fails in transformers \(AttributeError: "
                               r".*vision_start_token_id") as e:
                capture()
            assert "\n" not in str(e.value)
        return
    want = _reference(model, batches)
    for trace in (collect_in_memory(model, batches), collect_streamed(tmp_path, batches, dtype=torch.float32)):
        assert all(np.array_equal(trace.ids[i, :, :ids.shape[1]], ids.numpy()) for i, (ids, _) in enumerate(want))


def test_jetmoe_experts_seen_as_one_module_compute_its_experts():
    """JetMoE's experts are two modules of its FFN block (input_linear (E, 2I, H), output_linear (E, H, I)): the
    saliency norms moekit computes through them are ‖W_out,e (act(W_g,e x) ⊙ W_u,e x)‖ of each routed slot."""
    model = tiny_family_model("jetmoe", perturb=0.05)
    site = find_sites(model)[0]
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(5, 32, generator=g), torch.tensor([[0, 2], [1, 3], [3, 0], [2, 1], [0, 1]])
    w_in, w_out = site.block.input_linear.weight, site.block.output_linear.weight  # (E, 2I, H), (E, H, I)
    with torch.no_grad():
        got = site.expert_norms(x, ids)  # (T, k)
        gate, up = torch.einsum("tkoh,th->tko", w_in[ids], x).chunk(2, dim=-1)  # (T, k, I) each
        want = torch.einsum("tkhi,tki->tkh", w_out[ids], torch.nn.functional.silu(gate) * up).norm(dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert site.params_per_expert == w_in[0].numel() + w_out[0].numel()
