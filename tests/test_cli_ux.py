"""The command line's finish: --version, defaults and choices in every help, light help, per-method select help,
`list methods`, readable progress and tables through pipes, native `inspect`, CLI wording of library remedies."""
import argparse
import importlib
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit.cli.common import LazyParser, shows_default
from moekit.cli.main import build_parser

SRC = str(Path(__file__).resolve().parents[1] / "src")


def python(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    """`python ARGS` with stdout and stderr pipes (not terminals), this checkout's sources first."""
    env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, **kwargs)


def moekit(*args, **kwargs) -> subprocess.CompletedProcess:
    """`python -m moekit ARGS` (see `python`)."""
    return python("-m", "moekit", *args, **kwargs)


def parsers(parser: argparse.ArgumentParser, name: str = "moekit"):
    """(command words, parser) of the top parser and every subcommand's, however deep."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                yield from parsers(sub.built() if isinstance(sub, LazyParser) else sub, f"{name} {word}")


def test_version_from_the_package_metadata(run):
    rc, out, _ = run("--version")
    assert rc == 0
    assert out.startswith(f"moekit {importlib.metadata.version('moekit')} from ")
    assert Path(out.split(" from ")[1].split(" (Python")[0]) == Path(SRC) / "moekit"


def test_version_without_metadata_falls_back_to_the_source_tree(run, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    import tomllib

    project = tomllib.loads((Path(SRC).parent / "pyproject.toml").read_text())["project"]
    rc, out, _ = run("--version")
    assert rc == 0 and out.startswith(f"moekit {project['version']} from ")


def test_every_help_shows_its_defaults_and_choices():
    seen = 0
    for name, parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())  # argparse wraps lines anywhere
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS and shows_default(action):
                assert f"(default: {action.default})" in text, f"`{name} --help` does not show {action.dest}'s default"
                seen += 1
            for choice in action.choices or ():
                assert str(choice) in text, f"`{name} --help` does not list {choice!r} of {action.dest}"
    assert seen > 10


def test_upcycle_help_shows_the_spec_defaults():
    from moekit.init import EXPERT_INITS
    from moekit.moe.spec import MoESpec

    spec = MoESpec()
    text = " ".join(dict(parsers(build_parser()))["moekit upcycle"].format_help().split())
    assert f"experts per MoE layer (default: {spec.num_experts})" in text
    assert f"experts per token (default: {spec.top_k})" in text
    assert f"(default: {spec.init.method})" in text and spec.every is None and spec.layers is None
    assert text.count("(default: all layers)") == 2
    assert f"--method {{{','.join(EXPERT_INITS.names())}}}" in text  # the choices are the registry's


@pytest.mark.parametrize("package, registry", [("moekit.init", "EXPERT_INITS"), ("moekit.checkpoint.export", "EXPORTERS"),
                                               ("moekit.selection", "SELECTORS")])
def test_registries_read_from_source_equal_the_imported_ones(package, registry):
    from moekit.registry import declared

    imported = getattr(importlib.import_module(package), registry)
    found = declared(package, registry)
    assert list(found) == imported.names()
    classes = {n: imported.get(n) for n in found if isinstance(imported.get(n), type)}
    assert all(found[n] == inspect.cleandoc(cls.__doc__) for n, cls in classes.items())


def test_help_imports_neither_torch_nor_transformers():
    code = ("import contextlib, io, json, sys\n"
            "from moekit.cli.main import build_parser, main\n"
            "def heavy(*argvs):\n"
            "    for argv in argvs:\n"
            "        with contextlib.redirect_stdout(io.StringIO()):\n"
            "            assert main(argv) == 0, argv\n"
            "    return [m for m in ('torch', 'transformers', 'numpy', 'pydantic') if m in sys.modules]\n"
            "build_parser()\n"
            "print(json.dumps([heavy(['--help'], ['--version'], ['upcycle', '--help'], ['list', '--help'],\n"
            "                        ['list', 'methods'], ['list', 'formats']),\n"
            "                  heavy(*[[*cmd.split(), '--help'] for cmd in ('select rise', 'routes collect', 'train',\n"
            "                          'evaluate', 'inspect', 'export', 'finetune', 'speech corpus', 'demo')])]))")
    res = python("-c", code)
    assert res.returncode == 0, res.stderr
    light, select = json.loads(res.stdout)
    assert light == []  # the top help, `list` and most commands' import no numerical module at all
    assert select == ["numpy", "pydantic"]  # `select METHOD --help` reads the method's pydantic settings


@pytest.mark.parametrize("method, settings", [
    ("rise", {"--alpha": "(default: 10.0)", "--ratios": "(default: 0.35,0.25,0.4)",
              "--regions": "(default: 0.375,0.25,0.375)"}),
    ("esft", {"--score": "{gate,token}", "--top-p": "0.1 for gate, 0.2 for token"}),
    ("random", {"--seed": "(default: 0)"}),
    ("topk", {}),
])
def test_each_select_method_has_its_own_help(run, method, settings):
    from moekit.selection import SELECTORS

    rc, out, _ = run("select", method, "--help")
    text = " ".join(out.split())
    assert rc == 0 and text.startswith(f"usage: moekit select {method} ")
    others = {f"--{f.replace('_', '-')}" for m in SELECTORS.names() for f in SELECTORS.get(m).model_fields} - {
        f"--{f.replace('_', '-')}" for f in SELECTORS.get(method).model_fields}
    for flag, shown in settings.items():
        assert f"{flag} " in text and shown in text.split(flag, 1)[1]
    assert not [flag for flag in others if f"{flag} " in text]  # no other method's settings


def method_blocks(out: str) -> dict[str, str]:
    """{method: its rows of `moekit list methods` joined} (a row starts at column 0, its parameters continue)."""
    blocks: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:
        if not line.startswith(" "):
            blocks[line.split()[0]] = []
        blocks[list(blocks)[-1]].append(line)
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def test_list_methods_shows_each_parameter_default_and_paper():
    from moekit.cli.common import summary
    from moekit.init import EXPERT_INITS

    res = moekit("list", "methods")
    assert res.returncode == 0, res.stderr
    blocks = method_blocks(res.stdout)
    assert list(blocks) == EXPERT_INITS.names()
    for name, block in blocks.items():
        cls = EXPERT_INITS.get(name)
        assert summary(cls.__doc__) in block.splitlines()[0]  # the paper reference, whole on its row
        cells = [line.split()[1 if i == 0 else 0] for i, line in enumerate(block.splitlines()) if line.strip()]
        for field, info in cls.model_fields.items():
            if field != "method":
                want = f"{field}" if info.is_required() else f"{field}={info.get_default(call_default_factory=True)}"
                assert want in cells, (name, field, cells)


def test_list_formats_reads_the_registry_without_importing_it():
    from moekit.cli.common import summary
    from moekit.checkpoint.export import EXPORTERS

    res = moekit("list", "formats")
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in res.stdout.splitlines()[1:]}
    assert rows == {name: summary(type(EXPORTERS.get(name)).__doc__) for name in EXPORTERS.names()}


def test_piped_tables_are_as_wide_as_their_content():
    res = moekit("list", "methods")
    lines = res.stdout.splitlines()
    assert lines and all(line == line.rstrip() for line in lines)  # no padding
    header = lines[0]
    second, third = header.index("parameters"), header.index("paper and summary")
    summaries = [line[third:] for line in lines[1:] if len(line) > third]
    assert max(map(len, lines)) == third + max(map(len, summaries)) > 200  # not cut at any width
    assert second == max(len(line.split()[0]) for line in lines if line[0] != " ") + 2  # as wide as the widest name


def test_tables_on_a_terminal_fit_its_width():
    import pty
    import re

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "moekit", "list", "methods"], stdout=follower, stderr=follower,
                            env={**os.environ, "PYTHONPATH": SRC, "COLUMNS": "90", "TERM": "xterm"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait() == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())
    lines = [line for line in text.replace("\r", "").splitlines() if line.strip()]
    assert len(lines) > 20 and max(map(len, lines)) <= 90


def save_native(kind: str, folder: Path) -> dict:
    """A tiny Mixtral or Qwen3-MoE saved to `folder` (2 MoE layers, 4 experts, top-2); its numbers."""
    import transformers as tf

    H, I, E, k, L = 32, 16, 4, 2, 2
    common = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                  num_experts_per_tok=k, max_position_embeddings=64)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=I, num_local_experts=E, **common))
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=I, intermediate_size=48,
                                                         num_experts=E, head_dim=8, **common))
    model.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    return {"layers": L, "experts": E, "top_k": k, "total": total, "active": total - L * (E - k) * 3 * H * I,
            "class": type(model).__name__}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_inspect_a_native_moe_directory(run, tmp_path, kind):
    want = save_native(kind, tmp_path / kind)
    rc, out, err = run("inspect", tmp_path / kind)
    assert rc == 0, err
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if "model.layers." in line]
    assert [r[:3] for r in rows] == [[f"model.layers.{i}.mlp", str(want["experts"]), str(want["top_k"])]
                                     for i in range(want["layers"])]
    assert f"{want['layers']} MoE layers" in out and want["class"] in out
    assert f"parameters: total {want['total']:,} " in out and f"active per token {want['active']:,} " in out


def test_inspect_reads_no_weights_of_a_native_directory(run, tmp_path):
    want = save_native("mixtral", tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()  # the config alone describes the model
    rc, out, err = run("inspect", tmp_path / "m")
    assert rc == 0, err
    assert f"active per token {want['active']:,} " in out


def test_inspect_of_a_dense_directory_says_why(run, tmp_path):
    from moekit.testing import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "dense")
    rc, _, err = run("inspect", tmp_path / "dense")
    assert rc == 2
    assert "is not a moekit checkpoint (no moekit.json), and LlamaForCausalLM has no MoE layer" in err


def test_library_words_a_remedy_as_the_keyword_and_the_cli_as_the_flag(run, tmp_path):
    import torch

    from moekit.errors import CheckpointError
    from moekit.checkpoint.dense import load_dense
    from moekit.testing import tiny_llama

    model = tiny_llama()
    model.config.save_pretrained(tmp_path / "pickled")
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        load_dense(tmp_path / "pickled")
    assert "pass allow_pickle=True only if you trust them" in str(info.value) and "--" not in str(info.value)
    rc, _, err = run("upcycle", "--model", tmp_path / "pickled", "--out", tmp_path / "moe")
    assert rc == 2 and "pass --allow-pickle only if you trust them" in err and "allow_pickle" not in err


def test_every_remedy_keyword_becomes_its_flag():
    from moekit.cli.main import FLAGS, build_parser, message
    from moekit.errors import NumericsError, OutputExistsError

    assert message(OutputExistsError("out", "out is not empty")) == "out is not empty; pass --overwrite to replace it"
    assert message(NumericsError("x is NaN; pass allow_nonfinite=True to proceed")) == \
        "x is NaN; pass --allow-nonfinite to proceed"
    flags = {o for _, p in parsers(build_parser()) for a in p._actions for o in a.option_strings}
    assert set(FLAGS.values()) <= flags  # every flag the CLI words a remedy as exists


def test_library_messages_name_no_flags():
    import ast
    import re

    flag = re.compile(r"(^|[\s(`'])--[a-z]")
    for path in (Path(SRC) / "moekit").rglob("*.py"):
        if "cli" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise):
                texts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                assert not [t for t in texts if flag.search(t)], f"{path}:{node.lineno} words a remedy as a flag"


def progress_lines(err: str, task: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{task} ")]


def test_piped_progress_is_plain_lines_with_counts(tmp_path):
    from moekit.testing import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "dense")  # 4 blocks
    res = moekit("upcycle", "--model", tmp_path / "dense", "--experts", 4, "--top-k", 2, "--out", tmp_path / "moe")
    assert res.returncode == 0, res.stderr
    lines = progress_lines(res.stderr, "upcycling")
    assert lines and lines[-1].startswith("upcycling 4/4 model.layers.3.mlp (") and lines[-1].endswith(" s)")
    assert "\r" not in res.stderr and "\x1b" not in res.stderr  # no bar redrawn in a log
    res = moekit("export", tmp_path / "moe", "--format", "mixtral", "--out", tmp_path / "mixtral")
    assert res.returncode == 0, res.stderr
    assert progress_lines(res.stderr, "exporting")[-1].startswith("exporting 4/4 model.layers.3.mlp (")


def test_training_and_evaluation_report_steps_loss_and_examples(tmp_path, tiny_recipe_overrides, run):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: moe\nmoe: {num_experts: 4, top_k: 2, init: naive, every: 2}\n")
    rc, _, err = run("train", recipe, *tiny_recipe_overrides(tmp_path / "run", **{"train.steps": 3}))
    assert rc == 0, err
    assert progress_lines(err, "upcycling")[-1].startswith("upcycling 2/2 model.layers.3.mlp")
    training = progress_lines(err, "training")
    assert training[-1].startswith("training 3/3 loss ")  # the step, of max_steps, with the latest loss
    assert float(training[-1].split()[3]) > 0
    assert progress_lines(err, "generating")[-1].startswith("generating 2/2 ")  # 2 test pairs per direction
    rc, _, err = run("evaluate", tmp_path / "run")
    assert rc == 0, err
    assert progress_lines(err, "generating")[-1].startswith("generating 2/2 ")


def test_the_library_prints_no_progress(tmp_path, capfd):
    from moekit.moe.spec import MoESpec
    from moekit.testing import tiny_llama
    from moekit.checkpoint.upcycle_model import upcycle

    upcycle(tiny_llama(), MoESpec(num_experts=2, top_k=1))
    assert capfd.readouterr() == ("", "")  # progress records go to the moekit.progress logger, unseen by default


def test_progress_records_carry_their_counts(caplog):
    import logging

    from moekit.moe.spec import MoESpec
    from moekit.testing import tiny_llama
    from moekit.checkpoint.upcycle_model import upcycle

    with caplog.at_level(logging.INFO, logger="moekit.progress"):
        upcycle(tiny_llama(), MoESpec(num_experts=2, top_k=1, every=2))
    assert [r.progress for r in caplog.records] == [("upcycling", 1, 2, "model.layers.1.mlp"),
                                                   ("upcycling", 2, 2, "model.layers.3.mlp")]
    assert caplog.records[-1].getMessage() == "upcycling 2/2 model.layers.3.mlp"


def test_public_api_is_lazy_and_exports_export():
    code = ("import sys, moekit\n"
            "light = 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "from moekit import export\n"
            "import moekit.checkpoint.convert\n"
            "assert export is moekit.checkpoint.convert.export and 'export' in moekit.__all__\n"
            "assert all(getattr(moekit, name) is not None for name in moekit.__all__)\n"
            "print(light)")
    res = python("-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "True"  # `import moekit` imports neither torch nor transformers


ENTRY = """
import atexit, sys, threading, time
from pathlib import Path
from moekit.cli.main import entry
done = Path(sys.argv[1])
atexit.register(lambda: print("exit handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.5), done.write_text("joined"))).start()  # a non-daemon thread
sys.argv = ["moekit", *sys.argv[2:]]
entry()
print("never reached")
"""


@pytest.mark.parametrize("argv,code", [(["--version"], 0), (["nosuch"], 2)])
def test_the_command_ends_without_teardown_but_with_what_an_exit_does(argv, code, tmp_path):
    """`moekit` (and `python -m moekit`) is cli.main.entry: main()'s exit code, then no interpreter teardown (it frees
    torch's and transformers' modules one by one), but non-daemon threads joined and atexit handlers run first."""
    res = subprocess.run([sys.executable, "-c", ENTRY, str(tmp_path / "done"), *argv], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == code, res.stderr
    assert "exit handler ran" in res.stdout and "never reached" not in res.stdout
    assert (tmp_path / "done").read_text() == "joined"
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["moekit"] == "moekit.cli.main:entry"


def test_naming_an_activation_builds_none_of_the_others():
    """surgery.locate names an FFN's activation by comparing it with transformers' ACT2FN on a probe, finding its
    class in ACT2CLS without building every activation: building xIELU prints a warning about its CUDA kernel on
    every command that reads a dense model."""
    names = ["gelu_new", "gelu_pytorch_tanh", "silu", "relu2", "gelu_10", "quick_gelu", "mish"]
    code = ("import sys; from transformers.activations import ACT2FN; from moekit.surgery.locate import _named; "
            "print(*(_named(ACT2FN[k], None) for k in sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == names, res.stdout + res.stderr  # each its own name
    assert "xIELU" not in res.stderr
