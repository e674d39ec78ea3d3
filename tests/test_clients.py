"""Every native export read by the other common readers, not only transformers 5 (issue 27): transformers 4.57.6 and
llama.cpp's own convert_hf_to_gguf.py (llama-cpp-python 0.3.36's tree), each run in its own environment
(tests/clients_env.py, created by `make clients` or here on first use) through tests/clients_check.py.

* transformers 4.57 loads every classic export with no missing, unexpected or mismatched weight, its logits equal
  transformers 5's, and its tokenizer files load; the fused layout is what it misreads (the reader gap says so).
* llama.cpp's converter turns every classic export (and the fused Qwen ones) into an f32 GGUF whose tensors equal the
  HF tensors under llama.cpp's names; where it refuses, moekit's reader gaps said so beforehand.

The environment failing to build fails these tests; MOEKIT_SKIP_CLIENTS=1 skips them explicitly.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import transformers as tf

import clients_env
from moekit import MoESpec
from moekit.checkpoint.convert import export
from moekit.checkpoint.export import EXPORTERS
from moekit.checkpoint.export.base import LLAMA_CPP, TF4
from moekit.testing import logits, randomized_moe, tiny_llama, tiny_qwen2, tiny_qwen3, tiny_tokenizer

HERE = os.path.dirname(__file__)
IDS = [[5, 9, 17, 33, 60, 2, 70, 11, 40, 41, 3, 27]]
TEXT = "the day was long."


@pytest.fixture(scope="module")
def clients():
    if os.environ.get("MOEKIT_SKIP_CLIENTS") == "1":
        pytest.skip("MOEKIT_SKIP_CLIENTS=1: the transformers 4.x / llama.cpp client tests were skipped on request")
    return clients_env.ensure()  # fails loudly (pip's output) when the environment cannot be built


SOFTMAX_TOPK = {"router": {"scoring": "softmax_topk"}}
CASES = {  # name: (source, spec, format, layout, llama.cpp converts it)
    "mixtral": (tiny_llama, {}, "mixtral", "classic", True),
    "mixtral-fused": (tiny_llama, {}, "mixtral", "fused", False),
    "qwen2-tied-shared": (lambda: tiny_llama(tie_word_embeddings=True),  # SmolLM2's form, SPRI's ungated shared expert
                          {"init": "spri", "shared_expert": True, **SOFTMAX_TOPK}, "qwen2_moe", "classic", True),
    "qwen2-tied-shared-fused": (lambda: tiny_llama(tie_word_embeddings=True),
                                {"init": "spri", "shared_expert": True, **SOFTMAX_TOPK}, "qwen2_moe", "fused", True),
    "qwen2-no-shared": (tiny_qwen2, SOFTMAX_TOPK, "qwen2_moe", "classic", True),
    "qwen2-dense-layers": (tiny_llama, {"every": 2, "init": "spri", "shared_expert": True}, "qwen2_moe", "classic",
                           False),
    "qwen3": (tiny_qwen3, {}, "qwen3_moe", "classic", True),
    "qwen3-fused": (tiny_qwen3, {}, "qwen3_moe", "fused", True),
}


def run_check(clients, *args) -> dict[str, dict]:
    res = subprocess.run([str(clients_env.python()), os.path.join(HERE, "clients_check.py"), *map(str, args)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return {os.path.basename(x["dir"]): x for x in lines}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, clients):
    """Each case exported with its tokenizer; {name: (dir, moekit model, reader gaps)} and what the readers made."""
    root = tmp_path_factory.mktemp("clients")
    out = {}
    for name, (build, spec, fmt, layout, _) in CASES.items():
        model = randomized_moe(build, **spec)
        export(model, root / name, fmt, tokenizer=tiny_tokenizer(), layout=layout)
        exporter = EXPORTERS.get(fmt)
        out[name] = (root / name, model, exporter.reader_gaps(model, exporter.plan(model, layout)))
    jobs = [{"dir": str(d), "ids": IDS, "out": str(d) + ".tf4.pt", "text": TEXT} for d, _, _ in out.values()]
    (root / "tf4.json").write_text(json.dumps(jobs))
    (root / "gguf.json").write_text(json.dumps([{"dir": str(d), "out": str(d) + ".gguf"} for d, _, _ in out.values()]))
    return out, run_check(clients, "tf4", root / "tf4.json"), \
        run_check(clients, "gguf", clients_env.llama_cpp(), root / "gguf.json")


@pytest.mark.parametrize("name", CASES)
def test_transformers_4(exports, name):
    (folder, model, gaps), got = exports[0][name], exports[1][name]
    assert got["version"] == "4.57.6" and "error" not in got, got.get("error")
    assert got["class"] == EXPORTERS.get(CASES[name][2]).native.__name__
    v5 = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.tensor(IDS)
    want = logits(v5, {"input_ids": x})
    assert (want - logits(model, {"input_ids": x})).abs().max() <= 1e-5  # transformers 5 = moekit
    if CASES[name][3] == "fused":  # 4.x misreads it (experts initialized anew): the gap says so
        assert got["missing_keys"] and gaps[TF4]
        return
    assert got["missing_keys"] == got["unexpected_keys"] == got["mismatched_keys"] == [] and not gaps[TF4]
    assert (torch.load(str(folder) + ".tf4.pt") - want).abs().max() <= 1e-5
    assert got["tokenizer"] == "PreTrainedTokenizerFast"  # what transformers 5 wrote as "TokenizersBackend"
    assert got["text_ids"] == tf.AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"]


@pytest.mark.parametrize("name", CASES)
def test_llama_cpp_converter(exports, name):
    (folder, _, gaps), got = exports[0][name], exports[2][name]
    if not CASES[name][4]:  # refused by the converter, as moekit's reader gaps predicted
        assert "Can not map tensor" in got.get("error", ""), got
        assert gaps[LLAMA_CPP]
        return
    assert "error" not in got, got.get("trace")
    assert got["arch"] == {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[CASES[name][2]]
    assert got["missing"] == got["extra"] == got["different"] == [], got
    if CASES[name][3] == "classic":
        assert not gaps[LLAMA_CPP], gaps  # llama.cpp computes it as transformers does (bench/clients.py runs it)
    if name.startswith("qwen2-tied"):  # tied, yet lm_head.weight is written: llama.cpp's Qwen2-MoE needs output.weight
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as f:
            assert "lm_head.weight" in f.keys() and torch.equal(f.get_tensor("lm_head.weight"),
                                                                 f.get_tensor("model.embed_tokens.weight"))


def test_streamed_upcycle_keeps_a_tokenizer_transformers_4_reads(tmp_path, clients):
    """A source whose tokenizer transformers 5 saved ("TokenizersBackend"): the upcycled export's tokenizer_config.json
    names PreTrainedTokenizerFast, and transformers 4.57 loads the export whole."""
    from moekit.checkpoint.upcycle import upcycle_checkpoint

    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    assert json.loads((tmp_path / "dense" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "TokenizersBackend"
    upcycle_checkpoint(tmp_path / "dense", tmp_path / "q2", MoESpec(num_experts=4, top_k=2, init="spri",
                                                                    shared_expert=True, **SOFTMAX_TOPK),
                       format="qwen2_moe")
    assert json.loads((tmp_path / "q2" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    (tmp_path / "job.json").write_text(json.dumps([{"dir": str(tmp_path / "q2"), "ids": IDS,
                                                     "out": str(tmp_path / "q2.pt"), "text": TEXT}]))
    got = run_check(clients, "tf4", tmp_path / "job.json")["q2"]
    assert "error" not in got and got["missing_keys"] == got["unexpected_keys"] == [], got
    v5 = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "q2", dtype=torch.float32)
    assert (torch.load(tmp_path / "q2.pt") - logits(v5, {"input_ids": torch.tensor(IDS)})).abs().max() <= 1e-5
