"""The RISE workflow after routing capture (disable, remove and fine-tune selected experts) on every MoE family whose
routing moekit reads (tests/test_families.py), each built tiny from its own config with every weight perturbed (some
families initialize their routers to zero, which makes every routing decision a tie).

The defining property of pruning: a model with experts disabled (moekit.selection.prune) computes what the same
family computes with those experts removed from its checkpoint (moekit.checkpoint.remove), loaded by plain
transformers with the smaller expert count. Either side is refused in one line, changing nothing, where the family's
routing cannot be pruned: DeepSeek-V4's hash layers pick experts by token id."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from moekit.checkpoint.files import TensorInfo
from moekit.checkpoint.remove import _cut, remove_experts
from moekit.errors import ConfigError, MoekitError, UnsupportedModelError
from moekit.moe.state import model_state
from moekit.routing.sites import SplitExperts, find_sites, hash_routed, zero_experts
from moekit.routing.streamed import Batch, collect_in_memory, collect_streamed
from moekit.selection.finetune import attach
from moekit.selection.prune import kept_experts, load_pruned, prune, save_pruned
from moekit.selection.selection import Selection
from moekit.testing.families import moe_model_types, tiny_config, tiny_family_model
from test_families import HARNESS_CANNOT_BUILD, REFUSED  # tests/test_families.py: what capture cannot read

ZERO_COMPUTATION = {"longcat_flash"}  # identity experts after the routed ones: disabled, kept, not trained
FAMILIES = sorted(f for f in moe_model_types()
                  if f not in HARNESS_CANNOT_BUILD and f not in REFUSED and f not in ZERO_COMPUTATION)
HASH_ROUTED = {"deepseek_v4"}  # its first layers route by token id: those layers are refused, the others pruned
SHARED_COUNT = {"jetmoe"}  # its mixture-of-attention experts share the expert count: removal refused
IDS = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def perturbed(family: str):
    return tiny_family_model(family, perturb=0.05)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def routed(model) -> dict[str, set[int]]:
    """The experts each MoE layer picks with a non-zero weight on IDS."""
    seen, sites = {}, find_sites(model)
    hooks = [s.on_decision(lambda i, w, n=s.name: seen.setdefault(n, set()).update(i[w != 0].tolist()))
             for s in sites]
    logits(model)
    for h in hooks:
        h.remove()
    return seen


def test_every_family_of_the_capture_sweep_is_here_and_in_the_guide():
    assert len(FAMILIES) >= 40 and HASH_ROUTED | SHARED_COUNT <= set(FAMILIES)
    guide = Path(__file__).parents[1] / "docs" / "guides" / "selection.md"
    rows = [line.split("|")[2].strip() for line in guide.read_text().splitlines()
            if line.startswith("| disabled equals removed") or line.startswith("| the same, except")]
    assert [r.split(", ") for r in rows] == [[f for f in FAMILIES if f not in HASH_ROUTED | SHARED_COUNT],
                                             sorted(HASH_ROUTED), sorted(SHARED_COUNT)]


@pytest.mark.parametrize("family", FAMILIES)
def test_disabled_equals_removed_and_only_the_selected_experts_train(family, tmp_path):
    """Each family built once for: disabled == removed (_check_disabled_equals_removed), nothing disabled is
    bit-identical, and selective fine-tuning (_check_only_the_selected_experts_train)."""
    model = perturbed(family)
    fresh = copy.deepcopy(model)
    before = logits(model)
    handle = prune(model, {s.name: [] for s in find_sites(model) if not hash_routed(s)})  # every layer under the hooks
    assert torch.equal(logits(model), before)
    handle.remove()
    assert not model_state(model).pruned and torch.equal(logits(model), before)
    _check_disabled_equals_removed(family, model, tmp_path)
    _check_only_the_selected_experts_train(fresh)


def _check_disabled_equals_removed(family, model, tmp_path):
    """In every MoE layer, one of its 4 experts that it picks is disabled: the logits change, and equal the removed
    checkpoint's (the other 3 kept) as plain transformers computes them (1e-5, float32); the expert is never picked;
    the pruned model saved and loaded again computes the same."""
    model.save_pretrained(tmp_path / "src")
    sites = find_sites(model)
    assert all(s.num_experts == 4 for s in sites)
    before, used = logits(model), routed(model)
    if family in HASH_ROUTED:
        hashed = [s for s in sites if hash_routed(s)]
        assert hashed and len(hashed) < len(sites)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(UnsupportedModelError, match="hash routing") as e:
            prune(model, {s.name: [1] for s in sites})
        assert "\n" not in str(e.value) and not model_state(model).pruned
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        with pytest.raises(UnsupportedModelError, match="hash routing"):
            kept_experts(tmp_path / "src", Selection(method="m", budget=1, experts={}), "keep")
        sites = [s for s in sites if not hash_routed(s)]
    off = {s.name: [min(used[s.name])] for s in sites}
    prune(model, off)
    after = routed(model)
    assert all(off[s.name][0] not in after[s.name] for s in sites)
    pruned = logits(model)
    assert not torch.equal(pruned, before)
    save_pruned(model, tmp_path / "pruned")
    torch.testing.assert_close(logits(load_pruned(tmp_path / "pruned")), pruned, rtol=1e-6, atol=1e-6)
    if family in HASH_ROUTED:
        return
    if family in SHARED_COUNT:
        files = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
        with pytest.raises(UnsupportedModelError, match="share the count") as e:
            remove_experts(tmp_path / "src", tmp_path / "out", {n: [1, 2, 3] for n in off})
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
        assert {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()} == files
        return
    keep = kept_experts(tmp_path / "src", Selection(method="m", budget=1, experts=off), "drop")
    assert keep == {n: [e for e in range(4) if e not in ids] for n, ids in off.items()}
    remove_experts(tmp_path / "src", tmp_path / "out", keep)
    removed, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                            output_loading_info=True)
    assert not any(info.values()), info
    assert all(s.num_experts == 3 for s in find_sites(removed))
    torch.testing.assert_close(logits(removed.eval()), pruned, rtol=1e-5, atol=1e-5)


def _train_selected(model, selection: dict[str, list[int]]) -> dict[str, list[int]]:
    """attach -> two AdamW steps with weight decay on IDS -> merge; the experts that trained (handle.experts)."""
    handle = attach(model, selection)
    opt = torch.optim.AdamW(handle.trainable, lr=1e-2, weight_decay=0.1)
    model.train()
    for _ in range(2):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
    handle.merge()
    return handle.experts


def _check_only_the_selected_experts_train(model):
    """attach -> two AdamW steps with weight decay -> merge: the selected experts' rows changed, every other tensor
    and row of the model is bit-identical."""
    sites = find_sites(model)
    sel = {sites[0].name: [1, 2], sites[-1].name: [0]}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _train_selected(model, sel)
    after = model.state_dict()
    assert after.keys() == before.keys()
    rows = {}  # the selected experts' rows of every tensor stacked by expert: (E, ...), or DBRX's (E·n, ...)
    for s in sites:
        split = isinstance(s.experts, SplitExperts)  # JetMoE's: the block's input_linear and output_linear
        for n, p in s.experts.named_parameters():
            per, rest = divmod(p.shape[0], s.num_experts)
            if s.name in sel and not rest and (("." not in n or split) and per == 1 or p.dim() == 2 and per > 1):
                rows[f"{s.name}.{n}" if split else f"{s.name}.experts.{n}"] = [
                    e * per + j for e in sel[s.name] for j in range(per)]
    assert rows
    for key, old in before.items():
        if key not in rows:
            assert torch.equal(after[key], old), key
            continue
        other = [i for i in range(old.shape[0]) if i not in rows[key]]
        assert torch.equal(after[key][other], old[other]), key
        assert all(not torch.equal(after[key][i], old[i]) for i in rows[key]), key


@pytest.mark.parametrize("family", sorted(ZERO_COMPUTATION))
def test_zero_computation_experts_are_disabled_and_kept_by_removal_and_fine_tuning(family, tmp_path):
    """LongCat-Flash: 4 routed and 2 zero-computation (identity) experts, all 6 in its router and its trace. A
    disabled expert, routed or zero, is never picked and changes the logits, and the pruned model saved and loaded
    computes the same. Removing a routed expert keeps the zero ones (renumbered 3, 4): plain transformers computes
    what the model with that expert disabled computes, from transformers' layout and from the Hub's (no zero-expert
    tensors, which the output lacks too: read by moekit); dropping a zero expert is refused in one line, writing
    nothing. Fine-tuning a selection trains its routed experts' rows of gate_up_proj (6 rows) and down_proj (4)
    alone; the zero experts it names have nothing to train, and a selection of zero experts only is refused."""
    from safetensors.torch import load_file, save_file

    from moekit.checkpoint.dense import load_dense

    model = perturbed(family)
    (site,) = find_sites(model)
    assert (site.num_experts, zero_experts(site)) == (6, 2)
    before, used = logits(model), routed(model)
    assert used[site.name] & {4, 5} and used[site.name] & {0, 1, 2, 3}  # both kinds picked on IDS
    model.save_pretrained(tmp_path / "src")
    off = min(used[site.name] & {0, 1, 2, 3})
    for gone in (off, min(used[site.name] & {4, 5})):
        handle = prune(model, {site.name: [gone]})
        assert gone not in routed(model)[site.name] and not torch.equal(logits(model), before)
        save_pruned(model, tmp_path / f"pruned{gone}")
        torch.testing.assert_close(logits(load_pruned(tmp_path / f"pruned{gone}")), logits(model), rtol=1e-6,
                                   atol=1e-6)
        if gone == off:
            disabled = logits(model)
        handle.remove()
    assert torch.equal(logits(model), before)
    hub = tmp_path / "hub"  # the Hub's layout: the routed experts' tensors only
    hub.mkdir()
    for f in (tmp_path / "src").iterdir():
        if f.suffix != ".safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        save_file({k: v for k, v in tensors.items() if not any(f"experts.{z}." in k for z in (4, 5))}, hub / f.name,
                  metadata={"format": "pt"})
    for src in (tmp_path / "src", hub):
        keep = kept_experts(src, Selection(method="m", budget=1, experts={site.name: [off]}), "drop")
        assert keep == {site.name: [e for e in range(6) if e != off]}
        remove_experts(src, tmp_path / f"out-{src.name}", keep)
        routed_only = {site.name: [e for e in range(4) if e != off]}  # a selection of routed experts keeps the zero too
        assert kept_experts(src, Selection(method="m", budget=1, experts=routed_only), "keep") == keep
        remove_experts(src, tmp_path / f"kept-{src.name}", routed_only)  # without the zero ids: the same output
        tensors = [{k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
                   for d in (tmp_path / f"out-{src.name}", tmp_path / f"kept-{src.name}")]
        assert tensors[0].keys() == tensors[1].keys()
        assert all(torch.equal(v, tensors[1][k]) for k, v in tensors[0].items())
    removed, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out-src", dtype=torch.float32,
                                                            output_loading_info=True)
    assert not any(info.values()), info
    (cut,) = find_sites(removed)
    assert (cut.num_experts, zero_experts(cut), removed.config.n_routed_experts) == (5, 2, 3)
    torch.testing.assert_close(logits(removed.eval()), disabled, rtol=1e-5, atol=1e-5)
    names = {k for f in (tmp_path / "out-hub").glob("*.safetensors") for k in load_file(f)}
    assert any(".experts.2.gate" in k for k in names)  # 3 routed experts, no zero expert's tensor
    assert not any(".experts.3.gate" in k or ".experts.4." in k for k in names)
    torch.testing.assert_close(logits(load_dense(tmp_path / "out-hub").eval()), disabled, rtol=1e-5, atol=1e-5)
    files = {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()}
    with pytest.raises(ConfigError, match="zero-computation expert") as e:
        kept_experts(tmp_path / "src", Selection(method="m", budget=1, experts={site.name: [4]}), "drop")
    assert "\n" not in str(e.value) and {p.name: p.read_bytes() for p in (tmp_path / "src").iterdir()} == files
    with pytest.raises(ConfigError, match="no experts with weights") as e:
        attach(model, {site.name: [4, 5]})
    assert "\n" not in str(e.value) and all(p.requires_grad for p in model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert _train_selected(model, {site.name: [off, 4]}) == {site.name: [off]}  # the zero expert: nothing to train
    after = model.state_dict()
    trained = {f"{site.name}.experts.{n}" for n in ("gate_up_proj", "down_proj")}  # (6, ...) and (4, ...)
    for key, old in before.items():
        other = [i for i in range(old.shape[0]) if i != off] if key in trained else range(old.shape[0])
        assert torch.equal(after[key][other], old[other]), key
        assert key not in trained or not torch.equal(after[key][off], old[off]), key


def test_a_router_that_still_picks_a_disabled_expert_is_refused():
    """The check at every forward: a router whose choice does not come from its logits (here a fixed choice) is
    refused in one line the first time it picks a disabled expert."""
    model = perturbed("mixtral")
    site = find_sites(model)[0]
    fixed = lambda m, args, out: (out[0], out[1], torch.ones_like(out[2]))  # noqa: E731 - expert 1 for every token
    site.router.register_forward_hook(fixed)
    prune(model, {site.name: [1]})
    with pytest.raises(MoekitError, match="still picked a disabled expert") as e:
        logits(model)
    assert "\n" not in str(e.value)


# vision-language MoE families: their language model's MoE layers, named under model.language_model (or, Llama 4,
# language_model.model), and saved under the names transformers renames on load
VLM_SAMPLE = ["aria", "kimi_k25", "llama4", "qwen3_vl_moe"]


@pytest.mark.parametrize("family", VLM_SAMPLE)
def test_vision_language_moe_streams_prunes_and_removes(family, tmp_path):
    """Streamed capture (one decoder layer at a time) equals the in-memory one; one expert disabled per MoE layer
    equals it removed from the checkpoint, as transformers loads it (1e-5)."""
    model = tiny_family_model(family, image_text=True, perturb=0.05)
    model.save_pretrained(tmp_path / "src")
    batches = [Batch("en", IDS, torch.ones_like(IDS))]
    want = collect_in_memory(model, batches)
    got = collect_streamed(tmp_path / "src", batches, dtype=torch.float32)
    assert got.layers == want.layers and np.array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    # the experts read 3 at a time (Qwen3-VL-MoE's stored transposed: transformers' Transpose(1, 2) per part)
    parts = collect_streamed(tmp_path / "src", batches, dtype=torch.float32, experts_per_load=3)
    assert np.array_equal(parts.ids, want.ids)
    np.testing.assert_allclose(parts.weights, want.weights, rtol=1e-5, atol=1e-6)
    sites = find_sites(model)
    off = {s.name: [min(routed(model)[s.name])] for s in sites}
    prune(model, off)
    pruned = logits(model)
    keep = kept_experts(tmp_path / "src", Selection(method="m", budget=1, experts=off), "drop")
    remove_experts(tmp_path / "src", tmp_path / "out", keep)
    removed, info = type(model).from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(logits(removed.eval()), pruned, rtol=1e-5, atol=1e-5)


def test_removal_cuts_one_axis_of_the_experts_or_refuses():
    """What removal does with a tensor whose shape changes (E = 8 experts, 0, 2, 5, 7 kept): the experts' axis, first
    or not, keeping the entries after the experts (Inkling's shared rows), or DBRX's 16 rows per expert (E·16, ...);
    refused in one line when the change is not that (rows that are no whole number per expert, two axes)."""
    ids = [0, 2, 5, 7]
    cut = lambda have, want: _cut("t", TensorInfo("F32", have, Path("x")), want, 8, ids)  # noqa: E731
    assert (cut((8, 32), (4, 32)).rows, cut((8, 32), (4, 32)).axis) == (ids, 0)
    assert (cut((1, 8), (1, 4)).rows, cut((1, 8), (1, 4)).axis) == (ids, 1)
    assert cut((10, 32), (6, 32)).rows == [*ids, 8, 9] and cut((10, 32), (6, 32)).shape == (6, 32)
    assert cut((128, 32), (64, 32)).rows == [e * 16 + j for e in ids for j in range(16)]
    for have, want in (((128, 32), (60, 32)), ((8, 32), (4, 16)), ((8, 32), (4, 32, 1))):
        with pytest.raises(ConfigError, match="not one axis of the 8 experts") as e:
            cut(have, want)
        assert "\n" not in str(e.value)


# MoE config options a family's default leaves as they are, changed one at a time on a sample of widely used families
# (a sweep of every family with every option they have found one bug, Zaya's streamed refusal: test_families.py)
MOE_OPTIONS = {"norm_topk_prob": None, "num_experts_per_tok": 1, "routed_scaling_factor": 2.5,
               "first_k_dense_replace": 1, "decoder_sparse_step": 2, "n_shared_experts": 2}
MOE_OPTION_SAMPLE = [(f, k) for f in ("qwen2_moe", "qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "glm4_moe",
                                      "minimax", "ernie4_5_moe")
                     for k in MOE_OPTIONS if hasattr(tiny_config(f), k)]


def _flipped(family: str, option: str):
    def edit(cfg):
        value = MOE_OPTIONS[option]
        setattr(cfg, option, (not getattr(cfg, option)) if value is None else value)

    return tiny_family_model(family, perturb=0.05, edit=edit)


@pytest.mark.parametrize("family,option", MOE_OPTION_SAMPLE)
def test_capture_and_pruning_hold_with_config_options_changed(family, option, tmp_path):
    """Streamed capture equals in-memory capture, and disabled equals removed, with the option changed."""
    model = _flipped(family, option)
    model.save_pretrained(tmp_path / "m")
    batches = [Batch("en", IDS, torch.ones_like(IDS))]
    got, want = collect_streamed(tmp_path / "m", batches), collect_in_memory(model, batches)
    assert got.layers == want.layers and np.array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-5, atol=1e-6)
    _check_disabled_equals_removed(family, model, tmp_path)
