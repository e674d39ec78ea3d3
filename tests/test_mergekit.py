"""mergekit-moe configs run unchanged (`moekit upcycle mergekit.yml OUT`): experts from distinct source models, every
other weight from base_model, router rows of gate_mode hidden / cheap_embed equal to mergekit's definition
computed here independently with plain transformers; refusals write nothing."""
import hashlib
import subprocess
import sys

import pytest
import torch
import transformers as tf
import yaml

from moekit.checkpoint.upcycle import upcycle_checkpoint
from moekit.config import validate
from moekit.checkpoint.format import load
from moekit.checkpoint.dense import load_dense
from moekit.moe.spec import MoESpec
from moekit.testing import logits, tiny_inputs, tiny_llama, tiny_tokenizer
from moekit.checkpoint.upcycle_model import upcycle

PROMPTS = [(["hello world", "good day to you"], []),
           (["def f(x): return x", "x = 1; y = 2"], ["hello"]),
           (["2 + 2 = 4", "12 x 3 is 36", "7"], ["def", "world"])]
SHARED = (["the", "and so on"], [])
NON_FFN = "mlp"
PLAIN = ("import sys, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
         "print(type(m).__name__, 'moekit' in sys.modules)")  # plain transformers, moekit never imported


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A base model and three experts fine-tuned from it (here: other seeds), each with a tokenizer whose BOS token
    is '<eos>' (so prompts get mergekit's BOS prefix and BOS padding)."""
    root = tmp_path_factory.mktemp("mergekit")
    tok = tiny_tokenizer()
    tok.bos_token = "<eos>"
    for i in range(4):
        tiny_llama(seed=i).save_pretrained(root / f"m{i}")
        tok.save_pretrained(root / f"m{i}")
    return root


def config(models, gate_mode="hidden", **extra) -> dict:
    return {"base_model": str(models / "m0"), "gate_mode": gate_mode, "dtype": "float32", "experts_per_token": 2,
            "experts": [{"source_model": str(models / f"m{i + 1}"), "positive_prompts": pos,
                         **({"negative_prompts": neg} if neg else {})} for i, (pos, neg) in enumerate(PROMPTS)],
            **extra}


def write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def mergekit_tokens(tok, prompts):
    """mergekit-moe's tokenization: BOS text + prompt, no special tokens, left padding with BOS (else EOS)."""
    tok.padding_side = "left"
    tok.pad_token_id = tok.bos_token_id
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok([(tok.bos_token or "") + p for p in prompts], return_tensors="pt", padding=True,
               add_special_tokens=False)


def unit(v):
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def mergekit_rows(base, gate_mode, prompts=PROMPTS) -> torch.Tensor:
    """(layers, experts, H) router rows by mergekit-moe's definition, with output_hidden_states (in float32)."""
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(base)
    L, emb = model.config.num_hidden_layers, model.get_input_embeddings().weight.detach()

    def hidden(prompts):  # the hidden state entering each layer at the last token, averaged over the prompts
        with torch.no_grad():
            states = model(**mergekit_tokens(tok, prompts), output_hidden_states=True).hidden_states[:-1]
        return torch.stack(states)[:, :, -1, :].mean(1)  # (L, H)

    def cheap(prompts):  # the summed token embeddings of the prompts, normalized, the same for every layer
        enc = mergekit_tokens(tok, prompts)
        h = torch.nn.functional.one_hot(enc["input_ids"], emb.shape[0]).float() @ emb  # (B, T, H)
        return unit((h * enc["attention_mask"].unsqueeze(-1)).sum((0, 1))).expand(L, -1)

    f = hidden if gate_mode == "hidden" else cheap
    return torch.stack([unit(f(pos) - f(neg) if neg else f(pos)) for pos, neg in prompts], dim=1)


def tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.is_dir() or hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("gate_mode", ["hidden", "cheap_embed"])
def test_mergekit_config_runs_unchanged_to_mixtral(models, tmp_path, run, gate_mode):
    out = tmp_path / "moe"
    rc, stdout, err = run("upcycle", write(tmp_path / "mergekit.yml", config(models, gate_mode)), out)
    assert rc == 0, err
    assert "format mixtral" in stdout and "3 experts, top-2, init sources" in stdout
    res = subprocess.run([sys.executable, "-c", PLAIN, str(out)], capture_output=True, text=True)
    assert res.stdout.split() == ["MixtralForCausalLM", "False"], res.stderr[-2000:]
    native = tf.AutoModelForCausalLM.from_pretrained(out)
    assert type(native) is tf.MixtralForCausalLM and native.config.num_local_experts == 3
    got = native.state_dict()
    base = load_dense(models / "m0").state_dict()
    for key, t in base.items():
        if f".{NON_FFN}." not in key:
            assert torch.equal(got[key], t), key  # not averaged: the base model's
    want = mergekit_rows(models / "m0", gate_mode)
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp"
        for i in range(3):
            src = load_dense(models / f"m{i + 1}").model.layers[layer].mlp
            assert torch.equal(got[f"{prefix}.experts.gate_up_proj"][i],
                               torch.cat([src.gate_proj.weight, src.up_proj.weight]))
            assert torch.equal(got[f"{prefix}.experts.down_proj"][i], src.down_proj.weight)
        torch.testing.assert_close(got[f"{prefix}.gate.weight"], want[layer], rtol=0, atol=1e-5)
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("router", [
    {"init": "hidden", "pool": "mean", "prompts": [{"positive": p, "negative": n} for p, n in PROMPTS],
     "shared_prompts": {"positive": SHARED[0]}},
    {"init": "normal"}])
def test_pooling_scaling_and_shared_gate_stream_as_in_memory(models, tmp_path, router):
    """hidden with mean pooling, residual_scale, noise_scale (on the shared expert too) and a prompted shared gate:
    the streamed moekit and Qwen2-MoE tensors are bit-identical to moekit.upcycle's (and its export's: the formats
    ask for the shared expert and the router in different orders, the draws keep one); residual_scale multiplies
    the down projection exactly."""
    from moekit.checkpoint.export import EXPORTERS

    spec = validate(MoESpec, {
        "num_experts": 3, "top_k": 2, "shared_expert": True, "shared_gate": True,
        "router": {"scoring": "topk_softmax", **router},
        "init": {"method": "sources", "branches": [str(models / f"m{i}") for i in (1, 2, 3)],
                 "shared_source": str(models / "m3"),
                 "scaling": [{"residual_scale": 0.5}, {"noise_scale": 0.01}, {}, {"noise_scale": 0.01}]}})
    upcycle_checkpoint(models / "m0", tmp_path / "moe", spec)
    upcycle_checkpoint(models / "m0", tmp_path / "q2", spec, format="qwen2_moe")
    ref = upcycle(load_dense(models / "m0"), spec, [load_dense(models / f"m{i}") for i in (1, 2, 3, 3)],
                  tokenizer=tf.AutoTokenizer.from_pretrained(models / "m0"))
    for got, want in ((load(tmp_path / "moe").state_dict(), ref.state_dict()),
                      (tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q2").state_dict(),
                       EXPORTERS.get("qwen2_moe")(ref).state_dict())):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    down = ref.model.layers[2].mlp.experts.down
    assert torch.equal(down[0], load_dense(models / "m1").model.layers[2].mlp.down_proj.weight * 0.5)
    assert 0 < (down[1] - load_dense(models / "m2").model.layers[2].mlp.down_proj.weight).abs().max() < 0.1


@pytest.mark.parametrize("gate_mode", ["hidden", "random"])
def test_qwen_gates_the_shared_expert(models, tmp_path, run, gate_mode):
    """architecture qwen: Qwen2-MoE whose shared expert is its source's FFN behind Qwen-MoE's sigmoid gate, the row of
    the shared expert's prompts (hidden, by mergekit's definition) or a drawn one (random); moekit's own format of
    the same config gives the same logits."""
    shared = [{"source_model": str(models / "m3"), "positive_prompts": SHARED[0]}]
    cfg = write(tmp_path / "qwen.yml", config(models, gate_mode, architecture="qwen", shared_experts=shared))
    for out, flags in ((tmp_path / "qwen", []), (tmp_path / "moekit", ["--format", "moekit"])):
        rc, _, err = run("upcycle", cfg, out, *flags)
        assert rc == 0, err
    native, moe = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen"), load(tmp_path / "moekit")
    assert type(native) is tf.Qwen2MoeForCausalLM
    mlp, src = native.model.layers[1].mlp, load_dense(models / "m3").model.layers[1].mlp
    assert all(torch.equal(getattr(mlp.shared_expert, n).weight, getattr(src, n).weight)
               for n in ("gate_proj", "up_proj", "down_proj"))
    gate = mlp.shared_expert_gate.weight.detach()
    if gate_mode == "hidden":
        torch.testing.assert_close(gate[0], mergekit_rows(models / "m0", "hidden", [SHARED])[1, 0], rtol=0, atol=1e-5)
    else:
        assert gate.abs().min() > 0
    assert torch.equal(moe.model.layers[1].mlp.shared_gate.weight, gate)
    x = tiny_inputs(moe)
    torch.testing.assert_close(logits(native, x), logits(moe, x), rtol=0, atol=1e-5)


def test_deepseek_shared_expert_is_ungated(models, tmp_path, run):
    """architecture deepseek: moekit's format (transformers has no DeepSeek-MoE class), the shared expert always on,
    residual_scale on its down projection; Qwen2-MoE holds the same MoE exactly; prompts on it are refused."""
    shared = [{"source_model": str(models / "m3"), "residual_scale": 0.5}]
    cfg = write(tmp_path / "ds.yml", config(models, "random", architecture="deepseek", shared_experts=shared))
    for out, flags in ((tmp_path / "ds", []), (tmp_path / "q2", ["--format", "qwen2_moe"])):
        rc, _, err = run("upcycle", cfg, out, *flags)
        assert rc == 0, err
    moe = load(tmp_path / "ds")
    mlp = moe.model.layers[1].mlp
    assert mlp.shared_gate is None
    assert torch.equal(mlp.shared.down_proj.weight, load_dense(models / "m3").model.layers[1].mlp.down_proj.weight * 0.5)
    x = tiny_inputs(moe)
    torch.testing.assert_close(logits(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q2"), x), logits(moe, x),
                               rtol=0, atol=1e-5)
    data = config(models, "random", architecture="deepseek", shared_experts=[{**shared[0], "positive_prompts": ["a"]}])
    assert "takes no prompts" in refused(run, tmp_path / "refused", data)


def refused(run, tmp_path, data, *flags) -> str:
    """The command fails with one error line and writes nothing (the output's parent is unchanged)."""
    tmp_path.mkdir(exist_ok=True)
    cfg = write(tmp_path / "mergekit.yml", data)
    before = tree(tmp_path)
    rc, _, err = run("upcycle", cfg, tmp_path / "out", *flags)
    assert rc != 0 and err.count("error:") == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert tree(tmp_path) == before
    return err


def test_all_same_experts_refused_unless_asked(models, tmp_path, run):
    data = config(models)
    for e in data["experts"]:
        e["source_model"] = str(models / "m1")
    assert "--allow-same-experts" in refused(run, tmp_path, data)
    rc, _, err = run("upcycle", tmp_path / "mergekit.yml", tmp_path / "out", "--i-understand-this-is-not-useful-without-training")
    assert rc == 0, err


@pytest.mark.parametrize("data, message", [
    ({"bogus": 1}, "unknown key 'bogus'; the valid keys are base_model, experts, gate_mode, dtype, experts_per_token, "
                   "shared_experts, architecture"),
    ({"experts": [{"source_model": "x", "positive_prompt": ["a"]}]},
     "unknown key experts[0].'positive_prompt'; the valid keys of experts[0] are source_model, positive_prompts, "
     "negative_prompts, noise_scale, residual_scale"),
    ({"gate_mode": "sparse"}, "gate_mode"),
    ({"architecture": "llama"}, "names none of mergekit's output architectures"),
    ({"experts_per_token": 4}, "top_k (4) cannot exceed num_experts (3)"),
])
def test_bad_configs_refused_in_one_line(models, tmp_path, run, data, message):
    assert message in refused(run, tmp_path, {**config(models), **data})


def test_spec_flags_do_not_apply(models, tmp_path, run):
    assert "--experts" in refused(run, tmp_path, config(models), "--experts", 4)


def test_mergekit_command_lines_run_as_written(models, tmp_path, run):
    """A command as mergekit's docs and issues write it runs; --out-shard-size counts parameters, as in mergekit
    (a 10K-parameter limit in float32 gives shards of at most 40 kB, several of them here); --random-seed is --seed."""
    import json

    from moekit.cli.mergekit_flags import MERGEKIT_FLAGS, parse_kmb
    from moekit.checkpoint.files import ShardReader

    write(tmp_path / "mergekit.yml", config(models, "random"))
    rc, _, err = run("upcycle", tmp_path / "mergekit.yml", tmp_path / "out", "--copy-tokenizer", "--allow-crimes",
                     "--lazy-unpickle", "--low-cpu-memory", "--out-shard-size", "10K", "--random-seed", 3, "-v",
                     "--no-cuda", "--clone-tensors", "--write-model-card", "--safe-serialization", "--quiet", "-j", 1)
    assert rc == 0, err
    assert err == ""  # --quiet: no progress lines
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / "out" / s).stat().st_size <= 10_000 * 4 + 8192 for s in shards)
    rc, _, err = run("upcycle", tmp_path / "mergekit.yml", tmp_path / "seeded", "--seed", 3)
    assert rc == 0, err
    with ShardReader(tmp_path / "out") as a, ShardReader(tmp_path / "seeded") as b:  # --random-seed 3 = --seed 3
        assert a.keys() and sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    assert parse_kmb("5B") == 5 * 10**9 and parse_kmb("500M") == 5 * 10**8 and parse_kmb("1000") == 1000
    assert {k for k, (kind, _, _) in MERGEKIT_FLAGS.items() if kind == "refused"} == {
        "--multi-gpu", "--load-in-4bit", "--load-in-8bit", "--lora-merge-cache", "--lora-merge-dtype",
        "--unsafe-truncate-embeddings"}


@pytest.mark.parametrize("flags, message", [
    (["--load-in-4bit"], "--load-in-4bit (mergekit-moe) has no equivalent in moekit: the hidden states"),
    (["--load-in-8bit"], "--load-in-8bit (mergekit-moe) has no equivalent"),
    (["--multi-gpu"], "--multi-gpu (mergekit-moe) has no equivalent in moekit: moekit's init math runs on one device"),
    (["--no-copy-tokenizer"], "--no-copy-tokenizer (mergekit-moe) has no equivalent"),
    (["--lora-merge-cache", "x"], "LoRA references (model+lora) are not supported"),
    (["--out-shard-size", "5X"], "'5X' is not a count such as 1000, 500M or 5B"),
    (["--out-shard-size", "0"], "'0' is not a count"),
    (["--num-threads", "0"], "--num-threads takes a whole number of at least 1, not '0'"),
    (["--random-seed", "x"], "--random-seed takes a whole number of at least 0, not 'x'"),
    (["--random-seed", "1", "--seed", "2"], "--seed 2 and --random-seed 1 disagree"),
])
def test_mergekit_flags_without_an_equivalent_are_refused(models, tmp_path, run, flags, message):
    assert message in refused(run, tmp_path, config(models, "random"), *flags)


def test_mixed_architectures_refused_unless_allow_crimes(models, tmp_path, run):
    """A Llama base with Qwen3 and Qwen2 experts of the same FFN shapes: mergekit-moe refuses mixed architectures,
    so does moekit (naming each model's type), unless --allow-crimes."""
    from moekit.testing import tiny_qwen2, tiny_qwen3

    tf.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in the refusal's stderr
    for name, build in (("qwen3", tiny_qwen3), ("qwen2", tiny_qwen2)):
        build().save_pretrained(tmp_path / name)
        tiny_tokenizer().save_pretrained(tmp_path / name)
    data = config(models, "random")
    data["experts"] = [{"source_model": str(models / "m1")}, {"source_model": str(tmp_path / "qwen3")},
                       {"source_model": str(tmp_path / "qwen2")}]
    err = refused(run, tmp_path, data)
    assert "the models mix architectures (llama, qwen2, qwen3)" in err and "unless --allow-crimes" in err
    rc, _, err = run("upcycle", tmp_path / "mergekit.yml", tmp_path / "out", "--allow-crimes")
    assert rc == 0, err


def test_readme_tables_every_mergekit_flag_and_key():
    """The mergekit-moe guide's tables name every flag of the flag table and every config key moekit reads."""
    from pathlib import Path

    from moekit.cli.mergekit_flags import MERGEKIT_FLAGS, MERGEKIT_REFUSED_NEGATIONS
    from moekit.checkpoint.mergekit import MergekitExpert, MergekitMoE

    readme = (Path(__file__).parent.parent / "docs" / "guides" / "mergekit.md").read_text()
    for flag in [*MERGEKIT_FLAGS, *MERGEKIT_REFUSED_NEGATIONS]:
        assert f"| `{flag}`" in readme, flag
    keys = [k for k in MergekitMoE.model_fields if k != "experts"]
    for key in [*keys, *(f"experts[i].{k}" for k in MergekitExpert.model_fields)]:
        assert f"`{key}`" in readme, key


def ffn_only(src, dest, drop=None):
    """`src` saved with its decoder FFN tensors only (config.json, no tokenizer): what mergekit-moe reads of an expert
    model. `drop`: one FFN tensor left out as well."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir()
    shutil.copy(src / "config.json", dest / "config.json")
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".mlp." in k and k != drop}, dest / "model.safetensors",
              metadata={"format": "pt"})
    return dest


def out_tensors(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_expert_sources_need_only_their_ffn_tensors(models, tmp_path, run):
    """mergekit-moe reads only the FFN tensors of each expert model (docs/moe.md: attention and norms from the base):
    an expert checkpoint without embeddings, attention, norms or lm_head upcycles to the same tensors as the full
    model, with or without --allow-crimes; one that lacks an FFN tensor is refused naming it, nothing written. A
    Qwen2 base (attention biases) with Llama experts (none) upcycles under --allow-crimes, every expert FFN the
    Llama model's, every other tensor the base's."""
    from moekit.testing import tiny_qwen2

    data = config(models, "random")
    rc, _, err = run("upcycle", write(tmp_path / "full.yml", data), tmp_path / "full")
    assert rc == 0, err
    data["experts"][1]["source_model"] = str(ffn_only(models / "m2", tmp_path / "m2_ffn"))
    for flags in ([], ["--allow-crimes"]):
        out = tmp_path / f"ffn{len(flags)}"
        rc, _, err = run("upcycle", write(tmp_path / "ffn.yml", data), out, *flags)
        assert rc == 0, err
        want, got = out_tensors(tmp_path / "full"), out_tensors(out)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    gone = "model.layers.1.mlp.up_proj.weight"
    data["experts"][1]["source_model"] = str(ffn_only(models / "m2", tmp_path / "m2_less", drop=gone))
    err = refused(run, tmp_path / "less", data)
    assert f"{tmp_path / 'm2_less'} has no tensor {gone}" in err
    tiny_qwen2().save_pretrained(tmp_path / "qwen2")
    tiny_tokenizer().save_pretrained(tmp_path / "qwen2")
    data = {**config(models, "random"), "base_model": str(tmp_path / "qwen2")}
    rc, _, err = run("upcycle", write(tmp_path / "crimes.yml", data), tmp_path / "crimes", "--allow-crimes")
    assert rc == 0, err
    got, base, expert = (out_tensors(tmp_path / "crimes"), out_tensors(tmp_path / "qwen2"),
                         out_tensors(models / "m1"))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.bias"], base["model.layers.0.self_attn.q_proj.bias"])
    assert torch.equal(got["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(got["model.layers.0.mlp.experts.0.gate_proj.weight"],  # Qwen2-MoE, as mergekit writes it
                       expert["model.layers.0.mlp.gate_proj.weight"])
