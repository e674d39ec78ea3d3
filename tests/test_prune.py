"""Pruning: disabled experts are never picked, the top-k is renormalized over the rest, and it survives save/load."""
from moekit.moe.state import model_state
import pytest
import torch

from moekit.errors import ConfigError, OutputExistsError, UnsupportedModelError
from moekit.checkpoint.format import load_model, save
from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.routing.sites import find_sites
from moekit.selection.prune import load_pruned, prune, save_pruned
from moekit.selection.selection import Selection
from moekit.testing import TINY_HF_MOE, tiny_llama, tiny_tokenizer
from moekit.checkpoint.upcycle_model import upcycle


def moekit_model(scoring="topk_softmax"):
    spec = MoESpec(num_experts=8, top_k=2, every=1, init={"method": "noise", "std": 0.02},
                   router={"scoring": scoring, "init": "normal"})
    return upcycle(tiny_llama(), spec).eval()


MODELS = {**TINY_HF_MOE, "moekit": moekit_model, "moekit_softmax_topk": lambda: moekit_model("softmax_topk")}
SOFTMAX = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "moekit", "moekit_softmax_topk"]
IDS = torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(0))


def disabled(model):
    """Experts 0, 3, 5 in the first MoE layer, 1 and 2 in the last (two per group for DeepSeek-V3)."""
    sites = find_sites(model)
    return {sites[0].name: [0, 3, 5], sites[-1].name: [1, 2]}


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def capture(model):
    """The trace and, per layer, the router logits (T, E) of one forward."""
    seen = {}
    sites = find_sites(model)
    hooks = [s.router.register_forward_hook(lambda m, a, out, n=s.name: seen.__setitem__(n, out[0].detach()))
             for s in sites if not s.is_moekit]
    with RoutingCapture(model) as cap:
        cap.run(IDS, None, language="x")
    for h in hooks:
        h.remove()
    seen.update({s.name: s.block.last_routing.logits.detach() for s in sites if s.is_moekit})
    return cap.trace(), seen


@pytest.mark.parametrize("family", sorted(MODELS))
def test_disabled_experts_never_routed(family):
    model = MODELS[family]()
    sel = disabled(model)
    used = lambda trace, li: set(trace.ids[li].ravel().tolist())  # noqa: E731
    before, _ = capture(model)
    assert any(used(before, li) & set(sel.get(n, [])) for li, n in enumerate(before.layers))  # not vacuous
    prune(model, sel)
    after, _ = capture(model)
    for li, name in enumerate(after.layers):
        assert not used(after, li) & set(sel.get(name, [])), name


@pytest.mark.parametrize("family", sorted(MODELS))
def test_nothing_disabled_is_bit_identical(family):
    model = MODELS[family]()
    before = logits(model)
    handle = prune(model, {s.name: [] for s in find_sites(model)})  # every layer re-applies its rule
    assert torch.equal(logits(model), before)
    handle.remove()
    assert not model_state(model).pruned


@pytest.mark.parametrize("family", SOFTMAX)
def test_weights_are_renormalized_softmax_over_the_rest(family):
    model = MODELS[family]()
    sel = disabled(model)
    prune(model, sel)
    trace, router_logits = capture(model)
    for li, site in enumerate(find_sites(model)):
        keep = [e for e in range(site.num_experts) if e not in sel.get(site.name, [])]
        p = torch.softmax(router_logits[site.name][:, keep].double(), dim=-1)  # (T, E') over the rest only
        w, i = p.topk(site.top_k, dim=-1)  # (T, k)
        renorm = family in ("mixtral", "moekit", "qwen3_moe") or getattr(site.router, "norm_topk_prob", False)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        assert torch.equal(torch.tensor(trace.ids[li]), torch.tensor(keep)[i]), site.name
        torch.testing.assert_close(torch.tensor(trace.weights[li]).double(), w, atol=1e-6, rtol=1e-5)


def test_deepseek_bias_and_group_limit():
    model = TINY_HF_MOE["deepseek_v3"]()  # 8 experts in 2 groups of 4, 1 group searched, top-2
    site = find_sites(model)[-1]
    handle = prune(model, {site.name: [1, 2]})
    bias = site.router.e_score_correction_bias
    assert torch.isinf(bias[[1, 2]]).all() and (bias[[0, 3, 4, 5, 6, 7]] == 0).all()
    handle.remove()
    assert (bias == 0).all()
    # 3 of group 0 off: that group scores -inf, but the other group holds 4 experts: fine
    prune(model, {site.name: [0, 1, 2]}).remove()
    # one expert left per group: both groups score -inf, the chosen group may hold 1 < top_k experts
    with pytest.raises(ConfigError, match="groups"):
        prune(model, {site.name: [0, 1, 2, 4, 5, 6]})


def test_errors():
    model = TINY_HF_MOE["mixtral"]()
    name = find_sites(model)[0].name
    with pytest.raises(ConfigError, match="fewer than top_k"):
        prune(model, {name: list(range(7))})
    with pytest.raises(ConfigError, match="does not have"):
        prune(model, {"nope": [0]})
    handle = prune(model, {name: [0]})
    with pytest.raises(ConfigError, match="already pruned"):
        prune(model, {name: [1]})
    handle.remove()
    other = find_sites(model)[1]
    weight = other.router.weight
    del other.router.weight
    other.router.register_buffer("weight", weight[:5].detach())  # fewer rows than experts: no expert-row weight
    with pytest.raises(UnsupportedModelError, match="has no weight with a row per expert"):
        prune(model, {name: [0], other.name: [1]})
    assert not model_state(model).pruned  # nothing was changed


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "phimoe", "moekit"])
def test_save_load_round_trip(family, tmp_path):
    model = MODELS[family]()
    original = logits(model)
    prune(model, disabled(model))
    pruned = logits(model)
    assert not torch.equal(pruned, original)
    save_pruned(model, tmp_path / "p")
    assert (tmp_path / "p" / "pruned_experts.json").is_file()
    for loaded in (load_pruned(tmp_path / "p"), load_model(tmp_path / "p")):
        assert torch.equal(logits(loaded), pruned)
        assert model_state(loaded).pruned == disabled(model)
    with pytest.raises(OutputExistsError):
        save_pruned(model, tmp_path / "p")


def test_cli_prune(tmp_path, run):
    model = TINY_HF_MOE["qwen3_moe"]()
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    Selection(method="manual", budget=5, experts=disabled(model)).save(tmp_path / "sel.json")
    rc, stdout, err = run("prune", "--model", tmp_path / "m", "--experts", tmp_path / "sel.json", "--out", tmp_path / "p")
    assert rc == 0, err
    assert "disabled 5 experts in 2 layers" in stdout
    prune(model, disabled(model))
    assert torch.equal(logits(load_model(tmp_path / "p")), logits(model))
    assert (tmp_path / "p" / "tokenizer.json").is_file()
    rc, _, err = run("prune", "--model", tmp_path / "m", "--experts", tmp_path / "sel.json", "--out", tmp_path / "p")
    assert rc == 2 and "--overwrite" in err


def test_moekit_save_keeps_pruning(tmp_path):
    """moekit.save (also used by the trainer's checkpoints) writes pruned_experts.json too."""
    model = moekit_model()
    prune(model, disabled(model))
    save(model, tmp_path / "plain")
    loaded = load_model(tmp_path / "plain")
    assert model_state(loaded).pruned == disabled(model)
    assert torch.equal(logits(loaded), logits(model))


def test_keep_prunes_moekits_own_qwen3_moe_export(tmp_path, run):
    """moekit's Qwen3-MoE export writes both num_experts and num_local_experts (one count): `prune --keep` reads it as
    one count and updates both (issue 37: it refused "not a transformers MoE config with one expert count")."""
    import json

    from moekit.testing import tiny_qwen3, tiny_tokenizer

    tiny_qwen3().save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    rc, _, err = run("upcycle", "--model", tmp_path / "dense", "--method", "drop", "--experts", 4, "--top-k", 2,
                     "--format", "qwen3_moe", "--out", tmp_path / "q3")
    assert rc == 0, err
    config = json.loads((tmp_path / "q3" / "config.json").read_text())
    assert config["num_experts"] == config["num_local_experts"] == 4
    layers = config["num_hidden_layers"]
    sel = {"method": "manual", "budget": 2 * layers,
           "experts": {f"model.layers.{i}.mlp": [0, 2] for i in range(layers)}}
    (tmp_path / "keep.json").write_text(json.dumps(sel))
    rc, _, err = run("prune", "--model", tmp_path / "q3", "--experts", tmp_path / "keep.json", "--keep",
                     "--out", tmp_path / "p")
    assert rc == 0, err
    pruned = json.loads((tmp_path / "p" / "config.json").read_text())
    assert pruned["num_experts"] == pruned["num_local_experts"] == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "p")  # plain transformers loads the output
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2


def test_a_selection_names_the_model_it_was_made_for(tmp_path, run):
    """routes collect records the model's config digest (one digest from both --stream modes); select carries it,
    with the trace's layers, expert counts and file, into the selection. prune --keep takes it for that model, refuses
    it for a Qwen3-MoE with the same layer names and expert counts but another config (naming what differs), and
    takes it there with --allow-other-model. A reap selection without a source (an older moekit's) is taken with one
    warning line, a hand-written one silently (issue 37 §4)."""
    import json

    from moekit.checkpoint.dense import load_config
    from moekit.routing.trace import RoutingTrace, config_digest
    from moekit.selection.selection import Source
    from moekit.testing import tiny_qwen3_moe

    for name, model in (("q3", tiny_qwen3_moe()), ("other", tiny_qwen3_moe(seed=1, norm_topk_prob=False))):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    (tmp_path / "en.txt").write_text("the day was long\nwe walk home\n")
    digest = config_digest(load_config(tmp_path / "q3"))
    for mode in ("on", "off"):
        rc, _, err = run("routes", "collect", "--model", tmp_path / "q3", "--texts", f"en={tmp_path / 'en.txt'}",
                         "--out", tmp_path / f"{mode}.npz", "--stream", mode)
        assert rc == 0, err
        assert RoutingTrace.load(tmp_path / f"{mode}.npz").meta["config_sha256"] == digest
    rc, _, err = run("select", "reap", tmp_path / "on.npz", "--top", 4, "--out", tmp_path / "s.json")
    assert rc == 0, err
    sel = Selection.load(tmp_path / "s.json")
    layers = {f"model.layers.{i}.mlp": 8 for i in range(3)}
    assert sel.source == Source(config_sha256=digest, experts=layers, trace=str(tmp_path / "on.npz"))

    def prune_keep(model, selection, out, *extra):
        return run("prune", "--model", tmp_path / model, "--experts", selection, "--keep", "--out", tmp_path / out,
                   *extra)

    rc, _, err = prune_keep("q3", tmp_path / "s.json", "p1")
    assert rc == 0 and "warning" not in err, err
    rc, _, err = prune_keep("other", tmp_path / "s.json", "p2")
    other = config_digest(load_config(tmp_path / "other"))
    assert rc == 2 and err.splitlines()[-1] == (
        f"moekit: error: the selection was made for another model (trace {tmp_path / 'on.npz'}): its config (sha256 "
        f"{digest[:12]}) is not this model's ({other[:12]}); pass --allow-other-model to use it anyway")
    assert not (tmp_path / "p2").exists()
    rc, _, err = prune_keep("other", tmp_path / "s.json", "p2", "--allow-other-model")
    assert rc == 0, err
    older = {k: v for k, v in json.loads((tmp_path / "s.json").read_text()).items() if k != "source"}
    (tmp_path / "older.json").write_text(json.dumps(older))
    (tmp_path / "manual.json").write_text(json.dumps({**older, "method": "manual"}))
    rc, _, err = prune_keep("other", tmp_path / "older.json", "p3")
    assert rc == 0 and [line for line in err.splitlines() if "warning" in line] == [
        "moekit: warning: the reap selection does not record the model it was made for (made by an older moekit): "
        "only its layers and expert ids are checked"]
    rc, _, err = prune_keep("other", tmp_path / "manual.json", "p4")
    assert rc == 0 and "warning" not in err, err
