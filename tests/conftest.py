"""Shared pytest setup."""
import json
import os
import random
import signal
import subprocess

import pytest
import torch

# moekit's Triton kernels (moe/triton_experts.py) run on CPU tensors under Triton's interpreter, which Triton reads
# when a kernel is decorated, i.e. when moekit is first imported: set before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker would otherwise start one OpenMP thread per core: with n workers on
# n cores the threads oversubscribe the CPU and OpenMP's spin-waiting makes tiny ops ~100x slower.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(scope="session")
def tiny_recipe_overrides(tmp_path_factory):
    """`overrides(out, task="translation", **extra)`: dotted key=value overrides that point any recipe at a
    tiny Llama (with the character tokenizer) and small JSONL data (directions fr and sw, or for
    task="instruct" tasks a and b trained and c unseen), for 2 steps of batch 2.
    `extra` adds or replaces keys, e.g. `**{"train.steps": 4}`."""
    from moekit.testing import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny_recipe")
    tiny_llama().save_pretrained(root / "dense")
    tiny_tokenizer().save_pretrained(root / "dense")
    rng = random.Random(0)
    words = "the light of the world is good and the day was long".split()
    for split, n in (("train", 16), ("test", 4)):
        lines = []
        for i in range(n):
            src = " ".join(rng.choice(words) for _ in range(4))
            lines.append(json.dumps({"src": src, "tgt": src[::-1], "tgt_lang": "sw" if i % 2 else "fr"}))
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        tasks = [json.dumps({"task": t, "instruction": f"do {t}", "input": " ".join(rng.choice(words) for _ in range(3)),
                             "output": rng.choice(words)}) for i in range(n) for t in ("a", "b", "c")]
        (root / f"instruct_{split}.jsonl").write_text("\n".join(tasks) + "\n")

    def overrides(out, task: str = "translation", **extra) -> list[str]:
        if task == "speech_llm":  # a tiny Qwen3-ASR and a tiny CoVoST 2 layout (moekit.testing.speech_llm)
            return _speech_llm_overrides(root, out, extra)
        if task == "instruct":  # tasks a, b trained, c unseen
            data = {"data.train_tasks": ["a", "b"], "data.unseen_tasks": ["c"], "data.test_per_task": 2,
                    "data.train_files": [str(root / "instruct_train.jsonl")],
                    "data.test_files": [str(root / "instruct_test.jsonl")]}
        else:
            data = {"data.directions": ["fr", "sw"],  # the JSONL's tgt_lang values
                    "data.train_files": [str(root / "train.jsonl")], "data.test_files": [str(root / "test.jsonl")],
                    "data.test_per_direction": 2}
        keys = {
            "out": str(out), "model.path": str(root / "dense"), "data.source": "jsonl", **data,
            "data.max_length": 160,
            "train.steps": 2, "train.batch_size": 2, "train.grad_accum": 1, "train.logging_steps": 1,
            "train.eval_every": 0, "train.save_every": 0,
            "eval.kl_examples": 2, "eval.max_new_tokens": 4, "eval.batch_size": 2, **extra,
        }
        return [f"{k}={json.dumps(v)}" for k, v in keys.items()]  # JSON values are YAML values

    overrides.dense = root / "dense"  # the tiny model's folder
    return overrides


def _speech_llm_overrides(root, out, extra: dict) -> list[str]:
    from moekit.testing.speech_llm import save_tiny_covost, save_tiny_qwen3_asr

    if not (root / "qwen3_asr").exists():
        save_tiny_qwen3_asr(root / "qwen3_asr")
        save_tiny_covost(root / "covost")
    keys = {"out": str(out), "model.path": str(root / "qwen3_asr"), "data.path": str(root / "covost"),
            "data.directions": ["de", "fr"], "train.steps": 2, "train.batch_size": 2, "train.grad_accum": 1,
            "train.precision": "fp32", "train.logging_steps": 1, "train.eval_every": 0, "train.save_every": 0,
            "eval.max_new_tokens": 4, "eval.batch_size": 2, "eval.loss_per_direction": 2, **extra}
    return [f"{k}={json.dumps(v)}" for k, v in keys.items()]


@pytest.fixture
def run(capsys):
    """Call the CLI in-process: run(*args) -> (exit code, stdout, stderr)."""
    from moekit.cli.main import main

    def call(*args):
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return call


@pytest.fixture(scope="session")
def tiny_speech(tmp_path_factory):
    """A tiny English + French speech corpus (espeak-ng, flite test voices for English) and a tiny random
    Whisper directory with Whisper's special tokens: {"corpus": dir, "whisper": dir}."""
    from moekit.speech.corpus import CorpusConfig, build_corpus
    from moekit.testing import save_tiny_whisper_asr

    root = tmp_path_factory.mktemp("tiny_speech")
    texts = {"en": ["The sun is warm.", "I like green tea.", "We walk to school.", "Birds sing at dawn.",
                    "Open the door.", "She reads a book."],
             "fr": ["Le chat dort.", "Il fait beau.", "Nous mangeons du pain.", "La mer est calme.",
                    "Ouvre la fenêtre.", "Elle chante bien."]}
    for lang, lines in texts.items():
        (root / f"{lang}.txt").write_text("\n".join(lines) + "\n")
    cfg = CorpusConfig(langs=["en", "fr"], voices=1, test_voices=1, train_per_lang=4, test_per_lang=2,
                       texts={lang: str(root / f"{lang}.txt") for lang in texts}, flite_test=True, seed=0)
    build_corpus(cfg, root / "corpus")
    return {"corpus": root / "corpus", "whisper": save_tiny_whisper_asr(root / "whisper")}


def run_checked(cmd, timeout=180, cwd=None, env=None) -> str:
    """The stdout of a command that must succeed (its output is shown when it does not); it runs in its own process
    group, killed whole when it hangs. OMP_NUM_THREADS=1; `env`: more variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return stdout


@pytest.fixture
def run_command():
    """run_command(cmd, timeout=180, cwd=None) -> run_checked(...)."""
    return run_checked
