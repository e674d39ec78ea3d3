import subprocess
from moekit.moe.state import spec_of
import sys

import pytest
import torch
import transformers as tf
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from moekit.init import EXPERT_INITS
from moekit.checkpoint.format import load
from moekit.routing.sites import param_counts
from moekit.moe.layer import moe_layers
from moekit.moe.spec import MoESpec
from moekit.testing import logits, tiny_inputs, tiny_llama
from moekit.checkpoint.upcycle_model import upcycle


def save_tokenizer(folder):
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "c", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    tiny_llama().save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def write_recipe(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_upcycle_with_flags(dense, tmp_path, run):
    out = tmp_path / "moe"
    rc, stdout, err = run("upcycle", "--model", dense, "--method", "spri", "--experts", 4, "--top-k", 2,
                          "--every", 2, "--shared-expert", "--seed", 3, "--set", "init.rho=0.01", "--out", out)
    assert rc == 0, err
    model = load(out)
    assert spec_of(model) == MoESpec(num_experts=4, top_k=2, every=2, shared_expert=True, seed=3,
                                        init={"method": "spri", "rho": 0.01})
    assert [p for p, _ in moe_layers(model)] == ["model.layers.1.mlp", "model.layers.3.mlp"]
    assert (out / "tokenizer.json").is_file()
    assert "2 FFNs" in stdout and f"{param_counts(model)[0]:,}" in stdout


def test_upcycle_with_recipe_matches_library(dense, tmp_path, run):
    spec = {"num_experts": 4, "top_k": 1, "layers": [0, 2], "init": {"method": "noise", "std": 0.02},
            "router": {"scoring": "softmax_topk"}}
    recipe = write_recipe(tmp_path / "r.yaml", {"model": str(dense), "out": str(tmp_path / "unused"), "spec": spec})
    out = tmp_path / "moe"
    rc, _, err = run("upcycle", recipe, "--out", out, "spec.seed=5")
    assert rc == 0, err
    assert not (tmp_path / "unused").exists()
    got = load(out)
    expected_spec = MoESpec.model_validate({**spec, "seed": 5})
    assert spec_of(got) == expected_spec
    ref = upcycle(tiny_llama(), expected_spec)
    inputs = tiny_inputs(ref)
    torch.testing.assert_close(logits(got, inputs), logits(ref, inputs), rtol=0, atol=0)


def test_flags_override_recipe(dense, tmp_path, run):
    recipe = write_recipe(tmp_path / "r.yaml", {"model": str(dense), "out": str(tmp_path / "moe"),
                                                "spec": {"every": 2, "init": "naive"}})
    rc, _, err = run("upcycle", recipe, "--layers", "0", "--method", "drop", "--set", "init.ratio=0.25")
    assert rc == 0, err
    spec = spec_of(load(tmp_path / "moe"))
    assert spec.layers == [0] and spec.every is None and spec.init.method == "drop" and spec.init.ratio == 0.25


def test_btx_branches_from_recipe(tmp_path, run):
    branches = [tmp_path / f"branch{i}" for i in range(2)]
    for i, b in enumerate(branches):
        tiny_llama(seed=i).save_pretrained(b)
    init = {"method": "btx", "branches": [str(b) for b in branches], "include_seed": False}
    recipe = write_recipe(tmp_path / "r.yaml", {"model": str(branches[0]), "out": str(tmp_path / "moe"),
                                                "spec": {"num_experts": 2, "top_k": 1, "init": init}})
    rc, _, err = run("upcycle", recipe)
    assert rc == 0, err
    ref = upcycle(tiny_llama(seed=0), MoESpec(num_experts=2, top_k=1, init=init), [tiny_llama(seed=i) for i in range(2)])
    inputs = tiny_inputs(ref)
    torch.testing.assert_close(logits(load(tmp_path / "moe"), inputs), logits(ref, inputs), rtol=0, atol=0)


def test_upcycle_builtin_asset_from_cache(tmp_path, run, monkeypatch):
    monkeypatch.setenv("MOEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a cached asset must not be fetched"))
    tiny_llama().save_pretrained(tmp_path / "cache" / "models" / "smollm2-135m")
    rc, _, err = run("upcycle", "--model", "smollm2-135m", "--experts", 2, "--top-k", 1, "--out", tmp_path / "moe")
    assert rc == 0, err
    assert len(moe_layers(load(tmp_path / "moe"))) == 4


def test_inspect(dense, tmp_path, run):
    out = tmp_path / "moe"
    assert run("upcycle", "--model", dense, "--method", "ume", "--experts", 4, "--top-k", 2, "--out", out)[0] == 0
    rc, stdout, err = run("inspect", out)
    assert rc == 0, err
    total, active = param_counts(load(out))
    assert "4 MoE layers" in stdout and "model.layers.3.mlp" in stdout
    assert f"{total:,}" in stdout and f"{active:,}" in stdout and "ume" in stdout and "LlamaForCausalLM" in stdout


def test_list(run):
    rc, stdout, _ = run("list", "methods")
    assert rc == 0 and all(name in stdout for name in EXPERT_INITS.names())
    rc, stdout, _ = run("list", "formats")
    assert rc == 0 and "mixtral" in stdout and "qwen3_moe" in stdout


def test_export_mixtral(dense, tmp_path, run):
    moe, out = tmp_path / "moe", tmp_path / "mixtral"
    assert run("upcycle", "--model", dense, "--method", "noise", "--experts", 4, "--top-k", 2, "--out", moe)[0] == 0
    rc, stdout, err = run("export", moe, "--format", "mixtral", "--out", out)
    assert rc == 0, err
    native = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(native).__name__ == "MixtralForCausalLM" and (out / "tokenizer.json").is_file()
    inputs = tiny_inputs(native)
    torch.testing.assert_close(logits(native, inputs), logits(load(moe), inputs), rtol=1e-5, atol=1e-5)


def test_upcycle_granular_to_mixtral(dense, tmp_path, run):
    out = tmp_path / "mixtral"
    rc, stdout, err = run("upcycle", "--model", dense, "--method", "scaled_copy", "--experts", 4, "--top-k", 2,
                          "--granularity", 2, "--format", "mixtral", "--out", out)
    assert rc == 0, err
    assert "8 experts (4 copies x 2 shards), top-4, init scaled_copy" in stdout
    native = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (native.config.num_local_experts, native.config.num_experts_per_tok, native.config.intermediate_size) == \
        (8, 4, 32)
    inputs = tiny_inputs(native)
    torch.testing.assert_close(logits(native, inputs), logits(tiny_llama(), inputs), rtol=1e-5, atol=1e-5)


def refused(run, out, *args):
    """The command fails with one message and creates no output (not even a temporary directory)."""
    rc, stdout, err = run(*args)
    assert rc != 0
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return err


@pytest.mark.parametrize("flags, message", [
    (["--method", "nope"], "invalid choice: 'nope'"),
    (["--experts", 2, "--top-k", 3], "top_k (3) cannot exceed num_experts (2)"),
    (["--method", "spri", "--experts", 5, "--top-k", 2, "--shared-expert"], "divisible by top_k"),
    (["--method", "spri", "--experts", 4, "--top-k", 2], "shared expert"),
    (["--method", "ume", "--shared-expert"], "shared_expert=false"),
    (["--set", "init.bogus=1"], "bogus"),
    (["--layers", "0,x"], "comma-separated block indices"),
    (["--granularity", 2], "works with init scaled_copy only, not naive"),
    (["--method", "scaled_copy", "--granularity", 3], "granularity 3 must divide the FFN's intermediate size"),
])
def test_bad_spec_flags(dense, tmp_path, run, flags, message):
    out = tmp_path / "moe"
    assert message in refused(run, out, "upcycle", "--model", dense, "--out", out, *flags)


@pytest.mark.parametrize("recipe", [
    {"spec": {"num_experts": 4, "bogus": 1}},
    {"spec": {}, "extra": 1},
    {"spec": {"init": {"method": "spri", "rhoo": 1}}},
])
def test_unknown_recipe_key(dense, tmp_path, run, recipe):
    out = tmp_path / "moe"
    path = write_recipe(tmp_path / "r.yaml", {"model": str(dense), "out": str(out), **recipe})
    assert "Extra inputs are not permitted" in refused(run, out, "upcycle", path)


def test_missing_inputs(dense, tmp_path, run):
    out = tmp_path / "moe"
    assert "neither an existing model directory" in refused(run, out, "upcycle", "--model", tmp_path / "no", "--out", out)
    assert "config file not found" in refused(run, out, "upcycle", tmp_path / "no.yaml")
    assert "--model and --out" in refused(run, out, "upcycle", "--model", dense)
    assert "--set" in refused(run, out, "upcycle", "--model", dense, "--out", out, "spec.top_k=1")


def test_existing_output_is_left_alone(dense, tmp_path, run):
    out = tmp_path / "moe"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run("upcycle", "--model", dense, "--out", out)
    assert rc == 2 and "--overwrite" in err and err.count("error:") == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert run("upcycle", "--model", dense, "--out", out, "--overwrite")[0] == 0
    assert not (out / "keep.txt").exists() and (out / "moekit.json").is_file()


def test_unsupported_architecture(tmp_path, run):
    src = tmp_path / "mamba"
    cfg = tf.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4, expand=2)
    tf.MambaForCausalLM(cfg).save_pretrained(src)
    out = tmp_path / "moe"
    assert "no supported FFN found in MambaForCausalLM" in refused(run, out, "upcycle", "--model", src, "--out", out)


def test_pickle_checkpoint_needs_allow_pickle(tmp_path, run):
    src = tmp_path / "pickled"
    model = tiny_llama()
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    out = tmp_path / "moe"
    err = refused(run, out, "upcycle", "--model", src, "--out", out)
    assert "pytorch_model.bin" in err and "--allow-pickle" in err
    assert run("upcycle", "--model", src, "--out", out, "--allow-pickle")[0] == 0
    ref = upcycle(tiny_llama(), MoESpec())
    inputs = tiny_inputs(ref)
    torch.testing.assert_close(logits(load(out), inputs), logits(ref, inputs), rtol=0, atol=0)


def test_export_refusals(dense, tmp_path, run):
    moe, out = tmp_path / "moe", tmp_path / "native"
    assert run("upcycle", "--model", dense, "--experts", 4, "--top-k", 2, "--out", moe)[0] == 0
    assert "invalid choice: 'gguf'" in refused(run, out, "export", moe, "--format", "gguf", "--out", out)
    assert "not a moekit checkpoint" in refused(run, out, "export", dense, "--format", "mixtral", "--out", out)


def test_python_dash_m_maps_errors_to_exit_code_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "moekit", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.strip() == f"moekit: error: {tmp_path} is not a moekit checkpoint (no moekit.json)"


def test_demo_on_a_tiny_model(tmp_path, run, tiny_recipe_overrides):
    over = [o for o in tiny_recipe_overrides(tmp_path / "unused") if not o.startswith("out=")]
    rc, out, err = run("demo", "--out", tmp_path / "demo", *over, "moe.num_experts=4", "moe.every=2")
    assert rc == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    diversity = {k: [float(x) for x in v.split("│")[6].split("→")] for k, v in rows.items()
                 if k in ("naive", "spri_two_stage")}  # init → trained
    assert diversity["naive"][0] == 0.0 and diversity["naive"][1] < 0.01  # copies
    assert diversity["spri_two_stage"][0] == pytest.approx(1 - 1 / 3, abs=1e-3)  # E=4, k=2: 1 − 2·1/6 pairs
    assert diversity["spri_two_stage"][1] > 0.5
    for system in ("naive", "spri_two_stage"):
        assert spec_of(load(tmp_path / "demo" / system / "model")).init.method == system.split("_")[0]
        assert (tmp_path / "demo" / system / "results.csv").is_file()
    rc, _, err = run("demo", "--out", tmp_path / "demo")  # existing output refused without --overwrite
    assert rc == 2 and "--overwrite" in err
