"""Streaming upcycle and export (moekit.checkpoint): the same tensors, bit for bit, as the in-memory path, for
every init method and format; native outputs load in plain transformers with the moekit model's logits;
memory does not grow with the number of layers."""
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as tf

from moekit.checkpoint.files import read_headers
from moekit.checkpoint.upcycle import export_checkpoint, upcycle_checkpoint
from moekit.config import validate
from moekit.checkpoint.export import EXPORTERS
from moekit.checkpoint.format import load, save
from moekit.checkpoint.dense import load_dense
from moekit.moe.spec import MoESpec
from moekit.moe.state import spec_of
from moekit.testing import TINY_MODELS, logits, tiny_inputs, tiny_llama, tiny_qwen2, tiny_qwen3
from moekit.checkpoint.upcycle_model import upcycle

METHODS = {
    "naive": {}, "noise": {"init": {"method": "noise", "ratio": 0.5, "std": 0.1}}, "drop": {"init": "drop"},
    "ume": {"init": "ume"}, "scaled_copy": {"init": "scaled_copy"}, "scratch": {"init": "scratch"},
    "spri": {"init": "spri", "shared_expert": True},
    "spri_gate": {"init": {"method": "spri", "placement": "gate"}, "shared_expert": True},
    "spri_dense_routed": {"init": {"method": "spri", "dense_as": "routed"}, "num_experts": 5},
    "noise_down": {"init": {"method": "noise", "std": 0.1, "placement": "down"}},
    "drop_down": {"init": {"method": "drop", "placement": "down"}},
}


def make_spec(**kw) -> MoESpec:
    return validate(MoESpec, {"num_experts": 4, "top_k": 2, **kw})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tiny dense checkpoints: llama in float32 and bfloat16, qwen2, qwen3 (with tokenizer files)."""
    from moekit.testing import tiny_tokenizer

    root = tmp_path_factory.mktemp("src")
    out = {}
    for name, build, dtype in (("llama", tiny_llama, torch.float32), ("llama_bf16", tiny_llama, torch.bfloat16),
                               ("qwen2", tiny_qwen2, torch.float32), ("qwen3", tiny_qwen3, torch.float32)):
        build().to(dtype).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
        out[name] = root / name
    return out


def in_memory(src, spec, dtype):
    """The reference: load in float32, upcycle in memory, cast to the output dtype."""
    return upcycle(load_dense(src), spec).to(dtype)


def assert_same_state(got: dict, want: dict):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("source", ["llama", "llama_bf16"])
def test_moekit_format_equals_in_memory(sources, tmp_path, method, source):
    spec = make_spec(**METHODS[method], every=2)
    w = upcycle_checkpoint(sources[source], tmp_path / "moe", spec)
    dtype = torch.bfloat16 if source.endswith("bf16") else torch.float32
    assert w.dtype == str(dtype).removeprefix("torch.") and w.format == "moekit" and w.layers == 2
    got = load(tmp_path / "moe")
    assert spec_of(got) == spec
    assert_same_state(got.state_dict(), in_memory(sources[source], spec, dtype).state_dict())
    assert (tmp_path / "moe" / "tokenizer.json").is_file() and (tmp_path / "moe" / "README.md").is_file()


@pytest.mark.parametrize("family", ["gpt2", "bert", "whisper", "gemma3"])
def test_other_families_stream_exactly(tmp_path, family):
    """Conv1D (transposed), BERT's split FFN, Whisper's fc1/fc2 on the block (two stacks), GeGLU."""
    TINY_MODELS[family]().save_pretrained(tmp_path / "dense")
    spec = make_spec(init="drop", shared_expert=True)
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", spec)
    assert_same_state(load(tmp_path / "moe").state_dict(), in_memory(tmp_path / "dense", spec, torch.float32).state_dict())


def test_router_sharing_and_btx(sources, tmp_path):
    spec = make_spec(init="noise", router_sharing="all")
    upcycle_checkpoint(sources["llama"], tmp_path / "omni", spec)
    got = load(tmp_path / "omni")
    assert len({id(m.router) for _, m in __import__("moekit").moe_layers(got)}) == 1
    assert_same_state(got.state_dict(), in_memory(sources["llama"], spec, torch.float32).state_dict())
    branches = []
    for i in range(2):
        branches.append(tmp_path / f"b{i}")
        tiny_llama(seed=i + 1).save_pretrained(branches[-1])
    spec = make_spec(num_experts=3, top_k=1, layers=[1, 3], init={"method": "btx", "branches": list(map(str, branches))})
    upcycle_checkpoint(sources["llama"], tmp_path / "btx", spec)
    ref = upcycle(load_dense(sources["llama"]), spec, [load_dense(b) for b in branches])
    assert_same_state(load(tmp_path / "btx").state_dict(), ref.state_dict())


FORMAT_CASES = {  # source, spec, native format
    "mixtral": ("llama", {"init": "drop"}, "mixtral"),
    "mixtral_bf16": ("llama_bf16", {"init": "noise"}, "mixtral"),
    "qwen3_every2": ("qwen3", {"init": "drop", "every": 2, "router": {"scoring": "softmax_topk"}}, "qwen3_moe"),
    "qwen2_shared": ("qwen2", {"init": "spri", "shared_expert": True}, "qwen2_moe"),
    "llama_qwen2_spri_every2_shared": ("llama", {"init": "spri", "shared_expert": True, "every": 2}, "qwen2_moe"),
    "llama_qwen2_no_shared": ("llama", {"init": "drop", "every": 2}, "qwen2_moe"),
}


@pytest.mark.parametrize("case", FORMAT_CASES)
def test_native_formats_equal_the_in_memory_export(sources, tmp_path, case):
    source, spec_kw, fmt = FORMAT_CASES[case]
    spec = make_spec(**spec_kw)
    w = upcycle_checkpoint(sources[source], tmp_path / "native", spec, format=fmt)
    assert w.format == fmt
    dtype = torch.bfloat16 if source.endswith("bf16") else torch.float32
    moe = in_memory(sources[source], spec, dtype)
    want = EXPORTERS.get(fmt)(moe).state_dict()
    native = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=dtype)
    assert type(native) is EXPORTERS.get(fmt).native
    assert_same_state(native.state_dict(), want)
    x = tiny_inputs(moe)
    assert (logits(native.float(), x) - logits(moe.float(), x)).abs().max() <= 1e-5
    sidecar = json.loads((tmp_path / "native" / "moekit_spec.json").read_text())
    assert validate(MoESpec, sidecar["spec"]) == spec and sidecar["format"] == fmt


@pytest.mark.parametrize("spec_kw, source, expected, why", [
    ({"init": "drop"}, "llama", "mixtral", "represents this MoE exactly"),
    ({"init": "spri", "shared_expert": True, "every": 2}, "llama", "qwen2_moe", "represents this MoE exactly"),
    ({"init": "drop", "every": 2}, "qwen3", "qwen3_moe", "represents this MoE exactly"),
    ({"init": "noise", "router_sharing": "all"}, "llama", "moekit", "routers are shared"),
    ({"init": "drop", "router": {"jitter": 0.1}, "every": 2}, "llama", "moekit", "jitter"),
])
def test_auto_format_picks_an_exact_native_format_or_says_why_not(sources, tmp_path, spec_kw, source, expected, why):
    w = upcycle_checkpoint(sources[source], tmp_path / "out", make_spec(**spec_kw), format="auto")
    assert w.format == expected and why in w.why
    assert (tmp_path / "out" / ("moekit.json" if expected == "moekit" else "moekit_spec.json")).is_file()


def test_streaming_export_equals_in_memory_export(sources, tmp_path):
    spec = make_spec(init="spri", shared_expert=True, every=2)
    upcycle_checkpoint(sources["llama_bf16"], tmp_path / "moe", spec)
    w = export_checkpoint(tmp_path / "moe", tmp_path / "q2", "qwen2_moe")
    assert w.dtype == "bfloat16"
    want = EXPORTERS.get("qwen2_moe")(load(tmp_path / "moe")).state_dict()
    assert_same_state(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q2", dtype=torch.bfloat16).state_dict(), want)


@pytest.mark.parametrize("fmt", ["mixtral", "qwen2_moe"])
def test_streaming_export_of_tied_embeddings(tmp_path, fmt):
    """A tied head (SmolLM2's) is stored once in the moekit checkpoint and exported as the model ties it."""
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "dense")
    spec = make_spec(init="spri", shared_expert=True, every=2) if fmt == "qwen2_moe" else make_spec(init="drop")
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", spec)
    export_checkpoint(tmp_path / "moe", tmp_path / fmt, fmt)
    native = tf.AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32)
    assert native.config.tie_word_embeddings and native.lm_head.weight is native.model.embed_tokens.weight
    assert native.config.architectures == [type(native).__name__]  # as save_pretrained writes it
    assert_same_state(native.state_dict(), EXPORTERS.get(fmt)(load(tmp_path / "moe")).state_dict())


def test_dtype_and_shards(sources, tmp_path):
    spec = make_spec(init="drop")
    w = upcycle_checkpoint(sources["llama"], tmp_path / "moe", spec, dtype="bfloat16", max_shard_size=50_000)
    headers = read_headers(tmp_path / "moe")
    files = {h.file.name for h in headers.values()}
    assert len(files) > 2 and (tmp_path / "moe" / "model.safetensors.index.json").is_file()
    assert {h.dtype for h in headers.values()} == {"BF16"} and w.bytes == sum(h.nbytes for h in headers.values())
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_same_state(load(tmp_path / "moe").state_dict(), in_memory(sources["llama"], spec, torch.bfloat16).state_dict())


def test_in_memory_save_is_read_by_streaming_export(sources, tmp_path):
    """moekit.save (in memory) and export_checkpoint (streaming) share the format."""
    moe = upcycle(load_dense(sources["qwen3"]), make_spec(init="drop"))
    save(moe, tmp_path / "moe")
    export_checkpoint(tmp_path / "moe", tmp_path / "q3", "qwen3_moe")
    native = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q3", dtype=torch.float32)
    x = tiny_inputs(moe)
    assert (logits(native, x) - logits(moe, x)).abs().max() <= 1e-5


RSS = textwrap.dedent('''
    import sys
    from moekit._fs import peak_memory
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.config import validate
    from moekit.moe.spec import MoESpec
    src, out = sys.argv[1], sys.argv[2]
    upcycle_checkpoint(src, out, validate(MoESpec, {"num_experts": 8, "top_k": 2, "init": "drop"}))
    print(peak_memory())
''')


def test_peak_memory_does_not_grow_with_the_number_of_layers(tmp_path):
    """4 vs 16 layers of one width: held whole, 16 layers of 8 bf16 experts would add ~190 MB; streamed, the
    peak stays within 10 %."""
    peaks = {}
    for n in (4, 16):
        cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=n, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256)
        tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / f"d{n}")
        res = subprocess.run([sys.executable, "-c", RSS, str(tmp_path / f"d{n}"), str(tmp_path / f"m{n}")],
                             capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1",
                                                                             "PATH": "/usr/bin:/bin"})
        peaks[n] = int(res.stdout.split()[-1])
    total = sum(h.nbytes for h in read_headers(tmp_path / "m16").values())
    assert total > 150e6  # what holding the MoE would cost
    assert peaks[16] <= 1.10 * peaks[4], peaks


NO_MOEKIT = "import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])"


def test_moekit_format_is_never_misread(sources, tmp_path):
    """Without moekit, transformers refuses a moekit directory; after `import moekit` the Auto classes give the
    MoE model; save_pretrained of an upcycled model writes the moekit format (or refuses)."""
    spec = make_spec(init="drop", every=2, shared_expert=True)
    upcycle_checkpoint(sources["llama"], tmp_path / "moe", spec)
    res = subprocess.run([sys.executable, "-c", NO_MOEKIT, str(tmp_path / "moe")], capture_output=True, text=True)
    assert res.returncode != 0 and "has model type `moekit` but Transformers does not recognize" in res.stderr, \
        res.stderr[-2000:]  # unrecognized model type (README quotes this message), not a dense Llama
    code = "import sys, moekit, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); " \
           "print(type(m).__name__, len(moekit.moe_layers(m)))"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "moe")], capture_output=True, text=True)
    assert res.stdout.split() == ["LlamaForCausalLM", "2"], res.stderr[-2000:]
    auto = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.bfloat16)  # moekit is imported here
    assert auto.dtype == torch.bfloat16 and spec_of(auto) == spec
    moe = upcycle(load_dense(sources["llama"]), spec)
    moe.save_pretrained(tmp_path / "via_save_pretrained")
    assert (tmp_path / "via_save_pretrained" / "moekit.json").is_file()
    x = tiny_inputs(moe)
    assert torch.equal(logits(load(tmp_path / "via_save_pretrained"), x), logits(moe, x))
    with pytest.raises(__import__("moekit").MoekitError, match="exists"):
        moe.save_pretrained(tmp_path / "via_save_pretrained")  # never over an existing directory


def test_format_1_checkpoints_still_load(sources, tmp_path):
    """moekit/1 kept the base config.json unwrapped."""
    spec = make_spec(init="noise")
    upcycle_checkpoint(sources["llama"], tmp_path / "moe", spec)
    ref = load(tmp_path / "moe")
    meta = json.loads((tmp_path / "moe" / "moekit.json").read_text())
    (tmp_path / "moe" / "moekit.json").write_text(json.dumps({**meta, "format": "moekit/1"}))
    load_dense(sources["llama"]).config.save_pretrained(tmp_path / "moe")  # plain config.json, as before
    x = tiny_inputs(ref)
    assert torch.equal(logits(load(tmp_path / "moe"), x), logits(ref, x))


def front_matter(folder) -> dict:
    import yaml

    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def hub_valid(folder) -> dict:
    """The card's metadata as huggingface_hub reads it (ModelCard raises on metadata it cannot take), checked for
    what the Hub's validation asks offline: base_model repository ids, a library name, a pipeline tag."""
    from huggingface_hub import ModelCard
    from huggingface_hub.utils import validate_repo_id

    data = ModelCard.load(folder / "README.md", ignore_metadata_errors=False).data.to_dict()
    base = data.get("base_model")
    for repo in [base] if isinstance(base, str) else base or []:
        validate_repo_id(repo)  # raises on a local path ("/", "..", "--", ...)
    assert data["library_name"] in ("transformers", "moekit") and data["pipeline_tag"] == "text-generation"
    return data


def test_model_cards(sources, tmp_path, tiny_recipe_overrides, run):
    """Hub-ready cards: base_model the Hub id (never a local path; omitted without one), every source of a merge,
    library_name transformers on native exports, a pipeline tag, tags [moe, upcycling, METHOD], the diversity
    explained."""
    spec = make_spec(init="spri", shared_expert=True, seed=7)
    upcycle_checkpoint(sources["llama"], tmp_path / "moe", spec, base_model="org/llama-tiny")
    header = hub_valid(tmp_path / "moe")
    assert header == {"library_name": "moekit", "pipeline_tag": "text-generation",
                      "tags": ["moe", "upcycling", "spri"], "base_model": "org/llama-tiny"}
    body = (tmp_path / "moe" / "README.md").read_text()
    assert "Shan et al. 2026" in body and "**seed**: 7" in body and "**dtype**: float32" in body
    assert '"rho": 0.001' in body and "active per token" in body and "moekit version" in body
    assert "above 1 when pairs point partly opposite" in body  # what the diversity figure means
    export_checkpoint(tmp_path / "moe", tmp_path / "q2", "qwen2_moe")
    assert hub_valid(tmp_path / "q2") == {**header, "library_name": "transformers"}  # base_model kept from the source
    upcycle_checkpoint(sources["llama"], tmp_path / "local", spec)  # a local directory: no base_model at all
    assert "base_model" not in hub_valid(tmp_path / "local") and str(sources["llama"]) not in \
        (tmp_path / "local" / "README.md").read_text().split("---")[1]
    merged = make_spec(init={"method": "sources", "branches": [str(sources["llama"])] * 4, "allow_same": True})
    upcycle_checkpoint(sources["llama"], tmp_path / "merge", merged, format="mixtral",
                       base_model=["org/base", "org/a", None, "org/b", "org/a"])
    assert hub_valid(tmp_path / "merge")["base_model"] == ["org/base", "org/a", "org/b"]
    rc, _, err = run("train", "recipes/dense_ft.yaml", *tiny_recipe_overrides(tmp_path / "run"))
    assert rc == 0, err
    run_card = front_matter(tmp_path / "run")  # a dense fine-tune of a local model: a transformers model, no base
    assert run_card["library_name"] == "transformers" and "base_model" not in run_card


@pytest.mark.parametrize("fmt", ["moekit", "mixtral"])
def test_init_diversity_recorded_from_the_stored_experts(sources, tmp_path, fmt):
    """SPRI A.1's diversity at initialization: recorded per layer by the streaming path (from the tensors as
    written, accumulated over row chunks) equal to the in-memory upcycle's, in moekit.json or moekit_spec.json
    and the model card; SPRI E=4, k=2 gives 1 − same-group pairs / all pairs = 1 − 2/6."""
    from moekit.checkpoint.files import ShardReader
    from moekit.checkpoint.stream import routed_down
    from moekit.moe.diversity import expert_diversity, init_diversity
    from moekit.moe.layer import moe_layers

    spec = make_spec(init={"method": "spri"} if fmt == "moekit" else "drop", shared_expert=fmt == "moekit")
    upcycle_checkpoint(sources["llama"], tmp_path / "moe", spec, format=fmt)
    ref = in_memory(sources["llama"], spec, torch.float32)
    want = {p: expert_diversity(m.experts.down) for p, m in moe_layers(ref)}
    assert {p: m.init_diversity for p, m in moe_layers(ref)} == want  # moekit.upcycle records the same
    if fmt == "moekit":
        got = {e["path"]: e["init_diversity"] for e in json.loads((tmp_path / "moe" / "moekit.json").read_text())["layers"]}
        assert init_diversity(load(tmp_path / "moe")) == pytest.approx(1 - 2 / 6, abs=1e-3)
    else:
        got = json.loads((tmp_path / "moe" / "moekit_spec.json").read_text())["init_diversity"]
        with ShardReader(tmp_path / "moe") as r:  # and equal to the diversity of the stored tensors
            for p in want:  # Mixtral's classic layout: model.layers.N.block_sparse_moe.experts.E.w2.weight
                name, separate = routed_down(r.headers, p.replace(".mlp", ".block_sparse_moe."))
                down = torch.stack([r.get(name.format(e)) for e in range(4)]) if separate else r.get(name)
                assert separate and got[p] == pytest.approx(expert_diversity(down), abs=1e-12)
    assert got.keys() == want.keys() and all(got[p] == pytest.approx(want[p], abs=1e-9) for p in want)
    assert "expert diversity at init" in (tmp_path / "moe" / "README.md").read_text()


def test_diversity_is_exact_for_any_chunk():
    """The Gram matrix over row chunks (one row at a time, a few rows, everything) gives the same diversity."""
    from moekit.moe.diversity import expert_diversity

    down = torch.randn(5, 7, 11, dtype=torch.float64)
    v = torch.nn.functional.normalize(down.reshape(5, -1), dim=-1)
    want = float(1 - (v @ v.T)[~torch.eye(5, dtype=torch.bool)].mean())
    assert all(expert_diversity(down, chunk) == pytest.approx(want, abs=1e-12) for chunk in (1, 1000, 1 << 30))


def test_a_stored_tensor_transformers_splits_into_several_is_read_as_their_rows(tmp_path):
    """`ShardReader.rename(parts=...)` serves one stored tensor as the tensors transformers' Chunk(dim=0) makes of it
    (HRM-Text's gqkv_proj), each its own rows of the stored bytes: equal to torch.chunk, uneven last part included."""
    from safetensors.torch import save_file

    from moekit.checkpoint.files import ShardReader
    from moekit.errors import CheckpointError

    fused = torch.randn(11, 3)
    save_file({"a.fused": fused, "b": torch.ones(2)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reader = ShardReader(tmp_path)
    names = ["a.x", "a.y", "a.z"]
    reader.rename({}, {}, {"a.fused": names})
    assert sorted(reader.keys()) == ["a.x", "a.y", "a.z", "b"]
    for name, want in zip(names, torch.chunk(fused, 3)):  # 4, 4 and 3 rows
        assert torch.equal(reader.get(name), want) and torch.equal(reader.get_rows(name, 1, 3), want[1:3])
    reader.close()
    with ShardReader(tmp_path) as clash, pytest.raises(CheckpointError, match="holds both b and a.fused, which load as b"):
        clash.rename({}, {}, {"a.fused": ["a.x", "b"]})


def test_a_checkpoint_under_the_names_transformers_renames_streams_and_a_clash_is_refused(tmp_path):
    """GPT-NeoX stores its head as embed_out (transformers 5 loads it as lm_head): the streaming upcycle reads it
    under the model's name, for every method's copy; a checkpoint holding both names is refused in one line."""
    from safetensors.torch import load_file, save_file

    from moekit.errors import CheckpointError
    from moekit.testing.families import tiny_family_model

    dense = tiny_family_model("gpt_neox")
    dense.save_pretrained(tmp_path / "dense")
    stored = load_file(tmp_path / "dense" / "model.safetensors")
    assert "embed_out.weight" in stored and "lm_head.weight" not in stored
    spec = make_spec(init="drop")
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", spec)
    assert_same_state(load(tmp_path / "moe").state_dict(), in_memory(tmp_path / "dense", spec, torch.float32).state_dict())

    save_file({**stored, "lm_head.weight": stored["embed_out.weight"].clone()}, tmp_path / "dense" / "model.safetensors",
              metadata={"format": "pt"})
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointError, match="holds both embed_out.weight and lm_head.weight") as e:
        upcycle_checkpoint(tmp_path / "dense", tmp_path / "clash", spec)
    assert "\n" not in str(e.value) and not (tmp_path / "clash").exists()
    del e
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds  # the refused run's shard files are closed
