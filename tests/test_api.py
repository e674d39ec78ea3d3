"""The Python API (issue 40.1): every command a typed public function that the command line calls.

Each verb called from Python gives what its command gives (the same files, byte for byte, or the same results), and
refuses bad input with a MoekitError whose message is the command's error line; the names are complete, typed
(mypy strict) and consistently ordered (the source before the output).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect as pyinspect
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import moekit
from moekit.errors import MoekitError

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------ the names

def test_every_public_name_is_importable_and_listed_by_dir():
    assert set(moekit.__all__) == {"MoekitError", "__version__", *moekit._API, *moekit._MODULES}
    assert len(moekit.__all__) == len(set(moekit.__all__))
    for name in moekit.__all__:
        assert getattr(moekit, name) is not None, name
    assert set(moekit.__all__) <= set(dir(moekit))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moekit.nope  # noqa: B018


def test_dir_lists_every_public_name_before_any_is_used():
    """In a fresh interpreter (nothing loaded yet), as completion in a notebook sees it."""
    code = "import moekit; print(sorted(set(moekit.__all__) - set(dir(moekit))))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_version_is_the_installed_distributions():
    assert moekit.__version__ == importlib.metadata.version("moekit")


def test_version_of_a_source_tree_without_metadata(monkeypatch):
    from moekit import _version

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _version.version() == project["version"]


def test_py_typed_ships_with_the_package():
    assert (ROOT / "src" / "moekit" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["moekit"]


def test_gpu_wheels_are_the_pinned_versions():
    """`make gpu-wheels` (what bench/gpu.sh installs on a lent GPU machine) downloads the very versions pyproject pins."""
    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    wheels = dict(w.split("==") for w in re.search(r"^GPU_WHEELS := (.*)$", make, re.M)[1].split() if "==" in w)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(d.split(";")[0].strip().split("==") for d in project["dependencies"]
                + project["optional-dependencies"]["test"] if "==" in d)
    shared = wheels.keys() & pins.keys()
    assert {"transformers", "pydantic", "gguf", "datasets", "jiwer", "liger-kernel"} <= shared
    assert {name: wheels[name] for name in shared} == {name: pins[name] for name in shared}


def test_mypy_strict_passes_on_the_public_api():
    """[tool.mypy] in pyproject.toml: strict on the modules that define the public names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    defining = {f"src/{moekit._API[name].replace('.', '/')}" for name in moekit._API}
    files = {f.removesuffix(".py").removesuffix("/__init__") for f in config["files"]}
    new_api = {"src/moekit/checkpoint/summary", "src/moekit/checkpoint/convert", "src/moekit/selection/api",
               "src/moekit/training/api", "src/moekit/routes", "src/moekit"}
    assert new_api <= files and new_api - {"src/moekit/routes", "src/moekit"} <= defining
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stdout + res.stderr


SOURCES = {"source", "src", "model", "trace", "experts", "data", "texts", "run_dir", "recipe", "cfg"}


def public_functions():
    for owner, names in ((moekit, moekit.__all__), (moekit.routes, moekit.routes.__all__),
                         (moekit.simoe, moekit.simoe.__all__), (moekit.speech, moekit.speech.__all__)):
        for name in names:
            value = getattr(owner, name)
            if pyinspect.isfunction(value):
                yield f"{owner.__name__}.{name}", value


def test_every_verb_takes_its_sources_before_its_output():
    """moekit.export(source, out, fmt), not (model, fmt, out): every parameter before `out` is an input."""
    checked = []
    for name, fn in public_functions():
        params = pyinspect.signature(fn).parameters
        if "out" in params:
            names = list(params)
            positional = params["out"].kind is pyinspect.Parameter.POSITIONAL_OR_KEYWORD
            before = names[:names.index("out")] if positional else names[:1]  # a keyword-only out: the first
            assert before and set(before) <= SOURCES, f"{name}{pyinspect.signature(fn)}"
            checked.append(name)
    assert {"moekit.export", "moekit.select", "moekit.prune", "moekit.finetune", "moekit.routes.collect", "moekit.routes.report",
            "moekit.upcycle_checkpoint", "moekit.save"} <= set(checked)


def test_every_verb_has_a_google_style_docstring_and_annotations():
    for name in ("export", "inspect", "select", "prune", "finetune", "finetune_plan", "train", "plan", "evaluate",
                 "load_recipe"):
        fn = getattr(moekit, name)
        doc = pyinspect.getdoc(fn) or ""
        assert all(f"\n{part}:\n" in doc for part in ("Args", "Returns", "Raises", "Example")), name
        hints = pyinspect.signature(fn)
        assert hints.return_annotation is not pyinspect.Signature.empty, name
        assert all(p.annotation is not pyinspect.Parameter.empty for p in hints.parameters.values()), name


# ------------------------------------------------------------------------------------------------------ the verbs

def digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in skip}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A tiny dense Llama, its MoE checkpoint (4 experts, top-2, every 2nd layer), two text files, a trace."""
    from moekit.testing import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("api")
    moekit.save(moekit.upcycle(tiny_llama(), moekit.MoESpec(num_experts=4, top_k=2, every=2)), root / "moe",
                tokenizer=tiny_tokenizer())
    (root / "en.txt").write_text("the day was long\nthe light is good\nwe walk home\n")
    (root / "fr.txt").write_text("le jour est long\nla mer est calme\nil fait beau\n")
    texts = {"en": root / "en.txt", "fr": root / "fr.txt"}
    moekit.routes.collect(root / "moe", texts, root / "trace.npz", max_length=32)
    return root


def test_inspect_returns_the_summary_the_command_prints(fx, run):
    from moekit.cli.common import human

    s = moekit.inspect(fx / "moe")
    assert isinstance(s, moekit.InspectSummary) and not s.native
    assert [(x.path, x.experts, x.top_k, x.router) for x in s.layers] == \
        [("model.layers.1.mlp", 4, 2, "own"), ("model.layers.3.mlp", 4, 2, "own")]
    model = moekit.load(fx / "moe")
    assert s.total_params == sum(p.numel() for p in model.parameters())
    assert s.spec == moekit.MoESpec(num_experts=4, top_k=2, every=2) and s.config["model_type"] == "llama"
    rc, out, err = run("inspect", fx / "moe")
    assert rc == 0, err
    assert f"total {human(s.total_params)}, active per token {human(s.active_params)}" in out
    assert "2 MoE layers" in out and "init: naive" in out


def test_inspect_reads_a_native_directory_from_its_config(tmp_path):
    from moekit.testing import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    model.save_pretrained(tmp_path / "native")
    s = moekit.inspect(tmp_path / "native")
    assert s.native and s.spec is None and s.description == "Qwen3MoeForCausalLM, native transformers MoE"
    assert len(s.layers) == model.config.num_hidden_layers
    assert {(x.experts, x.top_k) for x in s.layers} == {(model.config.num_experts, model.config.num_experts_per_tok)}
    assert s.total_params == sum(p.numel() for p in model.parameters())


def test_export_writes_the_commands_files(fx, tmp_path, run):
    w = moekit.export(fx / "moe", tmp_path / "py", "qwen2_moe")
    assert w.path == tmp_path / "py" and w.format == "qwen2_moe" and w.dtype == "float32"
    rc, _, err = run("export", fx / "moe", "--format", "qwen2_moe", "--out", tmp_path / "cli")
    assert rc == 0, err
    assert digests(tmp_path / "py") == digests(tmp_path / "cli")
    in_memory = moekit.export(moekit.load(fx / "moe"), tmp_path / "mem", "qwen2_moe")
    assert in_memory.bytes == w.bytes
    assert {k: v for k, v in digests(tmp_path / "mem").items() if k.endswith(".safetensors")} == \
        {k: v for k, v in digests(tmp_path / "py").items() if k.endswith(".safetensors")}


def test_export_in_memory_keeps_the_requested_dtype(fx, tmp_path):
    from safetensors import safe_open

    w = moekit.export(moekit.load(fx / "moe"), tmp_path / "bf16", "qwen2_moe", dtype="bfloat16")
    assert w.dtype == "bfloat16"
    with safe_open(next((tmp_path / "bf16").glob("*.safetensors")), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}


def test_routes_collect_and_report_equal_the_commands(fx, tmp_path, run):
    from moekit.routing.trace import RoutingTrace

    rc, _, err = run("routes", "collect", "--model", fx / "moe", "--texts", f"en={fx / 'en.txt'}",
                     f"fr={fx / 'fr.txt'}", "--out", tmp_path / "cli.npz", "--max-length", 32)
    assert rc == 0, err
    py, cli = RoutingTrace.load(fx / "trace.npz"), RoutingTrace.load(tmp_path / "cli.npz")
    assert np.array_equal(py.ids, cli.ids) and np.array_equal(py.weights, cli.weights) and py.meta == cli.meta
    assert moekit.routes.report(fx / "trace.npz", tmp_path / "py") == tmp_path / "py"
    rc, _, err = run("routes", "report", fx / "trace.npz", "--out", tmp_path / "cli")
    assert rc == 0, err
    assert json.loads((tmp_path / "py" / "metrics.json").read_text()) == \
        json.loads((tmp_path / "cli" / "metrics.json").read_text())


def test_select_and_prune_write_the_commands_files(fx, tmp_path, run):
    sel = moekit.select(fx / "trace.npz", "rise", "fr", 2, out=tmp_path / "py.json")
    assert sel.count == 2 and sel.target == "fr" and sel.source.trace == str(fx / "trace.npz")
    rc, _, err = run("select", "rise", fx / "trace.npz", "--target", "fr", "--budget", 2, "--out", tmp_path / "cli.json")
    assert rc == 0, err
    assert (tmp_path / "py.json").read_bytes() == (tmp_path / "cli.json").read_bytes()
    from moekit.routing.trace import RoutingTrace

    assert moekit.select(RoutingTrace.load(fx / "trace.npz"), "rise", "fr", 2).experts == sel.experts
    p = moekit.prune(fx / "moe", tmp_path / "py.json", tmp_path / "pruned-py")
    assert p.mode == "disable" and p.selection == sel and p.params == moekit.inspect(fx / "moe").total_params
    rc, _, err = run("prune", "--model", fx / "moe", "--experts", tmp_path / "py.json", "--out", tmp_path / "pruned-cli")
    assert rc == 0, err
    assert digests(tmp_path / "pruned-py") == digests(tmp_path / "pruned-cli")


def test_finetune_trains_what_the_command_trains(fx, tmp_path, run):
    sel = moekit.select(fx / "trace.npz", "rise", "fr", 2, out=tmp_path / "sel.json")
    done = moekit.finetune(fx / "moe", tmp_path / "sel.json", {"fr": fx / "fr.txt"}, tmp_path / "py", steps=2,
                           batch_size=2, max_length=16, device="cpu")
    assert done.steps == 2 and len(done.losses) == 2 and done.selection == sel
    assert done.trained == {layer: ids for layer, ids in sel.experts.items() if ids}  # every selected expert trained
    rc, _, err = run("finetune", "--model", fx / "moe", "--experts", tmp_path / "sel.json", "--data",
                     f"fr={fx / 'fr.txt'}", "--out", tmp_path / "cli", "--steps", 2, "--batch-size", 2,
                     "--max-length", 16, "--device", "cpu")
    assert rc == 0, err
    assert digests(tmp_path / "py", skip=("finetune.json",)) == digests(tmp_path / "cli", skip=("finetune.json",))
    logged = json.loads((tmp_path / "cli" / "finetune.json").read_text())
    assert [e["loss"] for e in logged["log_history"] if "loss" in e] == done.losses
    p = moekit.finetune_plan(fx / "moe", tmp_path / "sel.json", batch_size=2, max_length=16, devices=2)
    rows = sum(len(ids) for ids in sel.experts.values())  # each selected expert's rows train, nothing else
    _, layer = moekit.moe_layers(moekit.load(fx / "moe"))[0]
    per_expert = sum(t.numel() for t in layer.experts.parameters()) // layer.router.num_experts
    assert p.devices == 2 and p.trainable == rows * per_expert
    rc, out, err = run("finetune", "--model", fx / "moe", "--experts", tmp_path / "sel.json", "--data",
                       f"fr={fx / 'fr.txt'}", "--out", tmp_path / "dry", "--batch-size", 2, "--max-length", 16, "--devices", 2, "--dry-run")
    assert rc == 0, err
    assert f"{p.params:,}" in out and p.title in out and not (tmp_path / "dry").exists()


def test_train_plan_and_evaluate_equal_the_commands(tmp_path, run, tiny_recipe_overrides):
    recipe = ROOT / "recipes" / "naive.yaml"
    overrides = [*tiny_recipe_overrides(tmp_path / "py"), "moe.num_experts=4", "moe.top_k=2", "moe.every=2",
                 "eval.generate=false"]
    p = moekit.plan(recipe, overrides, devices=2)
    assert p.devices == 2 and p.params == moekit.plan(moekit.load_recipe(recipe, overrides), devices=2).params
    rc, out, err = run("train", recipe, *overrides, "--dry-run", "--devices", 2)
    assert rc == 0, err
    assert f"{p.params:,}" in out and p.title in out
    trainer = moekit.train(recipe, overrides)
    assert trainer.state.global_step == 2
    cli_overrides = [*tiny_recipe_overrides(tmp_path / "cli"), *overrides[-4:]]
    rc, _, err = run("train", recipe, *cli_overrides)
    assert rc == 0, err
    assert digests(tmp_path / "py" / "model") == digests(tmp_path / "cli" / "model")
    e = moekit.evaluate(tmp_path / "py")
    assert e.recipe.task == "translation" and e.results == trainer.results == \
        json.loads((tmp_path / "py" / "results.json").read_text())
    rc, _, err = run("evaluate", tmp_path / "cli")
    assert rc == 0, err
    assert json.loads((tmp_path / "cli" / "results.json").read_text()) == e.results


# ------------------------------------------------------------------------------------------------- bad input

def refusals(fx: Path, t: Path):
    """(Python call, command line) pairs that must refuse with one message."""
    (t / "empty.txt").write_text("\n\n")
    (t / "run").mkdir()
    return {
        "inspect-not-a-checkpoint": (lambda: moekit.inspect(t / "run"), ["inspect", t / "run"]),
        "export-not-a-checkpoint": (lambda: moekit.export(t / "run", t / "o", "mixtral"),
                                    ["export", t / "run", "--format", "mixtral", "--out", t / "o"]),
        "collect-empty-texts": (lambda: moekit.routes.collect(fx / "moe", {"en": t / "empty.txt"}, t / "t.npz"),
                                ["routes", "collect", "--model", fx / "moe", "--texts", f"en={t / 'empty.txt'}",
                                 "--out", t / "t.npz"]),
        "report-unknown-reference": (lambda: moekit.routes.report(fx / "trace.npz", t / "o", reference="xx"),
                                     ["routes", "report", fx / "trace.npz", "--out", t / "o", "--reference", "xx"]),
        "select-unknown-target": (lambda: moekit.select(fx / "trace.npz", "rise", "xx", 2, out=t / "s.json"),
                                  ["select", "rise", fx / "trace.npz", "--target", "xx", "--budget", 2, "--out",
                                   t / "s.json"]),
        "prune-output-exists": (lambda: moekit.prune(fx / "moe", fx / "missing.json", fx / "moe"),
                                ["prune", "--model", fx / "moe", "--experts", fx / "missing.json", "--out", fx / "moe"]),
        "evaluate-not-a-run": (lambda: moekit.evaluate(t / "run"), ["evaluate", t / "run"]),
        "train-unknown-key": (lambda: moekit.train(ROOT / "recipes" / "naive.yaml", ["train.nope=1"]),
                              ["train", ROOT / "recipes" / "naive.yaml", "train.nope=1"]),
        "plan-unknown-key": (lambda: moekit.plan(ROOT / "recipes" / "naive.yaml", ["moe.nope=1"]),
                             ["train", ROOT / "recipes" / "naive.yaml", "moe.nope=1", "--dry-run"]),
    }


CASES = ["inspect-not-a-checkpoint", "export-not-a-checkpoint", "collect-empty-texts", "report-unknown-reference",
         "select-unknown-target", "prune-output-exists", "evaluate-not-a-run", "train-unknown-key",
         "plan-unknown-key"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_the_message_the_command_prints(fx, tmp_path, run, case):
    call, argv = refusals(fx, tmp_path)[case]
    before = digests(tmp_path)
    with pytest.raises(MoekitError) as e:
        call()
    rc, out, err = run(*argv)
    assert rc == 2 and out == ""
    assert err == f"moekit: error: {' '.join(str(e.value).split())}\n"
    assert digests(tmp_path) == before


@pytest.mark.parametrize("call, message", [
    (lambda fx, t: moekit.routes.collect(fx / "moe", {"en": fx / "en.txt"}, t / "t.npz", max_length=0),
     "max_length, batch_size, max_texts and experts_per_load must be ≥ 1"),
    (lambda fx, t: moekit.routes.collect(fx / "moe", {"en": fx / "en.txt"}, t / "t.npz", experts_per_load=2,
                                         stream="off"),
     "experts_per_load reads a layer's experts a few at a time in the streamed capture; stream='off' loads the whole "
     "model"),
    (lambda fx, t: moekit.routes.collect(fx / "moe", {"en": fx / "en.txt"}, t / "t.npz", device="tpu"),
     "expected a device auto, cpu, cuda or cuda:N, got 'tpu'"),
    (lambda fx, t: moekit.finetune(fx / "moe", fx / "sel.json", {"en": fx / "en.txt"}, t / "ft", batch_size=3,
                                   grad_accum=2), "batch_size 3 is not a multiple of grad_accum 2"),
    (lambda fx, t: moekit.finetune(fx / "moe", fx / "sel.json", {"en": fx / "en.txt"}, t / "ft", epochs=0),
     "epochs, steps, batch_size, grad_accum and max_length must be positive"),
    (lambda fx, t: moekit.finetune_plan(fx / "moe", fx / "sel.json", batch_size=4, grad_accum=3),
     "batch_size 4 is not a multiple of grad_accum 3"),
    (lambda fx, t: moekit.finetune_plan(fx / "moe", fx / "sel.json", max_length=0),
     "batch_size, grad_accum and max_length must be positive"),
    (lambda fx, t: moekit.prune(fx / "moe", fx / "sel.json", t / "p", mode="remove"),  # type: ignore[arg-type]
     "unknown prune mode 'remove'; choose disable, keep or drop"),
    (lambda fx, t: moekit.export(fx / "moe", t / "e", "qwen2_moe", dtype="int8"),
     "unknown dtype 'int8'; choose auto, float32, bfloat16, float16"),
], ids=["collect-max-length", "collect-experts-per-load-unstreamed", "collect-device", "finetune-accumulation", "finetune-epochs",
        "finetune-plan-accumulation", "finetune-plan-length", "prune-mode", "export-dtype"])
def test_settings_out_of_range_are_refused_in_keyword_words_before_any_work(fx, tmp_path, call, message):
    """The functions check what the command's parser and flags check, worded as their keyword arguments."""
    with pytest.raises(MoekitError) as e:
        call(fx, tmp_path)
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []
