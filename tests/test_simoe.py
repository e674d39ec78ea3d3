"""SIMoE (Chen, Wei & Schwarz 2025): hard-concrete closed forms, exactness at init, the masked-input
computation equals the explicit per-instance weight, routing from the prompt, the objective, save/load,
pruned and merged exports."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moekit import simoe
from moekit.errors import ConfigError
from moekit.simoe import hard_concrete as hc
from moekit.simoe.layer import MaskInit, Routing, SILinear, SINorm
from moekit.simoe.objective import density, dual_step, orthogonality, penalty
from moekit.testing import logits, tiny_gemma3, tiny_inputs, tiny_llama

CFG = simoe.SIMoEConfig(num_experts=4, router_hidden=16)


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _, m in simoe.si_modules(model):
        m.delta.data = torch.randn(m.delta.shape, generator=g) * 0.05
        m.log_alpha.data = torch.randn(m.log_alpha.shape, generator=g) * 3
    model.simoe.router[2].weight.data = torch.randn(model.simoe.router[2].weight.shape, generator=g)
    return model


# --- hard-concrete gates (Louizos et al. 2018; SIMoE eqs. 6-8, appendix A.1/B.1) ---

def test_init_log_alpha_closed_form():
    la = hc.init_log_alpha(0.05)
    assert la == pytest.approx(math.log(19) + (2 / 3) * math.log(0.1 / 1.1), abs=1e-12)  # 1.3458...
    assert float(hc.prob_nonzero(torch.tensor(la, dtype=torch.float64))) == pytest.approx(0.95, abs=1e-12)
    with pytest.raises(ValueError):
        hc.init_log_alpha(0.0)


def test_samples_match_the_closed_form_l0_and_median():
    torch.manual_seed(0)
    for la in (-2.0, 0.0, hc.init_log_alpha(0.05)):
        la_t = torch.full((400_000,), la)
        z = hc.sample(la_t)
        assert z.min() >= 0 and z.max() <= 1
        assert (z == 0).float().mean() == pytest.approx(1 - float(hc.prob_nonzero(torch.tensor(la))), abs=3e-3)
        assert z.median() == pytest.approx(float(hc.median(torch.tensor(la))), abs=3e-3)
    assert (hc.sample(torch.full((10_000,), 3.0)) == 1).any()  # exact ones too


def test_median_gate_is_exactly_zero_below_the_threshold():
    thr = hc.BETA * math.log((-hc.GAMMA) / (hc.ZETA))  # sigmoid(thr/β) = −γ/(ζ−γ)
    assert float(hc.median(torch.tensor(thr - 1e-3))) == 0.0
    assert float(hc.median(torch.tensor(thr + 1e-2))) > 0.0
    assert float(hc.median(torch.tensor(10.0))) == 1.0


def test_samples_are_differentiable_in_log_alpha():
    la = torch.zeros(1000, requires_grad=True)
    hc.sample(la).sum().backward()
    assert la.grad.abs().sum() > 0


# --- sparse interpolated modules (eqs. 2, 9) ---

@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_simoe_model_equals_the_pretrained_model_at_init(build):
    model = build().eval()
    x = tiny_inputs(model)
    ref = logits(model, x)
    simoe.simoe_upcycle(model, CFG)
    assert torch.equal(logits(model, x), ref)
    kinds = {type(m) for _, m in simoe.si_modules(model)}
    assert kinds == {SILinear, SINorm}  # every linear of attention and MLP, and the norms
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".base." in n)


def test_masked_input_equals_the_explicit_per_instance_weight():
    torch.manual_seed(0)
    routing = Routing()
    lin = nn.Linear(6, 5)
    si = SILinear(lin, 3, MaskInit(0.05, 0.0, torch.Generator()), routing).eval()
    si.delta.data.normal_()
    si.log_alpha.data.normal_(std=3)
    routing.weights = torch.softmax(torch.randn(2, 3), -1)  # (B, M)
    x = torch.randn(2, 4, 6)
    m = routing.weights @ hc.median(si.log_alpha)  # (B, d_in)
    for b in range(2):
        w = lin.weight + si.delta * m[b]  # θ_pre + Σ_i α_i z_i ⊙ δ, masks over input columns
        torch.testing.assert_close(si(x)[b], F.linear(x[b], w, lin.bias), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [nn.LayerNorm(6), "rms"])
def test_norm_experts_equal_a_norm_with_interpolated_weight(norm):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(6) if norm == "rms" else norm
    norm.weight.data.normal_()
    routing = Routing()
    si = SINorm(norm, 3, MaskInit(0.05, 0.0, torch.Generator()), routing).eval()
    si.delta.data.normal_()
    si.log_alpha.data.normal_(std=3)
    routing.weights = torch.softmax(torch.randn(2, 3), -1)
    x = torch.randn(2, 4, 6)
    m = routing.weights @ hc.median(si.log_alpha)
    for b in range(2):
        expect = torch.func.functional_call(norm, {"weight": norm.weight + m[b] * si.delta}, (x[b],))
        torch.testing.assert_close(si(x)[b], expect, rtol=1e-5, atol=1e-6)


def test_configuration_errors():
    with pytest.raises(ConfigError, match="no SIMoE targets"):
        simoe.simoe_upcycle(tiny_llama(), simoe.SIMoEConfig(modules=["nope"], norms=False))
    model = simoe.simoe_upcycle(tiny_llama(), CFG)
    with pytest.raises(ConfigError, match="already"):
        simoe.simoe_upcycle(model, CFG)
    with pytest.raises(Exception, match="extra"):
        simoe.SIMoEConfig(experts=3)
    only_mlp = simoe.simoe_upcycle(tiny_llama(), simoe.SIMoEConfig(modules=["up_proj", "down_proj"], norms=False))
    assert {p.rsplit(".", 1)[-1] for p, _ in simoe.si_modules(only_mlp)} == {"up_proj", "down_proj"}


# --- routing (§3.1.3) ---

def test_instance_routing_reads_the_last_prompt_token_only():
    model = randomize(simoe.simoe_upcycle(tiny_llama(), CFG)).eval()
    ids = torch.randint(3, 100, (1, 10))
    labels = ids.clone()
    labels[:, :6] = -100  # prompt = first 6 tokens
    w = model.simoe.route(model, ids, None, labels)
    other = ids.clone()
    other[:, 6:] = 7  # a different target: same routing
    assert torch.equal(model.simoe.route(model, other, None, labels), w)
    assert torch.allclose(model.simoe.route(model, ids[:, :6], None, None), w, atol=1e-6)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=ids.dtype)], 1)  # right padding
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 3)], 1).long()
    lab = torch.cat([labels, torch.full((1, 3), -100)], 1)
    assert torch.allclose(model.simoe.route(model, padded, mask, lab), w, atol=1e-6)
    assert w.shape == (1, 4) and torch.allclose(w.sum(-1), torch.ones(1))


def test_token_routing_and_generation():
    model = randomize(simoe.simoe_upcycle(tiny_llama(), CFG)).eval()
    x = tiny_inputs(model)
    a = model.generate(**x, max_new_tokens=5, do_sample=False)
    b = model.generate(**x, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(a, b)  # instance routing is decided once from the prompt
    tok = randomize(simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={"routing": "token"}))).eval()
    assert tok.simoe.route(tok, x["input_ids"], None, None).shape == (*x["input_ids"].shape, 4)
    with pytest.raises(ConfigError, match="use_cache=False"):
        tok.generate(**x, max_new_tokens=3, do_sample=False)
    assert tok.generate(**x, max_new_tokens=3, do_sample=False, use_cache=False).shape[1] == x["input_ids"].shape[1] + 3


# --- objective (eqs. 3, 8, 10-13) ---

def test_density_orthogonality_and_dual_step_closed_forms():
    model = simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={"init_std": 0.0})).train()
    assert float(density(model)) == pytest.approx(0.95, abs=1e-6)  # every gate starts at P(z≠0) = 0.95
    x = tiny_inputs(model)
    model(**x)
    expect = sum(torch.linalg.matrix_norm(m.last_z @ m.last_z.T - torch.eye(4), ord=2)
                 for _, m in simoe.si_modules(model))  # the spectral norm (§3.1)
    assert float(orthogonality(model)) == pytest.approx(float(expect), rel=1e-6)
    frob = model.simoe.cfg.model_copy(update={"ortho_norm": "frobenius"})
    model.simoe.cfg = frob
    expect_f = sum(torch.linalg.matrix_norm(m.last_z @ m.last_z.T - torch.eye(4)) for _, m in simoe.si_modules(model))
    assert float(orthogonality(model)) == pytest.approx(float(expect_f), rel=1e-6) and expect_f > expect
    s = model.simoe
    loss, logs = penalty(model)
    g = CFG.tau - 0.05
    assert logs["simoe/violation"] == pytest.approx(g, abs=1e-6) and float(s.lam) == 0.0
    dual_step(s)
    assert float(s.lam) == pytest.approx(CFG.dual_lr * g, abs=1e-6)  # ascent on λ
    s.violation.fill_(-0.1)  # the constraint holds: λ resets to 0
    dual_step(s)
    assert float(s.lam) == 0.0


def test_mask_sparsity_counts_mask_entries_or_parameters():
    """eq. 3 / A.2: L0 over mask entries (default); "params" weights each gate by the δ rows it switches."""
    model = simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={"init_std": 0.0}))
    mods = simoe.si_modules(model)
    values = torch.linspace(-3.0, 3.0, len(mods))
    num = den = num_p = den_p = 0.0
    with torch.no_grad():
        for v, (_, m) in zip(values, mods):
            m.log_alpha.fill_(float(v))
            p, n = float(hc.prob_nonzero(v)), m.log_alpha.numel()
            rows = m.delta.shape[0] if isinstance(m, SILinear) else 1
            num, den, num_p, den_p = num + p * n, den + n, num_p + rows * p * n, den_p + rows * n
    assert float(density(model)) == pytest.approx(num / den, rel=1e-6)
    assert float(density(model, "params")) == pytest.approx(num_p / den_p, rel=1e-6)
    assert abs(num / den - num_p / den_p) > 1e-3  # the two forms differ here


def test_median_gates_in_training_and_the_gaussian_mask_init():
    """A.1 eqs. 6-7: training uses the deterministic median gates (sampled is the option); B.1: log φ drawn
    from a Gaussian whose mean gives P(z = 0) = 0.05."""
    model = simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={"init_std": 0.5})).train()
    la = torch.cat([m.log_alpha.detach().reshape(-1) for _, m in simoe.si_modules(model)])
    assert float(la.mean()) == pytest.approx(hc.init_log_alpha(0.05), abs=0.02) and float(la.std()) == pytest.approx(0.5, rel=0.05)
    x = tiny_inputs(model)
    model(**x)
    model(**x)
    _, m = simoe.si_modules(model)[0]
    assert torch.equal(m.last_z, hc.median(m.log_alpha))  # deterministic: the same gates every step
    sampled = simoe.simoe_upcycle(tiny_llama(), CFG.model_copy(update={"gates": "sampled"})).train()
    sampled(**x)
    _, m = simoe.si_modules(sampled)[0]
    assert not torch.equal(m.last_z, hc.median(m.log_alpha))


def test_training_meets_the_sparsity_constraint(tmp_path):
    """The Lagrangian drives the expected sparsity above τ; λ then resets to 0."""
    torch.manual_seed(0)
    cfg = CFG.model_copy(update={"tau": 0.5, "dual_lr": 1.0, "mask_lr": 0.1})  # masks at their own lr here
    model = simoe.simoe_upcycle(tiny_llama(), cfg).train()
    from moekit.simoe.objective import param_groups

    opt = torch.optim.AdamW(param_groups(model, 1e-3, 0.0))
    x = tiny_inputs(model, batch=4, length=12)
    seen_positive = False
    for _ in range(150):
        out = model(**x, labels=x["input_ids"])
        p, logs = penalty(model)
        (out.loss + p).backward()
        opt.step()
        opt.zero_grad()
        dual_step(model.simoe)
        seen_positive |= float(model.simoe.lam) > 0
    assert seen_positive and 1 - float(density(model)) >= 0.5 and float(model.simoe.lam) == 0.0


# --- save / load / prune / merge (§3.2, Table 8) ---

def test_save_load_prune_and_merge(tmp_path):
    model = randomize(simoe.simoe_upcycle(tiny_llama(), CFG)).eval()
    x = tiny_inputs(model)
    out = logits(model, x)
    simoe.save(model, tmp_path / "s")
    with pytest.raises(Exception, match="exists"):
        simoe.save(model, tmp_path / "s")
    loaded = simoe.load(tmp_path / "s")
    assert torch.equal(logits(loaded, x), out)
    before = simoe.param_counts(loaded)
    dropped = sum(int((hc.median(m.log_alpha) == 0).all(0).sum()) for _, m in simoe.si_modules(loaded)
                  if isinstance(m, SILinear))
    assert dropped > 0
    simoe.prune(loaded)
    torch.testing.assert_close(logits(loaded, x), out, rtol=0, atol=1e-6)  # pruned = unpruned in eval
    after = simoe.param_counts(loaded)
    assert after["total"] < before["total"] and after["active"] == before["active"]
    simoe.save(loaded, tmp_path / "p")
    pruned = simoe.load(tmp_path / "p")
    torch.testing.assert_close(logits(pruned, x), out, rtol=0, atol=1e-6)
    w = torch.softmax(torch.randn(4), 0)
    with simoe.fixed_routing(pruned, w):
        fixed = logits(pruned, x)
    dense = simoe.merge(pruned, w)
    assert not simoe.si_modules(dense) and not simoe.is_simoe(dense)
    torch.testing.assert_close(logits(dense, x), fixed, rtol=0, atol=1e-5)
    dense.save_pretrained(tmp_path / "d")
    from moekit.checkpoint.dense import load_dense

    torch.testing.assert_close(logits(load_dense(tmp_path / "d"), x), fixed, rtol=0, atol=1e-5)


def test_simoe_recipe_trains_resumes_and_evaluates(tiny_recipe_overrides, tmp_path, run):
    """moekit train (SIMoE, instruction data) -> checkpoint resume -> moekit evaluate reproduces the results."""
    import json
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "simoe_instruct.yaml"
    out = tmp_path / "run"
    over = tiny_recipe_overrides(out, "instruct", **{"train.steps": 4, "train.save_every": 2})
    assert run("train", recipe, *over)[0] == 0
    first = json.loads((out / "results.json").read_text())
    ckpt = out / "checkpoints" / "checkpoint-4"
    assert (ckpt / "simoe.json").is_file()
    rc, stdout, err = run("train", recipe, "--resume", *over)
    assert rc == 0 and ": 4 steps" in stdout, err  # a finished run resumed takes no further step
    rc, stdout, err = run("evaluate", out)
    assert rc == 0 and "unseen" in stdout, err
    again = json.loads((out / "results.json").read_text())
    assert again["groups"] == first["groups"]
    import csv

    rows = {r["direction"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert set(rows) == {"a", "b", "c", "seen", "unseen", "avg"}
    assert int(rows["avg"]["n"]) == sum(int(rows[t]["n"]) for t in "abc") == 6
    assert int(rows["seen"]["n"]) == 4 and float(rows["unseen"]["rougeL"]) == pytest.approx(first["directions"]["c"]["rougeL"])
    loaded = simoe.load(out / "model")
    assert simoe.is_simoe(loaded) and loaded.simoe.cfg == simoe.SIMoEConfig(**json.loads(
        (out / "model" / "simoe.json").read_text())["config"])

    # moekit simoe report / export
    rc, _, err = run("simoe", "report", out, "--out", tmp_path / "report")
    assert rc == 0, err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(report["task_routing"]) == {"a", "b", "c"} and "task_dendrogram.png" in report["figures"]
    assert all((tmp_path / "report" / f).is_file() for f in report["figures"])
    assert run("simoe", "report", out, "--out", tmp_path / "report")[0] == 2  # no silent overwrite
    x = tiny_inputs(loaded)
    ref = logits(loaded, x)
    assert run("simoe", "export", out, "--out", tmp_path / "pruned", "--prune")[0] == 0
    torch.testing.assert_close(logits(simoe.load(tmp_path / "pruned"), x), ref, rtol=0, atol=1e-6)
    rc, _, err = run("simoe", "export", out, "--out", tmp_path / "dense", "--merge", "c")
    assert rc == 0, err
    with simoe.fixed_routing(loaded, torch.tensor(report["task_routing"]["c"])):
        fixed = logits(loaded, x)
    from moekit.checkpoint.dense import load_dense

    torch.testing.assert_close(logits(load_dense(tmp_path / "dense"), x), fixed, rtol=0, atol=1e-5)
    rc, _, err = run("simoe", "export", out, "--out", tmp_path / "x", "--merge", "nope")
    assert rc == 2 and "unknown task" in err and not (tmp_path / "x").exists()

    # the same from Python (moekit.simoe_report / simoe_export): the same files, the same refusal
    import hashlib

    import moekit

    def digests(d):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}

    assert moekit.simoe_report(out, tmp_path / "report-py") == tmp_path / "report-py"
    assert json.loads((tmp_path / "report-py" / "report.json").read_text()) == report
    w = moekit.simoe_export(out, tmp_path / "pruned-py", prune=True)
    assert digests(tmp_path / "pruned-py") == digests(tmp_path / "pruned") and w.merged_task is None
    counts = simoe.param_counts(simoe.load(tmp_path / "pruned-py"))
    assert (w.total, w.active) == (counts["total"], counts["active"]) and w.total <= w.before_total
    w = moekit.simoe_export(out, tmp_path / "dense-py", merge="c")
    assert digests(tmp_path / "dense-py") == digests(tmp_path / "dense") and w.merged_task == "c"
    with pytest.raises(moekit.MoekitError, match=r"unknown task 'nope'; the run's test tasks: a, b, c"):
        moekit.simoe_export(out, tmp_path / "y", merge="nope")
    assert not (tmp_path / "y").exists()


def test_analysis_closed_forms():
    from moekit.simoe.analysis import nonzero_fractions, overlaps, task_routing

    model = simoe.simoe_upcycle(tiny_llama(), CFG).eval()
    for path, m in simoe.si_modules(model):
        m.log_alpha.data.fill_(10.0 if path.endswith("q_proj") else -10.0)  # only q_proj experts are non-zero
    fr = nonzero_fractions(model)
    assert fr["by_type"]["q_proj"] == 1.0 and fr["by_type"]["down_proj"] == 0.0
    q = sum(m.delta.numel() for p, m in simoe.si_modules(model) if p.endswith("q_proj"))
    total = sum(m.delta.numel() for _, m in simoe.si_modules(model))
    assert fr["overall"] == pytest.approx(q / total)
    assert set(fr["by_depth"]) == {0, 1, 2, 3}  # tiny_llama has 4 blocks; the final norm has no depth
    for path, m in simoe.si_modules(model):  # experts 0 = 1; expert 2 disjoint from 0; expert 3 = half of 0
        d = m.log_alpha.shape[1]
        la = torch.full_like(m.log_alpha, -10.0)
        la[0, : d // 2] = la[1, : d // 2] = la[2, d // 2:] = 10.0
        la[3, : d // 4] = 10.0
        m.log_alpha.data = la
    ov = overlaps(model)
    assert ov[0, 1] == 1.0 and ov[0, 2] == 0.0 and np.diag(ov).tolist() == [1.0] * 4
    expect = sum(m.delta.shape[0] * (m.log_alpha.shape[1] // 4) for _, m in simoe.si_modules(model)
                 if isinstance(m, SILinear)) + sum(m.log_alpha.shape[1] // 4 for _, m in simoe.si_modules(model)
                                                    if isinstance(m, SINorm))
    half = sum(m.delta.shape[0] * (m.log_alpha.shape[1] // 2) for _, m in simoe.si_modules(model)
               if isinstance(m, SILinear)) + sum(m.log_alpha.shape[1] // 2 for _, m in simoe.si_modules(model)
                                                  if isinstance(m, SINorm))
    assert ov[0, 3] == pytest.approx(expect / half)
    model.simoe.router[2].bias.data = torch.tensor([1.0, 0.0, 0.0, -1.0])  # weights 0: routing = softmax(bias)
    from moekit.testing import tiny_tokenizer

    routing = task_routing(model, tiny_tokenizer(), {"t": ["hello there", "a"], "u": ["xyz"]})
    assert routing["t"] == pytest.approx(torch.softmax(torch.tensor([1.0, 0, 0, -1]), 0).tolist(), abs=1e-6)


def test_run_parameter_counts_use_the_simoe_definition():
    from moekit.routing.sites import param_counts

    model = simoe.simoe_upcycle(tiny_llama(), CFG)
    c = simoe.param_counts(model)
    masks = sum(m.log_alpha.numel() for _, m in simoe.si_modules(model))
    assert param_counts(model) == (c["total"], c["active"]) and c["active"] == c["total"] - masks  # no gate is 0 at init
