"""Selective fine-tuning: only the selected expert rows change, inside fused 3-D expert tensors."""
import json

import pytest
import torch

from moekit.errors import ConfigError
from moekit.checkpoint.format import load_model
from moekit.moe.spec import MoESpec
from moekit.routing.capture import RoutingCapture
from moekit.routing.sites import find_sites
from moekit.selection.finetune import attach, merge
from moekit.training.finetune import train_selected
from moekit.selection.selection import Selection
from moekit.testing import TINY_HF_MOE, tiny_llama, tiny_tokenizer
from moekit.checkpoint.upcycle_model import upcycle


def upcycled(num_experts=4, top_k=2):
    spec = MoESpec(num_experts=num_experts, top_k=top_k, every=1, init={"method": "noise", "std": 0.02},
                   router={"init": "normal"})
    return upcycle(tiny_llama(), spec).eval()


MODELS = {"mixtral": TINY_HF_MOE["mixtral"], "qwen3_moe": TINY_HF_MOE["qwen3_moe"],
          "deepseek_v3": TINY_HF_MOE["deepseek_v3"], "moekit": upcycled}


def selection_for(model):
    sites = find_sites(model)
    return {sites[0].name: [1, 3], sites[-1].name: [0]}


def adamw_steps(model, params, steps=4, seed=0):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, 128, (4, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def expert_tensor_names(model, layer):
    site = {s.name: s for s in find_sites(model)}[layer]
    return [f"{layer}.experts.{n}" for n, p in site.experts.named_parameters(recurse=False)
            if p.shape[0] == site.num_experts]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_only_selected_rows_change(family):
    model = MODELS[family]()
    sel = selection_for(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    per_expert = {n: sum(before[k][0].numel() for k in expert_tensor_names(model, n)) for n in sel}
    handle = attach(model, sel)
    assert handle.per_expert == per_expert
    expected = sum(len(ids) * per_expert[name] for name, ids in sel.items())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == handle.num_trainable == expected
    adamw_steps(model, [p for p in model.parameters() if p.requires_grad])
    handle.merge()
    after = model.state_dict()
    assert after.keys() == before.keys()  # plain parameters again: save/export see the usual names
    rows = {name: ids for name, ids in sel.items()}
    for key, old in before.items():
        layer = next((n for n in rows if key in expert_tensor_names(model, n)), None)
        if layer is None:  # routers, attention, norms, embeddings, shared experts, other layers
            assert torch.equal(after[key], old), key
            continue
        keep = [i for i in range(old.shape[0]) if i not in rows[layer]]
        assert torch.equal(after[key][keep], old[keep]), key
        for i in rows[layer]:
            assert not torch.equal(after[key][i], old[i]), (key, i)


def test_gradient_and_optimizer_state_are_k_rows():
    model = upcycled(num_experts=8)
    sel = selection_for(model)
    handle = attach(model, sel)
    opt = torch.optim.AdamW(handle.trainable, lr=1e-3, weight_decay=0.1)
    ids = torch.randint(3, 128, (2, 8))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for p in handle.trainable:
        assert p.shape[0] in (1, 2) and p.grad.shape == p.shape
        assert all(s.shape == p.shape for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    handle.merge()
    assert all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_expert_tensor_computed_once_per_forward():
    model = TINY_HF_MOE["mixtral"](experts_implementation="eager")  # indexes the 3-D weight per expert
    handle = attach(model, selection_for(model))
    rows = [m for m in model.modules() if type(m).__name__ == "ExpertRows"]
    outs = []  # the tensors themselves: while held, no two share an id (a freed one's id can be reused)

    def seen(module, args, out):
        outs.append(out)

    for r in rows:
        r.register_forward_hook(seen)
    model(input_ids=torch.randint(3, 128, (2, 8)))
    assert len(outs) > len(rows) == len({id(o) for o in outs})  # accessed per expert, built once per tensor
    handle.merge()


def test_bad_selections():
    model = upcycled()
    with pytest.raises(ConfigError, match="does not have"):
        attach(model, {"model.layers.9.mlp": [0]})
    with pytest.raises(ConfigError, match="distinct and in"):
        attach(model, {"model.layers.0.mlp": [0, 7]})
    with pytest.raises(ConfigError, match="nothing would train"):
        attach(model, {"model.layers.0.mlp": []})
    handle = attach(model, {"model.layers.0.mlp": [0]})
    with pytest.raises(ConfigError, match="already"):
        attach(model, {"model.layers.1.mlp": [0]})
    assert merge(model) == 2 and merge(model) == 0
    handle.merge()


def test_invariance_theorem():
    """RISE Theorem 1: if language B's tokens never route to the trained experts (router and every
    non-expert parameter frozen), B's outputs are bit-identical after training on language A."""
    model = upcycled(num_experts=16, top_k=2)
    b_ids = torch.tensor([[5, 9, 5, 9, 7, 5]])
    a_ids = torch.randint(20, 128, (4, 10), generator=torch.Generator().manual_seed(1))
    with RoutingCapture(model) as cap:
        cap.run(b_ids, None, language="B")
        cap.run(a_ids, None, language="A")
    trace = cap.trace()
    b, a = trace.lang == trace.languages.index("B"), trace.lang == trace.languages.index("A")
    sel = {name: sorted(set(range(16)) - set(trace.ids[li][b].ravel().tolist()))
           for li, name in enumerate(trace.layers)}
    a_uses = sum(len(set(trace.ids[li][a].ravel().tolist()) & set(sel[n])) for li, n in enumerate(trace.layers))
    assert a_uses > 0  # the test is not vacuous: A does reach trained experts
    with torch.no_grad():
        b_before, a_before = model(input_ids=b_ids).logits, model(input_ids=a_ids).logits
    handle = attach(model, sel)
    model.train()
    opt = torch.optim.AdamW(handle.trainable, lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        model(input_ids=a_ids, labels=a_ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=b_ids).logits, b_before)  # while training is attached
        handle.merge()
        assert torch.equal(model(input_ids=b_ids).logits, b_before)
        assert not torch.allclose(model(input_ids=a_ids).logits, a_before)


def test_train_selected_with_trainer():
    model = TINY_HF_MOE["qwen3_moe"]()
    tok = tiny_tokenizer()
    sel = Selection(method="manual", budget=2, experts=selection_for(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    log = train_selected(model, sel, tok, ["the light of the world", "", "is good and the day was long"] * 4,
                         steps=3, lr=1e-2, batch_size=2, max_length=16, weight_decay=0.1)
    assert any("loss" in e for e in log)
    changed = {k for k in before if not torch.equal(before[k], model.state_dict()[k])}
    assert changed == {f"{n}.experts.{t}" for n in sel.experts for t in ("gate_up_proj", "down_proj")}
    assert not any(type(m).__name__ == "ExpertRows" for m in model.modules())


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    TINY_HF_MOE["mixtral"]().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_inputs(tmp_path, model):
    sel = tmp_path / "selection.json"
    Selection(method="manual", budget=3, experts=selection_for(model)).save(sel)
    text = tmp_path / "sw.txt"
    text.write_text("habari ya asubuhi\nnakupenda sana\n\nasante sana rafiki\n" * 3)
    return sel, text


def test_cli_finetune_hf_model(hf_model_dir, tmp_path, run):
    original = load_model(hf_model_dir)
    sel, text = write_inputs(tmp_path, original)
    out = tmp_path / "ft"
    args = ["finetune", "--model", hf_model_dir, "--experts", sel, "--data", f"sw={text}", "--out", out,
            "--steps", 2, "--batch-size", 2, "--lr", 1e-2, "--max-length", 16]
    rc, stdout, err = run(*args)
    assert rc == 0, err
    assert "trained 3 experts" in stdout
    tuned = load_model(out)
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "finetune.json").read_text())["steps"] == 2
    a, b = original.state_dict(), tuned.state_dict()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(".experts." in k for k in changed)
    rc, _, err = run(*args)
    assert rc == 2 and "--overwrite" in err
    rc, _, err = run(*args, "--overwrite")
    assert rc == 0, err


def test_cli_finetune_moekit_model(tmp_path, run):
    model = upcycled()
    from moekit.checkpoint.format import save

    save(model, tmp_path / "moe", tokenizer=tiny_tokenizer())
    sel, text = write_inputs(tmp_path, model)
    rc, _, err = run("finetune", "--model", tmp_path / "moe", "--experts", sel, "--data", f"sw={text}",
                     "--out", tmp_path / "ft", "--steps", 2, "--batch-size", 2, "--max-length", 16)
    assert rc == 0, err
    assert (tmp_path / "ft" / "moekit.json").is_file()
    rc, _, err = run("finetune", "--model", tmp_path / "moe", "--experts", sel, "--data", "sw",
                     "--out", tmp_path / "ft2")
    assert rc == 2 and "LANG=FILE" in err


def test_train_selected_counts_epochs_of_the_effective_batch():
    """RISE §5.1's budget: epochs over the data at an effective batch split into accumulation steps."""
    model = TINY_HF_MOE["qwen3_moe"]()
    sel = Selection(method="manual", budget=2, experts=selection_for(model))
    lines = ["the light of the world", "is good and the day was long"] * 5  # 10 examples
    log = train_selected(model, sel, tiny_tokenizer(), lines, epochs=2, batch_size=4, grad_accum=2, max_length=16)
    assert max(e["step"] for e in log if "step" in e) == 2 * 3  # 2 epochs of ceil(10 / 4) optimizer steps
