"""Bigger than memory: routing capture one decoder layer at a time straight from the checkpoint (the trace equals the
in-memory capture's), the saliency sums of one-shot pruning against an independent computation, and memory that
stays flat in the number of layers."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moekit.errors import ConfigError
from moekit.moe.spec import MoESpec
from moekit.routing.sites import find_sites
from moekit.routing.streamed import Batch, collect_in_memory, collect_streamed
from moekit.testing import TINY_HF_MOE, tiny_llama, tiny_tokenizer
from moekit.checkpoint.upcycle_model import upcycle

FAMILIES = sorted(TINY_HF_MOE)


def save_moekit(folder):
    import moekit

    moekit.save(upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=2, init={"method": "noise"})), folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every tiny transformers MoE family saved by transformers itself (the Hub's classic per-expert names where the
    family has them), and a moekit checkpoint."""
    root = tmp_path_factory.mktemp("streamed")
    out = {}
    for name, build in TINY_HF_MOE.items():
        build().save_pretrained(root / name)
        out[name] = root / name
    out["moekit"] = save_moekit(root / "moekit")
    return out


def batches(seed=0) -> list[Batch]:
    """Three batches in two languages, with padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lang, (b, s, cut) in zip(["en", "fr", "en"], [(3, 9, 4), (2, 7, 2), (1, 5, 5)]):
        ids = torch.randint(3, 128, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[-1, cut:] = 0
        out.append(Batch(lang, ids, mask))
    return out


def loaded(folder):
    from moekit.checkpoint.format import load_model

    return load_model(folder).float().eval()


@pytest.mark.parametrize("family", [*FAMILIES, "moekit"])
def test_streamed_trace_equals_the_in_memory_one(checkpoints, family):
    """float32: the same ids and weights, bit for bit, and the same saliency sums, from one layer at a time (also
    with the hidden states spilled to a temporary folder)."""
    data = batches()
    want = collect_in_memory(loaded(checkpoints[family]), data)
    for spill in (False, True):
        got = collect_streamed(checkpoints[family], data, dtype=torch.float32, spill=spill)
        assert got.layers == want.layers and got.languages == want.languages
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.weights, want.weights)
        np.testing.assert_array_equal(got.token, want.token)
        np.testing.assert_allclose(got.saliency, want.saliency, rtol=1e-6, atol=1e-6)
        assert want.saliency[..., 0].sum() == (want.ids >= 0).sum()  # every routed (token, slot) counted once


def test_bfloat16_streamed_trace_agrees_with_the_in_memory_one(checkpoints):
    """bfloat16 weights: the same computation in the same order, so the same decisions."""
    data = batches()
    want = collect_in_memory(loaded(checkpoints["qwen3_moe"]).to(torch.bfloat16), data)
    got = collect_streamed(checkpoints["qwen3_moe"], data, dtype=torch.bfloat16)
    assert (got.ids == want.ids).mean() == 1.0


@pytest.mark.parametrize("family", [*FAMILIES, "moekit"])
def test_experts_loaded_a_few_at_a_time_give_the_same_trace(checkpoints, family):
    """A layer bigger than memory: its experts load 1 or 3 at a time (the last part smaller) and run on every
    batch's inputs before the layer does. The same decisions as with the whole layer loaded, and the same weights
    and saliency sums up to the order in which a token's weighted expert outputs are added (float32); spilled too."""
    data = batches()
    want = collect_streamed(checkpoints[family], data, dtype=torch.float32)
    for n, spill in ((1, False), (3, True)):
        got = collect_streamed(checkpoints[family], data, dtype=torch.float32, spill=spill, experts_per_load=n)
        assert got.layers == want.layers and np.array_equal(got.ids, want.ids), n
        np.testing.assert_allclose(got.weights, want.weights, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.saliency, want.saliency, rtol=1e-5, atol=1e-6)


def test_experts_in_parts_are_never_held_whole(checkpoints, monkeypatch):
    """The layer loads with its experts left on the meta device, and each read holds at most n of them: the parts
    cover every expert once per MoE layer. With little memory available, the parts are chosen by it. The checkpoint's
    files are unchanged (hashed before and after)."""
    from moekit.checkpoint.layerwise import LayerStream
    from moekit.routing import streamed

    reads = []
    load_experts = LayerStream.load_experts

    def spy(self, path, start, stop, device="cpu"):
        assert all(p.is_meta for p in self.model.get_submodule(path).parameters())
        reads.append((path, start, stop))
        return load_experts(self, path, start, stop, device)

    monkeypatch.setattr(LayerStream, "load_experts", spy)
    folder = checkpoints["qwen3_moe"]
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    want = collect_streamed(folder, batches(), dtype=torch.float32)
    sites = find_sites(loaded(folder))
    collect_streamed(folder, batches(), dtype=torch.float32, experts_per_load=3)
    E = sites[0].num_experts
    parts = [(i, min(E, i + 3)) for i in range(0, E, 3)]
    assert reads == [(f"{s.name}.experts", a, b) for s in sites for a, b in parts]
    # as much memory as 2.5 experts take, times 4: 2 at a time
    one = sites[0].params_per_expert * 4
    assert streamed.per_load(sites[0], torch.float32, "cpu") == E  # this machine holds a tiny layer whole
    monkeypatch.setattr(streamed, "available_memory", lambda: 10 * one)
    assert streamed.per_load(sites[0], torch.float32, "cpu") == 2
    reads.clear()
    got = collect_streamed(folder, batches(), dtype=torch.float32, spill=False)
    assert {b - a for _, a, b in reads} == {2} and np.array_equal(got.ids, want.ids)
    with pytest.raises(ConfigError, match="experts_per_load must be at least 1"):
        collect_streamed(folder, batches(), experts_per_load=0)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before  # read only


def test_llama4_experts_in_parts_keep_no_copy_per_expert(tmp_path, monkeypatch):
    """Llama 4's experts take every expert's copy of the tokens scaled by its score, (E·T, H): loaded in parts, a
    streamed capture keeps per batch the tokens (T, H), the router's scores (T, E) and the experts' summed output
    (T, H), never the E copies (Llama 4 Maverick's 128 experts would make them 128 times the hidden states), and
    gives the whole layer's decisions."""
    from moekit.routing import streamed
    from moekit.testing.families import tiny_family_model

    tiny_family_model("llama4_text").save_pretrained(tmp_path)
    shapes, put = [], streamed.HiddenStates.put

    def spy(self, b, h):
        shapes.extend(t.shape for t in (h if isinstance(h, tuple) else (h,)))
        put(self, b, h)

    want = collect_streamed(tmp_path, batches(), dtype=torch.float32)
    monkeypatch.setattr(streamed.HiddenStates, "put", spy)
    got = collect_streamed(tmp_path, batches(), dtype=torch.float32, experts_per_load=1)
    assert np.array_equal(got.ids, want.ids)
    tokens = max(b.input_ids.numel() for b in batches())
    assert shapes and max(s[0] for s in shapes) <= tokens


IN_PARTS_PEAK = textwrap.dedent('''
    import sys, torch
    from moekit._fs import peak_memory
    from moekit.routing.streamed import Batch, collect_streamed
    ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    n = int(sys.argv[2]) or None
    trace = collect_streamed(sys.argv[1], [Batch("en", ids, torch.ones_like(ids))], experts_per_load=n)
    print(trace.ids.sum(), peak_memory())
''')


def test_experts_in_parts_lower_the_peak_by_the_layer(tmp_path):
    """A layer whose experts take 96 MiB in float32 (64 experts of 3 x 256 x 512): loaded 4 at a time, the streamed
    capture peaks at least 64 MiB lower than with the whole layer, with the same decisions."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=64, num_experts_per_tok=4, tie_word_embeddings=False)
    tf.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
    got = {}
    for n in (0, 4):
        res = subprocess.run([sys.executable, "-c", IN_PARTS_PEAK, str(tmp_path), str(n)], capture_output=True,
                             text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        assert res.returncode == 0, res.stderr[-2000:]
        got[n] = [int(v) for v in res.stdout.split()[-2:]]
    assert got[4][0] == got[0][0]  # the same experts chosen
    assert got[4][1] <= got[0][1] - (64 << 20), got


def test_the_model_of_a_checkpoint_far_bigger_than_memory_builds_without_allocating(tmp_path):
    """The streamed capture's model of a config whose one fused experts tensor is 4x this machine's memory (1024
    experts of 2 x 2048 x 8192 + in float32): built on the meta device with real rotary frequencies, as transformers'
    from_pretrained builds it. accelerate's init_empty_weights(include_buffers=False), used before, allocated each
    parameter before moving it to the meta device, and the allocation was refused (a DeepSeek-V3 layer's fused
    experts are 30 GB in float32)."""
    import os

    import transformers as tf

    from moekit.checkpoint.dense import meta_model

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    experts = max(1024, 4 * memory // (2 * 2048 * 8192 * 4))
    cfg = tf.Qwen3MoeConfig(vocab_size=1000, hidden_size=8192, moe_intermediate_size=2048, num_experts=experts,
                            num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                            rope_theta=1e6)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(tmp_path)
    model = meta_model(tmp_path, buffers=True)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.is_meta and gate_up.numel() * 4 > 4 * memory
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    want = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    assert torch.equal(model.model.rotary_emb.inv_freq, want)


def _independent_sums(model, data) -> np.ndarray:
    """(Λ, L, E, 6) count, Σ g, Σ ‖f‖, Σ g‖f‖, Σ p, Σ p‖f‖ from forward hooks on the experts and plain matmuls of
    their fused weights (f = down · act(gate x) ⊙ up x) and of the router's (p = softmax(W x) over all experts), not
    the experts' or the router's own forward."""
    sites = find_sites(model)
    langs = list(dict.fromkeys(b.language for b in data))
    sums = np.zeros((len(langs), len(sites), max(s.num_experts for s in sites), 6))
    current = {}

    def hook(li, router):
        def fn(experts, args):
            x, ids, w = args[:3]
            keep = current["mask"]
            x, ids, w = x[keep].double(), ids[keep], w[keep].double()
            probs = torch.softmax(x @ router.weight.double().T, dim=-1)  # (T, E)
            for t in range(x.shape[0]):
                for s in range(ids.shape[1]):
                    e = int(ids[t, s])
                    gate, up = (experts.gate_up_proj[e].double() @ x[t]).chunk(2)
                    f = experts.down_proj[e].double() @ (F.silu(gate) * up)
                    g, p, norm = float(w[t, s]), float(probs[t, e]), float(f.norm())
                    sums[current["lang"], li, e] += [1.0, g, norm, g * norm, p, p * norm]
        return fn

    handles = [s.experts.register_forward_pre_hook(hook(i, s.router)) for i, s in enumerate(sites)]
    try:
        with torch.no_grad():
            for b in data:
                current.update(mask=b.attention_mask.bool().reshape(-1), lang=langs.index(b.language))
                model(input_ids=b.input_ids, attention_mask=b.attention_mask)
    finally:
        for h in handles:
            h.remove()
    return sums


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])  # renormalized top-k (Qwen3-MoE's norm_topk_prob)
def test_saliency_sums_equal_an_independent_computation(checkpoints, family):
    model, data = loaded(checkpoints[family]), batches()
    got = collect_streamed(checkpoints[family], data, dtype=torch.float32).saliency
    np.testing.assert_allclose(got, _independent_sums(model, data), rtol=1e-5, atol=1e-5)


PEAK = textwrap.dedent('''
    import sys, torch
    from moekit._fs import peak_memory
    from moekit.routing.streamed import Batch, collect_streamed
    ids = torch.randint(3, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    collect_streamed(sys.argv[1], [Batch("en", ids, torch.ones_like(ids))])
    print(peak_memory())
''')


def test_streamed_memory_is_flat_in_the_number_of_layers(tmp_path):
    """The same width with 2 and 6 layers (each layer ~50 MB of experts): the streamed capture's peak RSS differs
    by at most 10 % (the in-memory one would triple its weights)."""
    import transformers as tf

    peaks = {}
    for layers in (2, 6):
        cfg = tf.Qwen3MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                num_experts=64, num_experts_per_tok=4, tie_word_embeddings=False)
        tf.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / f"m{layers}")
        res = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / f"m{layers}")], capture_output=True,
                             text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        assert res.returncode == 0, res.stderr[-2000:]
        peaks[layers] = int(res.stdout.split()[-1])
    assert peaks[6] <= 1.10 * peaks[2], peaks


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_removed_experts_load_in_transformers_as_the_disabled_model(checkpoints, tmp_path, family, mode):
    """prune --keep/--drop writes the same family with 4 of 8 experts per MoE layer, one tensor at a time; plain
    transformers loads it (no missing or unexpected weight) and its float32 logits equal the original model's with
    the other experts disabled (moekit.selection.prune)."""
    import transformers as tf

    from moekit.checkpoint.remove import remove_experts
    from moekit.selection.prune import kept_experts, prune
    from moekit.selection.selection import Selection
    from moekit.testing import tiny_inputs

    model = loaded(checkpoints[family])
    sites = find_sites(model)
    chosen = [0, 1, 4, 5] if mode == "keep" else [2, 3, 6, 7]
    selection = Selection(method="manual", budget=4 * len(sites), experts={s.name: chosen for s in sites})
    keep = kept_experts(checkpoints[family], selection, mode)
    assert all(ids == [0, 1, 4, 5] for ids in keep.values())
    remove_experts(checkpoints[family], tmp_path / "out", keep)
    out, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    prune(model, {s.name: [2, 3, 6, 7] for s in sites})
    x = tiny_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(out.eval()(**x).logits, model(**x).logits, rtol=1e-5, atol=1e-5)


def test_one_shot_selectors_rank_by_their_criteria():
    """usage, reap and ean on hand-made sums: the per-layer top N by count, Σg‖f‖/count and Σ‖f‖, ties to the lower
    id, one language or all."""
    from moekit.routing.trace import RoutingTrace
    from moekit.selection import select

    ids = np.zeros((2, 1, 2), dtype=np.int16)
    ids[:, 0, 1] = 1
    sums = np.zeros((2, 2, 4, 4))  # (Λ, L, E, [count, gate, norm, gate_norm])
    sums[0, 0] = [[4, 2, 8, 1], [1, 1, 9, 5], [2, 1, 1, 4], [0, 0, 0, 0]]  # reap: 0.25, 5, 2, 0; ean: 8, 9, 1, 0
    sums[1, 0] = [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [9, 1, 20, 30]]
    sums[:, 1] = [[1, 1, 1, 1]] * 4  # a tie everywhere: the lower ids win
    trace = RoutingTrace(["a", "b"], np.array([4, 4]), ["en", "fr"], ids, np.full((2, 1, 2), 0.5, np.float32),
                         np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int16),
                         {}, sums)
    kept = {m: select(trace, m, None, top=2).experts for m in ("usage", "reap", "ean")}
    assert kept == {"usage": {"a": [0, 3], "b": [0, 1]}, "reap": {"a": [1, 3], "b": [0, 1]},
                    "ean": {"a": [1, 3], "b": [0, 1]}}
    assert select(trace, "usage", "en", top=2).experts == {"a": [0, 2], "b": [0, 1]}
    assert select(trace, "reap", "en", top=2).scores["a"] == [0.25, 5.0, 2.0, 0.0]
    # groups of consecutive experts ({0, 1}, {2, 3}) keep their best each: EAN's two best (0, 1) share a group
    assert select(trace, "ean", "en", top=2).experts == {"a": [0, 1], "b": [0, 1]}
    assert select(trace, "ean", "en", top=2, groups=2).experts == {"a": [1, 2], "b": [0, 2]}
    with pytest.raises(ConfigError, match="groups 3 must divide top 2 and every layer's experts"):
        select(trace, "ean", None, top=2, groups=3)


def test_removal_of_an_uneven_selection_from_group_limited_routing_names_the_fix(tmp_path):
    """DeepSeek-V3's group-limited routing (8 experts in 2 groups): removing 3 of one group and 1 of the other is
    refused, naming groups=2 (`select --groups 2`); the REAP selection with groups 2 removes, and computes as the experts disabled."""
    from moekit.checkpoint.remove import remove_experts
    from moekit.selection import select
    from moekit.selection.prune import prune

    model = TINY_HF_MOE["deepseek_v3"]()
    model.save_pretrained(tmp_path / "src")
    sites = find_sites(model)
    with pytest.raises(ConfigError, match=r"keeps \(3, 1\) per group .*groups=2"):
        remove_experts(tmp_path / "src", tmp_path / "bad", {s.name: [0, 1, 2, 4] for s in sites})
    assert not (tmp_path / "bad").exists()
    sel = select(collect_streamed(tmp_path / "src", batches(), dtype=torch.float32), "reap", None, top=4, groups=2)
    assert all(sorted(i // 4 for i in ids) == [0, 0, 1, 1] for ids in sel.experts.values())
    remove_experts(tmp_path / "src", tmp_path / "out", sel.experts)
    import transformers as tf

    out = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    prune(model, {n: sorted(set(range(8)) - set(ids)) for n, ids in sel.experts.items()})
    x = batches()[0].input_ids
    with torch.no_grad():
        torch.testing.assert_close(out(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_collect_select_reap_and_prune_keep_from_the_command_line(tmp_path, run, monkeypatch):
    """routes collect (--stream auto: on when the weights exceed half the available memory) -> select reap --top 4
    -> prune --keep: a Qwen3-MoE with 4 experts per layer that transformers loads, whose logits equal the original's
    with the other experts disabled; the streamed trace equals --stream off's."""
    import transformers as tf

    import moekit._fs
    from moekit.routing.trace import RoutingTrace
    from moekit.selection.prune import prune
    from moekit.selection.selection import Selection
    from moekit.testing import tiny_inputs, tiny_qwen3_moe

    model = tiny_qwen3_moe().eval()
    model.save_pretrained(tmp_path / "q3")
    tiny_tokenizer().save_pretrained(tmp_path / "q3")
    (tmp_path / "en.txt").write_text("the day was long\nthe light is good\nwe walk home\n")
    monkeypatch.setattr(moekit._fs, "available_memory", lambda: 1000)  # --stream auto sees a model bigger than memory
    rc, out, err = run("routes", "collect", "--model", tmp_path / "q3", "--texts", f"en={tmp_path / 'en.txt'}",
                       "--out", tmp_path / "t.npz")
    assert rc == 0, err
    assert "one layer at a time" in out and "recording 3/3 model.layers.2" in err
    streamed = RoutingTrace.load(tmp_path / "t.npz")
    assert streamed.meta["streamed"] is True and streamed.saliency is not None
    rc, _, err = run("routes", "collect", "--model", tmp_path / "q3", "--texts", f"en={tmp_path / 'en.txt'}",
                     "--out", tmp_path / "t2.npz", "--stream", "off")
    assert rc == 0, err
    np.testing.assert_array_equal(RoutingTrace.load(tmp_path / "t2.npz").ids, streamed.ids)
    rc, _, err = run("select", "reap", tmp_path / "t.npz", "--top", 4, "--out", tmp_path / "s.json")
    assert rc == 0, err
    kept = Selection.load(tmp_path / "s.json").experts
    assert all(len(ids) == 4 for ids in kept.values())
    rc, _, err = run("prune", "--model", tmp_path / "q3", "--experts", tmp_path / "s.json", "--keep",
                     "--out", tmp_path / "p")
    assert rc == 0, err
    pruned = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "p").eval()
    assert pruned.config.num_experts == 4
    prune(model, {layer: [e for e in range(8) if e not in ids] for layer, ids in kept.items()})
    x = tiny_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(pruned(**x).logits, model(**x).logits, rtol=1e-5, atol=1e-5)


def _bf16_qwen3_moe(folder):
    from moekit.testing import tiny_qwen3_moe

    tiny_qwen3_moe().to(torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_stream_on_and_off_give_one_trace(tmp_path, run):
    """Both modes compute in --dtype (default float32) and record it: a bf16 checkpoint gives one trace whichever mode
    --stream auto picks on a given machine (they once differed in 3 % of the ids: streamed ran in bf16)."""
    from moekit.routing.trace import RoutingTrace

    model = _bf16_qwen3_moe(tmp_path / "m")
    (tmp_path / "en.txt").write_text("the day was long\nthe light is good and the world\nwe walk home\n")
    traces = {}
    for mode in ("on", "off"):
        rc, _, err = run("routes", "collect", "--model", model, "--texts", f"en={tmp_path / 'en.txt'}", "--stream", mode,
                         "--out", tmp_path / f"{mode}.npz")
        assert rc == 0, err
        traces[mode] = RoutingTrace.load(tmp_path / f"{mode}.npz")
    a, b = traces["on"], traces["off"]
    assert a.meta["dtype"] == b.meta["dtype"] == "float32" and a.meta["streamed"] and not b.meta["streamed"]
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights, b.weights)


def test_stream_auto_decides_from_the_whole_models_predicted_peak(tmp_path, monkeypatch):
    """auto: the whole model when LOAD_PEAK × its weights in the compute dtype fit in IN_MEMORY_SHARE of the memory
    available (not the checkpoint's bytes: a bf16 checkpoint loads in float32 at twice its size)."""
    import moekit._fs
    from moekit import routes

    model = _bf16_qwen3_moe(tmp_path / "m")
    numel = sum(p.numel() for p in loaded(model).parameters())
    peak = routes.in_memory_peak(model, torch.float32)
    assert peak == int(routes.LOAD_PEAK * numel * 4)
    for memory, streamed in ((peak / routes.IN_MEMORY_SHARE * 1.01, False), (peak / routes.IN_MEMORY_SHARE * 0.99, True)):
        monkeypatch.setattr(moekit._fs, "available_memory", lambda memory=memory: int(memory))
        assert routes.too_big_to_load(model, torch.float32) is streamed


def test_routes_collect_resolves_a_hub_id_from_the_cache(tmp_path, run, monkeypatch):
    """`routes collect --model org/name` reads the model from the Hugging Face cache (filled by huggingface_hub from a
    fake Hub on 127.0.0.1), as upcycle does: the trace equals the one of the same model given as a directory."""
    from moekit.routing.trace import RoutingTrace
    from moekit.testing.fake_hub import download

    model = _bf16_qwen3_moe(tmp_path / "m")
    download(tmp_path / "hub", {"org/moe": model})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "en.txt").write_text("the day was long\nwe walk home\n")
    for name, source in (("hub", "org/moe"), ("dir", model)):
        rc, _, err = run("routes", "collect", "--model", source, "--texts", f"en={tmp_path / 'en.txt'}",
                         "--out", tmp_path / f"{name}.npz")
        assert rc == 0, err
    a, b = RoutingTrace.load(tmp_path / "hub.npz"), RoutingTrace.load(tmp_path / "dir.npz")
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights, b.weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_shapes_cover_every_tensor_of_both_layouts(checkpoints, tmp_path, family):
    """The shapes the config's model gives (moekit.checkpoint.dense.stored_shapes) name every tensor transformers
    writes, in the Hub's per-expert layout and in transformers 5's fused one, with the shape written; one expert
    tensor's header transposed (the same byte count) is refused, naming the tensor and both shapes."""
    import json
    import re
    import struct

    from moekit.checkpoint.dense import check_stored_shapes, meta_model, stored_shapes
    from moekit.checkpoint.files import read_headers
    from moekit.errors import CheckpointError

    TINY_HF_MOE[family]().save_pretrained(tmp_path / "fused", save_original_format=False)
    want = stored_shapes(meta_model(checkpoints[family]))
    for folder in (checkpoints[family], tmp_path / "fused"):
        assert {k: tuple(i.shape) for k, i in read_headers(folder).items()}.items() <= want.items()
    data = (checkpoints[family] / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = next(k for k, v in header.items() if ".experts." in k and len(set(v.get("shape", ()))) == 2)
    header[name]["shape"] = header[name]["shape"][::-1]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_bytes((checkpoints[family] / "config.json").read_bytes())
    (tmp_path / "bad" / "model.safetensors").write_bytes(data[:8] + text + data[8 + n:])
    shape = header[name]["shape"]
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is \[{shape[0]}, {shape[1]}\] in the weights but "
                                              rf"\[{shape[1]}, {shape[0]}\] by its config\.json$"):
        check_stored_shapes(tmp_path / "bad", meta_model(tmp_path / "bad"))


@pytest.mark.parametrize("renormalize", [False, True])
def test_reap_gate_applied_or_plain_softmax_on_a_top1_qwen3_moe(renormalize):
    """Closed form on a top-1 Qwen3-MoE. Without norm_topk_prob the model applies the plain softmax p: both gates
    give one sum. With it, every applied weight is p / p = 1, so Σ g = count and Σ g‖f‖ = Σ ‖f‖, while Σ p‖f‖ stays
    below Σ ‖f‖ (p < 1 among 8 experts); `reap` ranks by Σ g‖f‖ / count, and with gate "softmax" by Σ p‖f‖ / count
    (REAP's reference code's default)."""
    from moekit.routing.trace import SALIENCY
    from moekit.selection import select
    from moekit.testing import tiny_qwen3_moe

    trace = collect_in_memory(tiny_qwen3_moe(num_experts_per_tok=1, norm_topk_prob=renormalize).eval(), batches())
    count, g, norm, g_norm, p, p_norm = np.moveaxis(trace.saliency.sum(0), -1, 0)  # (L, E) each
    assert SALIENCY == ("count", "gate", "norm", "gate_norm", "softmax", "softmax_norm")
    routed = count > 0
    assert (p[routed] < count[routed]).all() and (p_norm[routed] < norm[routed]).all()
    if renormalize:
        np.testing.assert_array_equal(g, count)
        np.testing.assert_allclose(g_norm, norm, rtol=1e-6)
    else:
        np.testing.assert_allclose(g, p, rtol=1e-6)
        np.testing.assert_allclose(g_norm, p_norm, rtol=1e-6)
    mean = lambda s: np.divide(s, count, out=np.zeros_like(s), where=routed)  # noqa: E731
    for gate, want in (("applied", mean(g_norm)), ("softmax", mean(p_norm))):
        got = select(trace, "reap", None, top=2, gate=gate).scores
        np.testing.assert_allclose(np.array(list(got.values())), want, rtol=1e-12)
