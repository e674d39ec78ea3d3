"""`moekit train|finetune --dry-run` (moekit.training.plan): the plan's parameter, gradient and optimizer-state bytes equal
a real run's on tiny models, byte for byte (one or two optimizer steps through the Trainer, counted from the model and
the optimizer), for every training method and freeze stage and for selective fine-tuning with K = 1 and 2 experts
per layer; the activation estimate is checked against the tensors autograd really saves; a dry run reads no weight
and writes nothing."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import TrainerCallback

from moekit.training.memory import ACTIVATION_TOLERANCE, Counts, shares, token_bytes

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TINY_MOE = ["moe.num_experts=4", "moe.top_k=2", "moe.every=2"]
QUICK = ["eval.kl_examples=0", "eval.generate=false", "train.steps=1"]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Probe(TrainerCallback):
    """What a real run holds: trainable elements and gradient bytes before each optimizer step (the largest),
    the optimizer's state bytes after it, the resident weights (parameters, and the full expert tensors a selection's
    parametrizations keep as buffers)."""

    def __init__(self):
        self.trainable = self.grads = self.state = self.params = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        from moekit.selection.finetune import ExpertRows

        params = list(model.parameters())
        self.trainable = max(self.trainable, sum(p.numel() for p in params if p.requires_grad))
        self.grads = max(self.grads, sum(nbytes(p.grad) for p in params if p.grad is not None))
        bases = [m.base for m in model.modules() if isinstance(m, ExpertRows)]
        self.params = sum(nbytes(p) for p in params) + sum(nbytes(b) for b in bases)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
        opt = getattr(optimizer, "optimizer", optimizer)
        self.state = sum(nbytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def recipe_args(name: str, tiny_recipe_overrides, out: Path, *extra: str) -> tuple[Path, list[str]]:
    task = "instruct" if name == "simoe_instruct" else "translation"
    moe = TINY_MOE if yaml.safe_load((RECIPES / f"{name}.yaml").read_text()).get("method", "moe") == "moe" else []
    return RECIPES / f"{name}.yaml", [*tiny_recipe_overrides(out, task), *moe, *QUICK, *extra]


CASES = {  # id: (recipe, overrides)
    "naive": ("naive", []),
    "spri-stage-1": ("spri_two_stage", ["freeze.tau=1.0"]),  # one step, in stage 1
    "spri-stages-1-and-2": ("spri_two_stage", ["train.steps=2", "freeze.tau=0.5"]),  # a step in each
    "ume": ("ume", []),
    "lora": ("lora", []),
    "dense": ("dense_ft", []),
    "simoe": ("simoe_instruct", []),
    "naive-bf16-params": ("naive", ["model.dtype=bfloat16"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_a_real_run(case, tiny_recipe_overrides, tmp_path):
    from moekit.training.plan import plan_recipe
    from moekit.training.recipe import load_recipe
    from moekit.training.run import train

    name, extra = CASES[case]
    path, overrides = recipe_args(name, tiny_recipe_overrides, tmp_path / "run", *extra)
    recipe = load_recipe(path, overrides)
    plan = plan_recipe(recipe, devices=2)
    probe = Probe()
    train(recipe, callbacks=[probe])
    assert plan.trainable == probe.trainable
    assert plan.param_bytes == probe.params
    assert plan.grad_bytes == probe.grads
    assert plan.optimizer_bytes == probe.state
    single = plan.shares[0]
    assert (single.params, single.grads, single.optimizer) == (probe.params, probe.grads, probe.state)
    if case.startswith("spri"):
        assert len(plan.stages) == (1 if case == "spri-stage-1" else 2)
        assert plan.stages[0].params < plan.params  # stage 1: routed down projections and routers only


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny moekit MoE checkpoint (4 experts, top-2, MoE layers 1 and 3), a tiny Qwen3-MoE one saved by
    transformers in bfloat16 (4 experts, top-2, layers 0 and 1; per-expert tensors on disk, fused on load), and a few
    lines of text."""
    import transformers as tf

    from moekit.checkpoint.format import save
    from moekit.moe.spec import MoESpec
    from moekit.testing import tiny_llama, tiny_tokenizer
    from moekit.checkpoint.upcycle_model import upcycle

    root = tmp_path_factory.mktemp("plan_moe")
    save(upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=2)), root / "moe", tokenizer=tiny_tokenizer())
    cfg = tf.Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "qwen3_moe")
    tiny_tokenizer().save_pretrained(root / "qwen3_moe")
    (root / "en.txt").write_text("the day was long\nthe light is good\nwe walk home\nthe sea is calm\n")
    return root


LAYERS = {"moe": ("model.layers.1.mlp", "model.layers.3.mlp"),
          "qwen3_moe": ("model.layers.0.mlp", "model.layers.1.mlp")}


def selection(root: Path, k: int, kind: str = "moe") -> Path:
    from moekit.selection.selection import Selection

    path = root / f"sel{k}.json"
    first, second = LAYERS[kind]
    experts = {first: list(range(k)), second: list(range(1, k + 1))}
    Selection(method="manual", budget=k, experts=experts).save(path, overwrite=True)
    return path


@pytest.mark.parametrize("kind, k", [("moe", 1), ("moe", 2), ("qwen3_moe", 2)])
def test_finetune_plan_equals_a_real_run_and_scales_with_k(kind, k, tiny_moe, tmp_path, monkeypatch):
    """moekit's own checkpoint in its dtype; a transformers one in float32, as finetune loads it."""
    import transformers

    from moekit.checkpoint.dense import load_tokenizer
    from moekit.checkpoint.format import load_model
    from moekit.training.finetune import train_selected
    from moekit.selection.selection import Selection
    from moekit.training.plan import plan_finetune

    folder = tiny_moe / kind
    sel = selection(tmp_path, k, kind)
    plan = plan_finetune(str(folder), str(sel), batch_size=2, max_length=16, devices=2)
    one = plan_finetune(str(folder), str(selection(tmp_path / "one", 1, kind)), batch_size=2, max_length=16)
    steps = 4 * 4  # AdamW's float32 step of each trainable tensor: gate_up and down rows in 2 layers
    assert plan.trainable == k * one.trainable and plan.optimizer_bytes - steps == k * (one.optimizer_bytes - steps)
    assert plan.dtype == "float32" and "checked against" in plan.shapes
    probe = Probe()

    class Probed(transformers.Trainer):  # finetune builds its own Trainer: watch that one
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(probe)

    monkeypatch.setattr(transformers, "Trainer", Probed)
    lines = (tiny_moe / "en.txt").read_text().splitlines()
    train_selected(load_model(folder), Selection.load(sel), load_tokenizer(folder), lines, steps=1, batch_size=2,
                   max_length=16, device="cpu")
    assert (plan.trainable, plan.param_bytes, plan.grad_bytes, plan.optimizer_bytes) == \
        (probe.trainable, probe.params, probe.grads, probe.state)


# ---------------------------------------------------------------------------------------------- activations


def saved_bytes(model, method, recipe, batch: int, length: int, precision: str) -> int:
    """Bytes of the tensors autograd saves in one training forward (task loss + the method's extra loss), distinct
    storages, parameters and buffers left out, plus the logits the output keeps."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(3, 120, (batch, length), generator=torch.Generator().manual_seed(0))
    trainer = SimpleNamespace(aux=getattr(recipe, "aux", None), aux_logs=defaultdict(list))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        if method is not None:
            method.extra_loss(trainer, model, torch.ones_like(ids))
    logits = out.logits.untyped_storage()
    return sum(seen.values()) + (0 if logits.data_ptr() in seen else logits.nbytes())


ACTIVATIONS = {  # id: (recipe, overrides)
    "dense": ("dense_ft", []),
    "naive": ("naive", []),
    "naive-bf16": ("naive", ["train.precision=bf16"]),
    "naive-bf16-params": ("naive", ["model.dtype=bfloat16"]),
    "spri-stage-1": ("spri_two_stage", ["freeze.tau=1.0"]),
    "ume": ("ume", []),
    "lora": ("lora", []),
}


@pytest.mark.parametrize("case", list(ACTIVATIONS))
def test_activation_estimate_is_within_tolerance_of_what_autograd_saves(case, tiny_recipe_overrides, tmp_path):
    from moekit.methods import method
    from moekit.methods.base import load_base
    from moekit.methods.freeze import apply_mask, stage_predicate
    from moekit.training.common import adapt
    from moekit.training.plan import plan_recipe
    from moekit.training.recipe import load_recipe

    name, extra = ACTIVATIONS[case]
    path, overrides = recipe_args(name, tiny_recipe_overrides, tmp_path / "run", "data.max_length=64",
                                  "train.batch_size=4", *extra)
    recipe = load_recipe(path, overrides)
    plan = plan_recipe(recipe, devices=2)
    model = adapt(recipe, load_base(recipe, Path(recipe.model.path)))
    if recipe.freeze.schedule != "none":
        apply_mask(model, stage_predicate(model, recipe.freeze, 0, recipe.train.steps))
    m = method(recipe.method)
    measured = saved_bytes(model, m if recipe.method == "moe" else None, recipe, 4, 64, recipe.train.precision)
    if recipe.method == "lora":  # the CPU keeps dropout masks as floats, CUDA (what the plan assumes) as bools
        size = 2 if recipe.train.precision == "bf16" else 4
        cpu = replace(plan.geometry, mask_size=size)
        plan.activations = token_bytes(cpu, size, 4, recipe.train.gradient_checkpointing) * 4 * 64
    estimate = plan.activations + plan.shares[0].buffers  # buffers: autocast's weight copies, saved as well
    assert abs(estimate - measured) <= ACTIVATION_TOLERANCE * measured, (estimate, measured)


def test_finetune_activation_estimate_is_within_tolerance(tiny_moe, tmp_path):
    from moekit.checkpoint.format import load_model
    from moekit.selection.finetune import attach
    from moekit.selection.selection import Selection
    from moekit.training.plan import plan_finetune

    sel = selection(tmp_path, 1)
    plan = plan_finetune(str(tiny_moe / "moe"), str(sel), batch_size=4, max_length=32)
    model = load_model(tiny_moe / "moe").train()
    handle = attach(model, Selection.load(sel))
    measured = saved_bytes(model, None, None, 4, 32, "fp32")
    handle.merge()
    estimate = plan.activations + plan.shares[0].buffers  # buffers: the full expert tensors rebuilt from the rows
    assert abs(estimate - measured) <= ACTIVATION_TOLERANCE * measured, (estimate, measured)


# ---------------------------------------------------------------------------------------------- engines


def test_engine_rows_follow_their_conventions():
    """Hand-computed rows: 1,000 parameters in float32 (400 routed), 600 trainable (200 routed) in 6 tensors
    (2 routed), over 4 devices with bf16 mixed precision, 100 elements in the largest layer, 300 in Linear weights."""
    c = Counts(params=1000, param_bytes=4000, replicated=0, replicated_bytes=0, trainable=600, trainable_bytes=2400,
               state=600, state_bytes=2400, state_tensors=6, routed=400, routed_bytes=1600, routed_trainable=200,
               routed_trainable_bytes=800, routed_state=200, routed_state_bytes=800, routed_state_tensors=2,
               layer_params=100, linear_params=300)
    rows = {r.engine: r for r in shares(c, 10_000, 4, 4, mixed=True, param_size=4)}
    adam = 2 * 2400 + 4 * 6
    single = rows["single device"]
    assert (single.params, single.grads, single.optimizer, single.buffers, single.activations) == \
        (4000, 2400, adam, 600, 10_000)  # buffers: bf16 copies of the Linear weights
    assert rows["DDP × 4"].buffers == 600 + 2400  # + the gradient buckets
    z2 = rows["ZeRO-2 × 4"]
    assert (z2.params, z2.grads, z2.optimizer, z2.buffers) == (2000, 300, 1800, 0)  # bf16 params, 12 B/param / 4
    z3 = rows["ZeRO-3 × 4"]
    assert (z3.params, z3.grads, z3.optimizer, z3.buffers) == (500, 300, 1800, 400)  # 2 layers gathered in bf16
    f2 = rows["FSDP2 × 4"]
    assert (f2.params, f2.grads, f2.optimizer, f2.buffers) == (1000, 600, adam // 4, 400)
    ep = rows["EP 4 + DDP"]
    routed_adam = 2 * 800 + 4 * 2
    assert (ep.params, ep.grads, ep.optimizer) == (2400 + 400, 1600 + 200, adam - routed_adam + routed_adam // 4)
    epf = rows["EP 4 + FSDP2 × 4"]
    assert (epf.params, epf.grads) == (2400 // 4 + 400, 1600 // 4 + 200)
    assert all(r.total == r.params + r.grads + r.optimizer + r.buffers + r.activations for r in rows.values())
    # a selection's full expert tensors (buffers, 40 B) and their copies rebuilt each step (77 B): kept whole by
    # every engine but expert parallelism, which splits them with the experts
    sel = replace(c, params=1010, param_bytes=4040, replicated=10, replicated_bytes=40, materialized_bytes=77)
    for r, plain in zip(shares(sel, 10_000, 4, 4, False, 4), shares(c, 10_000, 4, 4, False, 4)):
        split = r.engine.startswith("EP")
        assert r.buffers - plain.buffers == (20 if split else 77), r.engine  # ceil(77 / 4)
        assert r.params - plain.params == (10 if split else 40), r.engine


PER_PARAMETER = {  # (stored bytes, mixed): bytes per trainable parameter (weights + gradients + optimizer state)
    (4, True): {"DDP": 16, "ZeRO-2": 16, "ZeRO-3": 16, "FSDP2": 16},  # fp32 weights, bf16 autocast
    (4, False): {"DDP": 16, "ZeRO-2": 20, "ZeRO-3": 16, "FSDP2": 16},  # fp32 training: ZeRO-2's master is a copy
    (2, True): {"DDP": 8, "ZeRO-2": 10, "ZeRO-3": 8, "FSDP2": 8},  # bf16 weights and states everywhere
}


@pytest.mark.parametrize("stored,mixed", list(PER_PARAMETER))
def test_every_engine_of_a_table_keeps_one_precision(stored, mixed):
    """Closed-form bytes per parameter: one device, 1,000 trainable elements in one tensor; DDP and FSDP2 add torch
    AdamW's float32 step (4 B per tensor). ZeRO keeps weights, gradients in the compute dtype (2 B under bf16) and a
    master copy (ZeRO-3: none where the partition is in the master dtype) and AdamW's two states in the master
    dtype."""
    from moekit.training.memory import recast

    n = 1000
    fp32 = Counts(params=n, param_bytes=4 * n, replicated=0, replicated_bytes=0, trainable=n, trainable_bytes=4 * n,
                  state=n, state_bytes=4 * n, state_tensors=1)
    c = fp32 if stored == 4 else recast(fp32, 2, 4)
    rows = {r.engine.split(" ×")[0]: r for r in shares(c, 0, 1, None, mixed, stored)}
    for engine, per in PER_PARAMETER[stored, mixed].items():
        r = rows[engine]
        step = 4 if engine in ("DDP", "FSDP2") else 0
        assert r.params + r.grads + r.optimizer == per * n + step, engine


def test_the_plan_shows_both_precisions(tiny_recipe_overrides, tmp_path):
    """A recipe with float32 parameters under bf16: its table at 16 B per trainable parameter on every engine, the
    other at bfloat16 (DDP 8 B, ZeRO-2 10 B), from the same counts."""
    from moekit.training.plan import plan_recipe
    from moekit.training.recipe import load_recipe

    path, overrides = recipe_args("naive", tiny_recipe_overrides, tmp_path / "run", "train.precision=bf16")
    plan = plan_recipe(load_recipe(path, overrides), devices=1, expert_parallel=None)
    assert (plan.dtype, plan.other_dtype) == ("float32", "bfloat16")
    n = plan.trainable

    def per(rows, engine):
        r = next(r for r in rows if r.engine.startswith(engine))
        return r.params + r.grads + r.optimizer

    assert n == plan.params and plan.param_bytes == 4 * n
    steps = plan.optimizer_bytes - 8 * n  # torch AdamW's float32 step per tensor
    assert [per(plan.shares, e) for e in ("DDP", "ZeRO-2", "ZeRO-3")] == [16 * n + steps, 16 * n, 16 * n]
    assert [per(plan.other_shares, e) for e in ("DDP", "ZeRO-2", "ZeRO-3")] == [8 * n + steps, 10 * n, 8 * n]


def test_expert_parallel_must_divide_the_experts_and_the_devices():
    from moekit.errors import ConfigError
    from moekit.training.plan import check_devices

    assert check_devices(8, None, [8, 8]) == (8, "")
    assert check_devices(6, None, [8])[0] is None  # no EP row by default, with the reason
    assert check_devices(8, 4, [8]) == (4, "")
    for devices, ep, experts, match in ((8, 3, [8], "device count it divides"), (4, 8, [8], "device count it divides"),
                                        (8, 8, [6], "expert count; .* 6 experts"), (8, 2, [], "needs MoE layers")):
        with pytest.raises(ConfigError, match=match):
            check_devices(devices, ep, experts)


# ---------------------------------------------------------------------------------------------- the command


def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def no_weights(monkeypatch):
    """Any read of tensor data fails the test: moekit's shard reader, safetensors and from_pretrained."""
    import safetensors
    import safetensors.torch
    import transformers

    from moekit.checkpoint.files import ShardReader

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run read tensor data")

    monkeypatch.setattr(ShardReader, "get", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


def test_train_dry_run_prints_the_plan_reads_no_weight_and_writes_nothing(run, tiny_recipe_overrides, tmp_path,
                                                                          no_weights, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    path, overrides = recipe_args("spri_two_stage", tiny_recipe_overrides, out)
    watched = [tmp_path, tiny_recipe_overrides.dense.parent]
    before = [tree_hash(w) for w in watched]
    rc, stdout, err = run("train", path, *overrides, "--dry-run", "--devices", 4, "--device-memory", "80GB")
    assert rc == 0, err
    assert [tree_hash(w) for w in watched] == before and not out.exists()
    for row in ("single device", "DDP × 4", "ZeRO-2 × 4", "ZeRO-3 × 4", "FSDP2 × 4", "EP 4 + DDP",
                "spri_two_stage, steps 1-1", "activations per 1k tokens (estimate)", "fits 74.51 GiB"):
        assert row in stdout, row


def test_finetune_dry_run_reads_no_weight_and_writes_nothing(run, tiny_moe, tmp_path, no_weights):
    sel = selection(tmp_path, 2)
    before = tree_hash(tmp_path), tree_hash(tiny_moe)
    rc, stdout, err = run("finetune", "--model", tiny_moe / "moe", "--experts", sel, "--data",
                          f"en={tiny_moe / 'en.txt'}", "--out", tmp_path / "ft", "--dry-run", "--devices", 2)
    assert rc == 0, err
    assert (tree_hash(tmp_path), tree_hash(tiny_moe)) == before and not (tmp_path / "ft").exists()
    assert "EP 2 + DDP" in stdout and "the K selected rows" in stdout


def test_finetune_dry_run_needs_no_out_or_data_and_a_run_needs_both(run, tiny_moe, tmp_path, no_weights):
    """The plan reads neither the training text nor an output folder, so --dry-run goes without them; a run without
    them is refused in one line, before anything is read or written."""
    sel = selection(tmp_path, 2)
    before = tree_hash(tmp_path), tree_hash(tiny_moe)
    rc, stdout, err = run("finetune", "--model", tiny_moe / "moe", "--experts", sel, "--dry-run", "--devices", 2)
    assert rc == 0, err
    assert "EP 2 + DDP" in stdout
    for missing in (["--data", f"en={tiny_moe / 'en.txt'}"], ["--out", tmp_path / "ft"]):
        rc, stdout, err = run("finetune", "--model", tiny_moe / "moe", "--experts", sel, *missing)
        assert rc == 2 and "finetune needs --out and --data (only --dry-run goes without them)" in err, err
    assert (tree_hash(tmp_path), tree_hash(tiny_moe)) == before


def test_dry_run_of_a_hub_id_fetches_its_config_only(run, tiny_recipe_overrides, tmp_path, monkeypatch):
    """A Hub id that is not in the cache: config.json alone is fetched (no weights); the plan says its shapes were
    not checked against weights."""
    from huggingface_hub import constants

    from moekit.testing.fake_hub import fake_hub

    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    path, overrides = recipe_args("naive", tiny_recipe_overrides, tmp_path / "run", "model.path=org/tiny")
    with fake_hub({"org/tiny": tiny_recipe_overrides.dense}) as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)  # both read from HF_ENDPOINT at import
        template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        rc, stdout, err = run("train", path, *overrides, "--dry-run")
    assert rc == 0, err
    files = {p.name for p in cache.rglob("*") if p.is_file() and "snapshots" in p.parts}
    assert files == {"config.json"}
    assert "config.json alone" in stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["moe", "qwen3_moe"])
def test_finetune_dry_run_checks_the_selections_model(kind, run, tiny_moe, tmp_path):
    """finetune --dry-run refuses a selection made for another model before printing a plan, as finetune does: a
    selection recorded on this model (routes collect, select) plans; the same with another config digest is one error
    line and nothing written; --allow-other-model plans it (issue 37 §4)."""
    import json

    folder, data = tiny_moe / kind, f"en={tiny_moe / 'en.txt'}"
    rc, _, err = run("routes", "collect", "--model", folder, "--texts", data, "--out", tmp_path / "t.npz")
    assert rc == 0, err
    rc, _, err = run("select", "usage", tmp_path / "t.npz", "--top", 2, "--out", tmp_path / "s.json")
    assert rc == 0, err
    other = json.loads((tmp_path / "s.json").read_text())
    digest = other["source"]["config_sha256"]
    other["source"]["config_sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))

    def dry_run(sel, *extra):
        return run("finetune", "--model", folder, "--experts", sel, "--data", data, "--out", tmp_path / "ft",
                   "--dry-run", *extra)

    rc, stdout, err = dry_run(tmp_path / "s.json")
    assert rc == 0 and "the K selected rows" in stdout and "warning" not in err, err
    before = tree_hash(tmp_path)
    rc, stdout, err = dry_run(tmp_path / "other.json")
    assert rc == 2 and stdout == "" and err.splitlines() == [
        f"moekit: error: the selection was made for another model (trace {tmp_path / 't.npz'}): its config (sha256 "
        f"000000000000) is not this model's ({digest[:12]}); pass --allow-other-model to use it anyway"]
    assert tree_hash(tmp_path) == before and not (tmp_path / "ft").exists()
    rc, stdout, err = dry_run(tmp_path / "other.json", "--allow-other-model")
    assert rc == 0 and "the K selected rows" in stdout, err


@pytest.mark.parametrize("family,intermediate,experts", [
    ("mixtral", 48, 4), ("qwen3_moe", 24, 4), ("dbrx", 48, 4), ("gpt_oss", 48, 4), ("jetmoe", 48, 4),
    ("longcat_flash", 24, 6)])  # 6: LongCat's 4 routed and 2 zero-computation experts
def test_finetune_plan_sees_every_layout_of_experts_under_selection(family, intermediate, experts, tmp_path):
    """The plan's geometry (what its activation estimate reads) of a transformers family with the selection attached
    (its expert tensors parametrized to the selected rows): each MoE layer gated, with the family's expert
    intermediate size, its expert count and top-k, only the selected layer's experts trained (both projections), no
    router; the same for fused (E, ...) experts, GPT-OSS's (E, H, 2I), DBRX's (E·I, H) rows, JetMoE's two modules
    and LongCat-Flash's decoder stack of num_layers entries. Before, a selected layer read as a dense FFN with its
    router and shared expert trained (its tensors no longer (E, ...)), and the others' sizes 0 for some layouts."""
    import json

    from moekit.routing.sites import find_sites
    from moekit.testing.families import tiny_family_model
    from moekit.training.api import finetune_plan

    model = tiny_family_model(family)
    sites = find_sites(model)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "sel.json").write_text(json.dumps({"method": "m", "budget": 1, "experts": {sites[0].name: [1]}}))
    ffns = [layer.ffn for layer in finetune_plan(tmp_path / "model", tmp_path / "sel.json").geometry.layers]
    assert len(ffns) == len(sites)
    for i, ffn in enumerate(ffns):
        assert (ffn.intermediate, ffn.gated, ffn.experts, ffn.top_k) == (intermediate, True, experts, 2), (i, ffn)
        assert (ffn.trained, ffn.down_trained, ffn.router_trained, ffn.shared_trained) == (i == 0, i == 0, False, False)
