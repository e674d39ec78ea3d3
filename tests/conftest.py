"""Shared pytest setup."""
import json
import os
import random
import re
import signal
import subprocess
import warnings

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


def pytest_runtest_logreport(report):
    """With MOEKIT_TEST_FAILURES=FILE (bench/gpu.sh), each failure is appended to FILE as it happens, so a run that
    is cut short (a device call's time limit) still says why the tests that failed so far failed."""
    path = os.environ.get("MOEKIT_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")


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
        capsys.readouterr()  # what the test printed before the call is not the command's
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return call


@pytest.fixture(scope="session")
def tiny_speech(tmp_path_factory):
    """A tiny English + French speech corpus (espeak-ng, flite test voices for English), a tiny random Whisper
    directory with Whisper's special tokens, and tiny random wav2vec 2.0 and Parakeet CTC checkpoints whose
    vocabularies cover the corpus: {"corpus": dir, "whisper": dir, "wav2vec2": dir, "parakeet": dir,
    "texts": {lang: lines}}."""
    from moekit.speech.corpus import CorpusConfig, build_corpus
    from moekit.testing import save_tiny_parakeet_ctc, save_tiny_wav2vec2_ctc, save_tiny_whisper_asr

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
    every = [t for lines in texts.values() for t in lines]
    return {"corpus": root / "corpus", "whisper": save_tiny_whisper_asr(root / "whisper"),
            "wav2vec2": save_tiny_wav2vec2_ctc(root / "wav2vec2", every),
            "parakeet": save_tiny_parakeet_ctc(root / "parakeet", every), "texts": texts}


# a process ended by one of these signals crashed in native code (torchrun reports a rank's as "Signal 11 (SIGSEGV)")
CRASHES = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")


def crashed(returncode: int, stderr: str) -> str | None:
    """The signal that ended the command, or one of torchrun's ranks, where it is a native crash; else None."""
    if returncode < 0 and signal.Signals(-returncode).name in CRASHES:
        return signal.Signals(-returncode).name
    found = re.search(rf"Signal \d+ \(({'|'.join(CRASHES)})\) received", stderr)
    return found.group(1) if found else None


def run_checked(cmd, timeout=180, cwd=None, env=None, rerun=None) -> str:
    """The stdout of a command that must succeed (its output is shown when it does not); it runs in its own process
    group, killed whole when it hangs. OMP_NUM_THREADS=1, PYTHONFAULTHANDLER=1 (a crash in native code prints each
    thread's Python stack, shown with the output); `env`: more variables.

    `rerun`: a command run once in its place, with a warning that shows the crash, where the first one ended by a
    native crash (`crashed`). CI saw one rank of a 2-process gloo launch end by SIGSEGV after its last training step
    (stop 55; tests/test_parallel.py, simoe-fsdp2), which 27 runs here (8 alone, 19 with up to 4 at once on 2 cores)
    did not reproduce; the rerun must then pass every check the test makes, and a second crash fails it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1",
           **(env or {})}
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    dump = stderr.find("Fatal Python error")  # faulthandler's report: the signal, each thread's stack, then modules
    dumps = stderr[dump:].split("\nExtension modules:")[0][:6000] if dump >= 0 else ""
    if proc.returncode != 0 and rerun is not None and crashed(proc.returncode, stderr):
        warnings.warn(f"{crashed(proc.returncode, stderr)} in {cmd[:6]}, run once more: {dumps or stderr[-3000:]}")
        return run_checked(rerun, timeout, cwd, env)
    assert proc.returncode == 0, stdout[-3000:] + dumps + stderr[-6000:]
    return stdout


@pytest.fixture
def run_command():
    """run_command(cmd, timeout=180, cwd=None) -> run_checked(...)."""
    return run_checked
