"""Bad inputs and faults, command by command: every row runs the CLI in-process on something wrong and asserts

1. exit code 2,
2. stderr ends with exactly one line `moekit: error: ...` that names the problem (a regex per row); only progress
   lines (and the line saying where a Hub id is looked up) may precede it,
3. nothing new in the output's parent directory (no `.NAME.moekit-tmp-*`, `-lock`, `-partial`, no output),
4. every file that existed under the test's directory (and the shared fixtures) is still there, byte for byte.

Fixtures a row damages are copied into its tmp_path first; the shared ones are hashed around every row too.
Rows that show a bug would be marked xfail(strict=True) with the reason; none are left.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import resource
import shutil
import signal
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

ERR = "moekit: error: "
PROGRESS = re.compile(r"^[a-z]+ \d+/(\d+|\?) \S* ?\(\d+ s(, ETA \d+ s)?\)$"
                      r"|^(looking up|fetching) \S+ in the Hugging Face cache \S+$")  # or where a Hub id is looked up
LEFTOVER = re.compile(r"\.moekit-(tmp-|lock|partial)")
CASE_SECONDS = 120  # a row that hangs (e.g. reading a FIFO or /dev/zero) fails instead of blocking the run
MAX_RSS_GROWTH = 1 << 30  # bytes; a row that allocates what a hostile file asks for shows up here


# ---------------------------------------------------------------------------------------------- fixtures


class Fx:
    """The shared, never-modified inputs (copied into a row's tmp_path when a row needs to damage them)."""

    def __init__(self, root: Path, data_root: Path):
        self.root, self.data_root = root, data_root
        self.dense, self.moe = root / "dense", root / "moe"
        self.en, self.fr = root / "en.txt", root / "fr.txt"
        self.trace, self.sel, self.recipe = root / "trace.npz", root / "sel.json", root / "recipe.yaml"
        self.layers = ["model.layers.1.mlp", "model.layers.3.mlp"]
        self.train_jsonl, self.test_jsonl = data_root / "train.jsonl", data_root / "test.jsonl"

    @property
    def native(self) -> Path:
        """A tiny Qwen3-MoE checkpoint (8 experts, top-2, 3 MoE layers) as transformers writes it (first use)."""
        folder = self.root / "native"
        if not folder.is_dir():
            from moekit.testing import tiny_qwen3_moe, tiny_tokenizer

            tiny_qwen3_moe().save_pretrained(folder)
            tiny_tokenizer().save_pretrained(folder)
        return folder

    @property
    def hub(self) -> Path:
        """A Hugging Face cache holding org/tiny (the dense fixture), filled by huggingface_hub (first use)."""
        cache = self.root / "hub"
        if not cache.is_dir():
            from moekit.testing.fake_hub import download

            download(cache, {"org/tiny": self.dense})
        return cache

    @property
    def finished_run(self) -> Path:
        """A finished tiny training run with checkpoints at steps 1 and 2 (trained on first use)."""
        run = self.root / "finished"
        if not run.is_dir():
            from moekit.cli.main import main

            shown = io.StringIO()  # not in the output of the row that happens to train it
            with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
                rc = main(["train", str(self.recipe), f"out={run}", "train.save_every=1", "train.save_total_limit=2"])
            assert rc == 0, shown.getvalue()
        return run

    def copy(self, src: Path, dst: Path) -> Path:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst


@pytest.fixture(scope="module")
def fx(tmp_path_factory, tiny_recipe_overrides):
    from moekit.cli.main import main
    from moekit.config import apply_overrides
    from moekit.checkpoint.format import save
    from moekit.moe.spec import MoESpec
    from moekit.selection.selection import Selection
    from moekit.testing import tiny_llama, tiny_tokenizer
    from moekit.checkpoint.upcycle_model import upcycle

    root = tmp_path_factory.mktemp("bad_inputs")
    f = Fx(root, tiny_recipe_overrides.dense.parent)
    tiny_llama().save_pretrained(f.dense)
    tiny_tokenizer().save_pretrained(f.dense)
    save(upcycle(tiny_llama(), MoESpec(num_experts=4, top_k=2, every=2)), f.moe, tokenizer=tiny_tokenizer())
    f.en.write_text("the day was long\nthe light is good\nwe walk home\n")
    f.fr.write_text("le jour est long\nla mer est calme\nil fait beau\n")
    assert main(["routes", "collect", "--model", str(f.moe), "--texts", f"en={f.en}", f"fr={f.fr}",
                 "--out", str(f.trace), "--max-length", "32"]) == 0
    Selection(method="manual", target="fr", budget=2, experts={f.layers[0]: [0, 1]}).save(f.sel)
    recipe = yaml.safe_load(Path(__file__).parent.parent.joinpath("recipes", "naive.yaml").read_text())
    recipe = apply_overrides(recipe, [*tiny_recipe_overrides(root / "unused_run"), "moe.num_experts=4",
                                      "moe.top_k=2", "moe.every=2", "train.save_every=0", "eval.generate=false"])
    f.recipe.write_text(yaml.safe_dump(recipe))
    return f


# ---------------------------------------------------------------------------------------------- the check


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256 | "dir" | "link -> target" | "special"} of everything under root, hidden entries
    included; symbolic links are not followed and FIFOs/devices are not read."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel, st = str(p.relative_to(root)), os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = f"link -> {os.readlink(p)}"
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(p, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                out[rel] = h.hexdigest()
            else:
                out[rel] = "special"
    return out


def listing(folder: Path) -> list[str] | None:
    return sorted(os.listdir(folder)) if folder.is_dir() else None


@dataclass
class Case:
    id: str
    build: Callable  # (tmp_path, fx) -> argv, or (argv, output path) where argv has no --out / out=
    match: str  # regex the error line must contain
    cwd: str | None = None  # directory under tmp_path to run in (default: tmp_path)
    bug: str | None = None  # xfail(strict=True) reason for a row that shows a bug
    seconds: int = CASE_SECONDS  # the command must give up within this time (fail fast on hostile input)
    env: Callable[[Path], dict] | None = None  # environment variables for the row, from its tmp_path


def output_of(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("out="):
            return a[4:]
    return None


class _Timeout(BaseException):
    """Raised by SIGALRM inside the command; a BaseException, so the CLI's `except Exception` lets it through."""


def _alarm(signum, frame):
    raise _Timeout()


def check(run, case: Case, t: Path, fx: Fx, monkeypatch) -> str:
    """Run `case` in `t` and assert the four guarantees; returns the error line."""
    cwd = t / case.cwd if case.cwd else t
    cwd.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(cwd)
    for key, value in (case.env(t) if case.env else {}).items():
        monkeypatch.setenv(key, str(value))
    built = case.build(t, fx)
    argv, out = built if isinstance(built, tuple) else (built, output_of([str(a) for a in built]))
    argv = [str(a) for a in argv]
    parent = Path(os.path.abspath(cwd / out)).parent if out is not None else None
    before, parent_before = snapshot(t), listing(parent) if parent else None
    shared = {root: snapshot(root) for root in (fx.root, fx.data_root)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(case.seconds)
    try:
        rc, stdout, err = run(*argv)
    except _Timeout:
        pytest.fail(f"moekit {' '.join(argv)} did not finish within {case.seconds} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    after = snapshot(t)
    shown = f"moekit {' '.join(argv)}\nrc={rc}\nstderr={err!r}\nstdout={stdout[-2000:]!r}"
    # 1. exit code; 2. one line naming the problem
    assert rc == 2, shown
    lines = err.splitlines()  # progress lines (`upcycling 2/4 model.layers.1.mlp (0 s)`) may precede the error
    assert err.endswith("\n") and lines[-1].startswith(ERR) and all(PROGRESS.match(x) for x in lines[:-1]), shown
    assert "Traceback" not in err and "MOEKIT_DEBUG" not in err, shown  # not an unexpected exception
    assert re.search(case.match, err), f"{shown}\nexpected to match: {case.match!r}"
    # 3. no leftovers beside the output, nothing new anywhere
    if parent is not None:
        assert listing(parent) == parent_before, f"{shown}\nentries of {parent} changed"
    leftovers = [p for p in after if LEFTOVER.search(Path(p).name) and p not in before]
    assert not leftovers, f"{shown}\nleftovers: {leftovers}"
    new = sorted(after.keys() - before.keys())
    assert not new, f"{shown}\nnew entries: {new}"
    # 4. every pre-existing file present and unchanged (the shared fixtures too)
    missing = sorted(before.keys() - after.keys())
    assert not missing, f"{shown}\ndisappeared: {missing}"
    changed = sorted(k for k in before if after[k] != before[k])
    assert not changed, f"{shown}\nchanged: {changed}"
    assert {root: snapshot(root) for root in shared} == shared, f"{shown}\na shared fixture changed"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
    assert grown < MAX_RSS_GROWTH, f"{shown}\npeak memory grew by {grown / 2**20:.0f} MiB"
    return err


# ---------------------------------------------------------------------------------------------- builders


def dense(t: Path, fx: Fx, name: str = "dense") -> Path:
    return fx.copy(fx.dense, t / name)


def moe(t: Path, fx: Fx, name: str = "moe") -> Path:
    return fx.copy(fx.moe, t / name)


def text(t: Path, fx: Fx, lang: str = "en", name: str | None = None) -> Path:
    return fx.copy(fx.en if lang == "en" else fx.fr, t / (name or f"{lang}.txt"))


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def existing_dir(path: Path) -> Path:
    write(path / "keep.txt", "the user's file")
    return path


def symlink(link: Path, target: Path | str) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def edit_json(path: Path, fn: Callable[[dict], object]) -> Path:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))
    return path


def dig(data, dotted: str, value) -> None:
    """data[a][b][0][c] = value for dotted "a.b.0.c" (a value of DELETE removes the key)."""
    *parents, leaf = dotted.split(".")
    for p in parents:
        data = data[int(p)] if isinstance(data, list) else data[p]
    if value is DELETE:
        del data[leaf]
    elif isinstance(data, list):
        data[int(leaf)] = value
    else:
        data[leaf] = value


DELETE = object()


def also(value, *side_effects):
    """`value`, once the side effects (evaluated as arguments, in order) have run."""
    return value


def upc(model, out, *extra) -> list:
    return ["upcycle", "--model", model, "--experts", 4, "--top-k", 2, "--out", out, *extra]


def dense_with(t: Path, fx: Fx, damage: Callable[[Path], object]) -> Path:
    d = dense(t, fx)
    damage(d)
    return d


def moe_with(t: Path, fx: Fx, damage: Callable[[Path], object]) -> Path:
    d = moe(t, fx)
    damage(d)
    return d


def meta_set(t: Path, fx: Fx, dotted: str, value) -> Path:
    """A copy of the MoE checkpoint with moekit.json's `dotted` field set to `value`."""
    return moe_with(t, fx, lambda d: edit_json(d / "moekit.json", lambda m: dig(m, dotted, value)))


def index(folder: Path, shard, extra: dict | None = None) -> None:
    """model.safetensors.index.json mapping every tensor of model.safetensors to `shard`."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as h:
        keys = list(h.keys())
    wmap = {k: shard for k in keys} | (extra or {})
    write(folder / "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": wmap}))


def tensor_edit(folder: Path, name: str, fn: Callable) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    fn(tensors[name])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def trace_with(t: Path, fx: Fx, name: str = "trace.npz", **changes) -> Path:
    """A trace .npz built by hand from the fixture's arrays: each change is an array, a function of the old
    array, or None (drop the field)."""
    with np.load(fx.trace, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for key, change in changes.items():
        if change is None:
            arrays.pop(key)
        else:
            arrays[key] = change(arrays[key].copy()) if callable(change) else change
    path = t / name
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def link_out(t: Path, name: str, dest: str):
    """A change for moe_with / dense_with: the checkpoint's file `name` moved out to t/dest, a symlink to it left."""
    return lambda d: (shutil.move(d / name, t / dest), symlink(d / name, t / dest))


def set_item(index_, value):
    def fn(a):
        a[index_] = value
        return a
    return fn


def zip_bomb(t: Path, fx: Fx) -> Path:
    """A trace whose zip directory claims ~4 GiB per member for 20 members (80 GiB in all)."""
    path = trace_with(t, fx, **{f"pad{i}": np.zeros(1) for i in range(10)})
    data = bytearray(path.read_bytes())
    pos = 0
    while (pos := data.find(b"PK\x01\x02", pos)) >= 0:  # central directory headers: uncompressed size at +24
        struct.pack_into("<I", data, pos + 24, 0xFFFFFFF0)
        pos += 4
    path.write_bytes(bytes(data))
    return path


def selection(t: Path, data, name: str = "sel.json") -> Path:
    return write(t / name, data if isinstance(data, str) else json.dumps(data))


def sel_of(fx: Fx, experts: dict, **extra) -> dict:
    return {"method": "manual", "target": "fr", "budget": sum(map(len, experts.values())), "experts": experts,
            **extra}


def recipe(t: Path, fx: Fx, name: str = "recipe.yaml", **changes) -> Path:
    """A copy of the tiny training recipe, dotted fields changed (DELETE removes one)."""
    data = yaml.safe_load(fx.recipe.read_text())
    for k, v in changes.items():
        dig(data, k, v)
    return write(t / name, yaml.safe_dump(data))


def edit_yaml(path: Path, dotted: str, value) -> Path:
    data = yaml.safe_load(path.read_text())
    dig(data, dotted, value)
    return write(path, yaml.safe_dump(data))


def up_recipe(t: Path, fx: Fx, model, out, name: str = "up.yaml", **extra) -> Path:
    return write(t / name, yaml.safe_dump({"model": str(model), "out": str(out),
                                           "spec": {"num_experts": 4, "top_k": 2, "every": 2}, **extra}))


def collect(model, out, *texts, extra=()) -> list:
    return ["routes", "collect", "--model", model, "--texts", *texts, "--out", out, *extra]


def texts(*pairs) -> list[str]:
    return [f"{lang}={path}" for lang, path in pairs]


def run_dir(t: Path, fx: Fx, name: str = "run", model: bool = True) -> Path:
    """A finished-looking run directory: recipe.yaml (tiny recipe, out = itself) and model/."""
    r = t / name
    recipe(r, fx, **{"out": str(r)})
    if model:
        moe(r, fx, "model")
    return r


def corpus(langs: str, out, *extra) -> list:
    return ["speech", "corpus", "--langs", langs, "--out", out, "--voices", 1, "--test-voices", 1,
            "--train-per-lang", 1, "--test-per-lang", 1, *extra]


# ---------------------------------------------------------------------------------------------- the table

OVERWRITE = r"pass --overwrite to replace it"
IS_INPUT = r"is input .*choose another"
CONTAINS_INPUT = r"contains input .*choose another"
IS_CWD = r"is the working directory; choose another"
CONTAINS_CWD = r"contains the working directory; choose another"
SYMLINK = r"is a symbolic link; give the path it points to"
NOT_DIR = r"cannot create .*is not a directory"
REMOTE = r"needs its own Python code \(config.json has an auto_map\); pass --trust-remote-code"
REMOTE_TOK = r"needs its own Python code \(tokenizer_config.json has an auto_map\); pass --trust-remote-code"
AUTO_MAP = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
UNREADABLE_ST = r"model.safetensors is not a readable safetensors file"


def auto_map(folder: Path, file: str = "config.json") -> None:
    edit_json(folder / file, lambda c: c.update(auto_map=AUTO_MAP))


GUARDS = [
    # upcycle
    Case("upcycle-out-is-model", lambda t, f: upc(dense(t, f), t / "dense", "--overwrite"), IS_INPUT),
    Case("upcycle-out-is-parent-of-model", lambda t, f: upc(dense(t, f, "proj/dense"), t / "proj", "--overwrite"),
         CONTAINS_INPUT),
    Case("upcycle-out-dot-is-cwd", lambda t, f: upc(dense(t, f), ".", "--overwrite"), IS_CWD, cwd="work"),
    Case("upcycle-out-is-ancestor-of-cwd", lambda t, f: upc(dense(t, f), t / "a", "--overwrite"), CONTAINS_CWD,
         cwd="a/b/c"),
    Case("upcycle-out-is-model-via-dotdot", lambda t, f: upc(dense(t, f), t / "x" / ".." / "dense", "--overwrite"),
         IS_INPUT),
    Case("upcycle-out-is-model-via-symlinked-parent",
         lambda t, f: upc(dense(t, f, "real/dense"), symlink(t / "alias", t / "real") / "dense", "--overwrite"),
         IS_INPUT),
    Case("upcycle-recipe-inside-out",
         lambda t, f: (["upcycle", up_recipe(t / "proj", f, dense(t, f), t / "proj"), "--overwrite"], t / "proj"),
         CONTAINS_INPUT),
    Case("upcycle-recipe-out-is-model",
         lambda t, f: (["upcycle", up_recipe(t, f, dense(t, f), t / "dense"), "--overwrite"], t / "dense"), IS_INPUT),
    Case("upcycle-out-symlink", lambda t, f: upc(dense(t, f), symlink(t / "link", existing_dir(t / "real")),
                                                 "--overwrite"), SYMLINK),
    Case("upcycle-out-dangling-symlink", lambda t, f: upc(dense(t, f), symlink(t / "link", t / "nowhere")),
         SYMLINK),
    Case("upcycle-out-exists", lambda t, f: upc(dense(t, f), existing_dir(t / "moe")),
         rf"moe exists and is not empty; {OVERWRITE}"),
    Case("upcycle-out-is-a-file", lambda t, f: upc(dense(t, f), write(t / "moe", "a file")),
         rf"moe exists; {OVERWRITE}"),
    Case("upcycle-out-parent-is-a-file", lambda t, f: upc(dense(t, f), write(t / "afile", "x") / "moe"), NOT_DIR),
    # export
    Case("export-out-is-input", lambda t, f: ["export", moe(t, f), "--format", "mixtral", "--out", t / "moe",
                                              "--overwrite"], IS_INPUT),
    Case("export-out-contains-input", lambda t, f: ["export", moe(t, f, "p/moe"), "--format", "mixtral",
                                                    "--out", t / "p", "--overwrite"], CONTAINS_INPUT),
    Case("export-out-exists", lambda t, f: ["export", moe(t, f), "--format", "mixtral",
                                            "--out", existing_dir(t / "hf")], OVERWRITE),
    Case("export-out-symlink", lambda t, f: ["export", moe(t, f), "--format", "mixtral",
                                             "--out", symlink(t / "hf", existing_dir(t / "real")), "--overwrite"],
         SYMLINK),
    Case("export-out-dot", lambda t, f: ["export", moe(t, f), "--format", "mixtral", "--out", ".", "--overwrite"],
         IS_CWD, cwd="work"),
    # routes collect
    Case("collect-out-is-texts-file", lambda t, f: collect(moe(t, f), t / "en.txt",
                                                           *texts(("en", text(t, f))), extra=["--overwrite"]),
         r"the trace .*en.txt is input .*en.txt; choose another trace path"),
    Case("collect-out-is-model", lambda t, f: collect(moe(t, f), t / "moe", *texts(("en", text(t, f))),
                                                      extra=["--overwrite"]), IS_INPUT),
    Case("collect-out-contains-texts", lambda t, f: collect(moe(t, f), t / "data",
                                                            *texts(("en", text(t, f, name="data/en.txt"))),
                                                            extra=["--overwrite"]), CONTAINS_INPUT),
    Case("collect-out-exists", lambda t, f: collect(moe(t, f), write(t / "t.npz", b"old trace"),
                                                    *texts(("en", text(t, f)))), rf"t.npz exists; {OVERWRITE}"),
    Case("collect-out-symlink", lambda t, f: collect(moe(t, f), symlink(t / "t.npz", write(t / "real.npz", b"x")),
                                                     *texts(("en", text(t, f))), extra=["--overwrite"]),
         r"the trace .*t.npz is a symbolic link"),
    # routes report
    Case("report-out-contains-trace", lambda t, f: ["routes", "report", f.copy(f.trace, t / "rep" / "t.npz"),
                                                    "--out", t / "rep", "--overwrite"], CONTAINS_INPUT),
    Case("report-out-contains-selection", lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"),
                                                        "--selection", f.copy(f.sel, t / "rep" / "sel.json"),
                                                        "--out", t / "rep", "--overwrite"], CONTAINS_INPUT),
    Case("report-out-exists", lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"),
                                            "--out", existing_dir(t / "rep")], OVERWRITE),
    # select
    Case("select-out-is-trace", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                              "--budget", 2, "--out", t / "t.npz", "--overwrite"],
         r"the selection .*t.npz is input"),
    Case("select-out-exists", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                            "--budget", 2, "--out", write(t / "s.json", "{}")],
         rf"s.json exists; {OVERWRITE}"),
    Case("select-out-symlink", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                             "--budget", 2, "--out", symlink(t / "s.json", t / "elsewhere.json")],
         r"the selection .*s.json is a symbolic link"),
    Case("select-out-is-a-directory", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"),
                                                    "--target", "en", "--budget", 2, "--out",
                                                    existing_dir(t / "sel")], OVERWRITE),
    # finetune / prune
    Case("finetune-out-contains-selection",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "ft" / "sel.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--overwrite"], CONTAINS_INPUT),
    Case("finetune-out-contains-data",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "sel.json"),
                       "--data", f"en={text(t, f, name='ft/en.txt')}", "--out", t / "ft", "--overwrite"],
         CONTAINS_INPUT),
    Case("finetune-out-is-model",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "sel.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "moe", "--overwrite"], IS_INPUT),
    Case("finetune-out-exists",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "sel.json"),
                       "--data", f"en={text(t, f)}", "--out", existing_dir(t / "ft")], OVERWRITE),
    Case("finetune-batch-not-a-multiple-of-grad-accum",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "sel.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--batch-size", 3, "--grad-accum", 2],
         "not a multiple of --grad-accum"),
    Case("finetune-zero-epochs",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "sel.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--epochs", 0], "must be positive"),
    Case("prune-out-contains-selection",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "p" / "sel.json"),
                       "--out", t / "p", "--overwrite"], CONTAINS_INPUT),
    Case("prune-out-is-model", lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                                             "--out", t / "moe", "--overwrite"], IS_INPUT),
    Case("prune-out-contains-model", lambda t, f: ["prune", "--model", moe(t, f, "p/moe"),
                                                   "--experts", f.copy(f.sel, t / "s.json"), "--out", t / "p",
                                                   "--overwrite"], CONTAINS_INPUT),
    Case("prune-out-exists", lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                                           "--out", existing_dir(t / "p")], OVERWRITE),
    Case("prune-out-dot", lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                                        "--out", ".", "--overwrite"], IS_CWD, cwd="work"),
    # train
    Case("train-out-is-base-model",
         lambda t, f: ["train", recipe(t, f), f"model.path={dense(t, f)}", f"out={t / 'dense'}", "--overwrite"],
         r"the run directory .*dense is input"),
    Case("train-out-dot", lambda t, f: ["train", recipe(t, f), "out=.", "--overwrite"],
         r"the run directory \. is the working directory", cwd="work"),
    Case("train-out-is-ancestor-of-cwd", lambda t, f: ["train", recipe(t, f), f"out={t / 'a'}", "--overwrite"],
         CONTAINS_CWD, cwd="a/b"),
    Case("train-out-contains-data",
         lambda t, f: ["train", recipe(t, f), f"data.train_files=[{f.copy(f.train_jsonl, t / 'run' / 'tr.jsonl')}]",
                       f"out={t / 'run'}", "--overwrite"], CONTAINS_INPUT),
    Case("train-out-contains-recipe", lambda t, f: ["train", recipe(t / "run", f), f"out={t / 'run'}", "--overwrite"],
         CONTAINS_INPUT),
    Case("train-out-exists", lambda t, f: ["train", recipe(t, f), f"out={existing_dir(t / 'run')}"], OVERWRITE),
    Case("train-interrupted-run-left", lambda t, f: also(["train", recipe(t, f), f"out={t / 'run'}"],
                                                         existing_dir(t / ".run.moekit-partial")),
         r"holds an interrupted run of .*run \(--resume continues it\)"),
    Case("train-out-symlink", lambda t, f: ["train", recipe(t, f), f"out={symlink(t / 'run', t / 'real')}"],
         SYMLINK),
    # speech corpus
    Case("corpus-out-contains-texts", lambda t, f: corpus("en", t / "c", "--texts", f"en={text(t, f, name='c/en.txt')}",
                                                          "--overwrite"), CONTAINS_INPUT),
    Case("corpus-out-exists", lambda t, f: corpus("en", existing_dir(t / "c"), "--texts", f"en={text(t, f)}"),
         OVERWRITE),
    Case("corpus-out-dot", lambda t, f: corpus("en", ".", "--texts", f"en={text(t, f)}", "--overwrite"), IS_CWD,
         cwd="work"),
    # simoe
    Case("simoe-export-out-is-run", lambda t, f: ["simoe", "export", run_dir(t, f), "--out", t / "run", "--overwrite"],
         IS_INPUT),
    Case("simoe-report-out-contains-run", lambda t, f: ["simoe", "report", run_dir(t, f, "p/run"), "--out", t / "p",
                                                        "--overwrite"], CONTAINS_INPUT),
    Case("simoe-export-out-exists", lambda t, f: ["simoe", "export", run_dir(t, f), "--out", existing_dir(t / "x")],
         OVERWRITE),
    # demo (recipes validated, then the output checked: nothing fetched)
    Case("demo-out-exists", lambda t, f: ["demo", "--out", existing_dir(t / "demo")], OVERWRITE),
    Case("demo-out-dot", lambda t, f: ["demo", "--out", ".", "--overwrite"], IS_CWD, cwd="work"),
]

REMOTE_CODE = [
    Case("upcycle-config-auto-map", lambda t, f: upc(dense_with(t, f, auto_map), t / "moe"), REMOTE),
    Case("upcycle-tokenizer-auto-map",
         lambda t, f: upc(dense_with(t, f, lambda d: auto_map(d, "tokenizer_config.json")), t / "moe"), REMOTE_TOK),
    Case("upcycle-preprocessor-auto-map",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "preprocessor_config.json",
                                                           json.dumps({"auto_map": AUTO_MAP}))), t / "moe"),
         r"preprocessor_config.json has an auto_map\); pass --trust-remote-code"),
    Case("inspect-config-auto-map", lambda t, f: ["inspect", moe_with(t, f, auto_map)], REMOTE),
    Case("export-config-auto-map", lambda t, f: ["export", moe_with(t, f, auto_map), "--format", "mixtral",
                                                 "--out", t / "hf"], REMOTE),
    Case("collect-config-auto-map", lambda t, f: collect(moe_with(t, f, auto_map), t / "t.npz",
                                                         *texts(("en", text(t, f)))), REMOTE),
    Case("collect-tokenizer-auto-map",
         lambda t, f: collect(moe_with(t, f, lambda d: auto_map(d, "tokenizer_config.json")), t / "t.npz",
                              *texts(("en", text(t, f)))), REMOTE_TOK),
    Case("prune-config-auto-map", lambda t, f: ["prune", "--model", moe_with(t, f, auto_map),
                                                "--experts", f.copy(f.sel, t / "s.json"), "--out", t / "p"], REMOTE),
    Case("finetune-tokenizer-auto-map",
         lambda t, f: ["finetune", "--model", moe_with(t, f, lambda d: auto_map(d, "tokenizer_config.json")),
                       "--experts", f.copy(f.sel, t / "s.json"), "--data", f"en={text(t, f)}", "--out", t / "ft"],
         REMOTE_TOK),
    Case("train-base-config-auto-map",
         lambda t, f: ["train", recipe(t, f), f"model.path={dense_with(t, f, auto_map)}", f"out={t / 'run'}"],
         REMOTE),
]

CHECKPOINT_FILES = [
    # dense model (upcycle): shard names and files from model.safetensors.index.json
    Case("dense-index-shard-dotdot",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, "../outside/x.safetensors")), t / "moe"),
         r"shard name '\.\./outside/x\.safetensors' is not a plain file name; the index must name files inside the "
         r"checkpoint directory"),
    Case("dense-index-shard-absolute",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, str(d / "model.safetensors"))), t / "moe"),
         r"shard name '/.*model\.safetensors' is an absolute path"),
    Case("dense-index-shard-dev-zero", lambda t, f: upc(dense_with(t, f, lambda d: index(d, "/dev/zero")), t / "moe"),
         r"shard name '/dev/zero' is an absolute path"),
    Case("dense-index-shard-dot", lambda t, f: upc(dense_with(t, f, lambda d: index(d, "..")), t / "moe"),
         r"shard name '\.\.' is not a plain file name"),
    Case("dense-index-shard-not-a-string", lambda t, f: upc(dense_with(t, f, lambda d: index(d, 7)), t / "moe"),
         r"shard name 7 is not a plain file name"),
    Case("dense-index-shard-symlink-outside",
         lambda t, f: upc(dense_with(t, f, lambda d: (
             f.copy(d / "model.safetensors", t / "outside" / "x.safetensors"),
             symlink(d / "x.safetensors", t / "outside" / "x.safetensors"), index(d, "x.safetensors"))), t / "moe"),
         r"x\.safetensors leads outside the checkpoint directory"),
    Case("dense-weights-symlink-dev-zero",
         lambda t, f: upc(dense_with(t, f, lambda d: ((d / "model.safetensors").unlink(),
                                                       symlink(d / "model.safetensors", "/dev/zero"))), t / "moe"),
         r"model\.safetensors leads outside the checkpoint directory"),
    Case("dense-index-shard-fifo",
         lambda t, f: upc(dense_with(t, f, lambda d: (index(d, "pipe.safetensors"), fifo(d / "pipe.safetensors"))),
                          t / "moe"), r"pipe\.safetensors is not a regular file"),
    Case("dense-index-shard-directory",
         lambda t, f: upc(dense_with(t, f, lambda d: (index(d, "sub.safetensors"),
                                                       (d / "sub.safetensors").mkdir())), t / "moe"),
         r"sub\.safetensors is not a regular file"),
    Case("dense-index-shard-missing",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, "model-00002-of-00002.safetensors")), t / "moe"),
         r"weight file model-00002-of-00002\.safetensors is missing"),
    Case("dense-index-not-json",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors.index.json", "{not json")),
                          t / "moe"), r"model\.safetensors\.index\.json is not valid JSON"),
    Case("dense-index-deeply-nested",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors.index.json", "[" * 200_000)),
                          t / "moe"), r"model\.safetensors\.index\.json is not valid JSON"),
    Case("dense-index-no-weight-map",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors.index.json",
                                                           json.dumps({"metadata": {}}))), t / "moe"),
         r"model\.safetensors\.index\.json has no weight_map"),
    Case("dense-index-is-a-list",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors.index.json", "[1, 2]")), t / "moe"),
         r"model\.safetensors\.index\.json has no weight_map"),
    Case("dense-index-symlink-dev-zero",
         lambda t, f: upc(dense_with(t, f, lambda d: symlink(d / "model.safetensors.index.json", "/dev/zero")),
                          t / "moe"), r"model\.safetensors\.index\.json leads outside the checkpoint directory"),
    Case("dense-index-lists-absent-tensor",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, "model.safetensors",
                                                           {"ghost.weight": "model.safetensors"})),
                          t / "moe"), r"lists tensors its shards do not hold: \['ghost\.weight'\]"),
    Case("dense-weights-truncated", lambda t, f: upc(dense_with(t, f, lambda d: truncate(d / "model.safetensors")),
                                                     t / "moe"), UNREADABLE_ST),
    Case("dense-weights-empty", lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors", b"")),
                                                 t / "moe"), UNREADABLE_ST),
    Case("dense-weights-huge-header",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "model.safetensors",
                                                           struct.pack("<Q", 1 << 60) + b"{}")), t / "moe"),
         UNREADABLE_ST),
    Case("dense-config-not-json", lambda t, f: upc(dense_with(t, f, lambda d: write(d / "config.json", "{oops")),
                                                   t / "moe"), r"config\.json does not load"),
    Case("dense-no-config", lambda t, f: upc(dense_with(t, f, lambda d: (d / "config.json").unlink()), t / "moe"),
         r"is not a Hugging Face model directory \(no config\.json\)"),
    Case("dense-pickle-only",
         lambda t, f: upc(dense_with(t, f, lambda d: ((d / "model.safetensors").unlink(),
                                                       write(d / "pytorch_model.bin", b"\x80\x04evil"))), t / "moe"),
         r"has no safetensors weights \(found pytorch_model\.bin\); pickle .*--allow-pickle"),
    Case("dense-config-unknown-architecture",
         lambda t, f: upc(dense_with(t, f, lambda d: edit_json(d / "config.json",
                                                               lambda c: c.update(architectures=["EvilForCausalLM"]))),
                          t / "moe"), r"model class 'EvilForCausalLM' is not a transformers or moekit model class"),
    Case("dense-config-disagrees-with-weights",
         lambda t, f: upc(dense_with(t, f, lambda d: edit_json(d / "config.json", lambda c: c.update(
             vocab_size=100_000_000, hidden_size=65536, num_attention_heads=512, num_key_value_heads=8,
             head_dim=128))), t / "moe"), r"model\.embed_tokens\.weight is \[128, 32\] in the weights but "
                                          r"\[100000000, 65536\] by its config\.json"),
    Case("dense-result-does-not-fit-disk",
         lambda t, f: ["upcycle", "--model", dense(t, f), "--experts", 10**9, "--top-k", 2, "--out", t / "moe"],
         r"not enough disk space for .*moe: it needs about"),
    # moekit checkpoint: weight files (inspect, export, routes collect, prune)
    Case("moe-weights-truncated-inspect",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: truncate(d / "model.safetensors"))],
         UNREADABLE_ST),
    Case("moe-weights-truncated-export",
         lambda t, f: ["export", moe_with(t, f, lambda d: truncate(d / "model.safetensors", 0.9)), "--format",
                       "mixtral", "--out", t / "hf"], UNREADABLE_ST),
    Case("moe-weights-truncated-collect",
         lambda t, f: collect(moe_with(t, f, lambda d: truncate(d / "model.safetensors", 0.1)), t / "t.npz",
                              *texts(("en", text(t, f)))), UNREADABLE_ST),
    Case("moe-index-shard-dotdot-prune",
         lambda t, f: ["prune", "--model", moe_with(t, f, lambda d: index(d, "../moe2/model.safetensors")),
                       "--experts", f.copy(f.sel, t / "s.json"), "--out", t / "p"], r"is not a plain file name"),
    Case("moe-weights-symlink-outside",
         lambda t, f: ["inspect", moe_with(t, f, link_out(t, "model.safetensors", "w.safetensors"))],
         r"model\.safetensors leads outside the checkpoint directory"),
    Case("moe-weights-missing", lambda t, f: ["inspect", moe_with(t, f, lambda d: (d / "model.safetensors").unlink())],
         r"no safetensors weights in .*moe"),
    Case("moe-config-not-json", lambda t, f: ["inspect", moe_with(t, f, lambda d: write(d / "config.json", "{oops"))],
         r"config\.json does not load"),
    Case("moe-pruned-experts-not-json",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: write(d / "pruned_experts.json", "{oops"))],
         r"pruned_experts\.json: not a moekit expert selection \(not JSON"),
    # moekit.json
    Case("meta-not-json", lambda t, f: ["inspect", moe_with(t, f, lambda d: write(d / "moekit.json", "{oops"))],
         r"moekit\.json is not valid JSON"),
    Case("meta-deeply-nested",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: write(d / "moekit.json", "[" * 200_000))],
         r"moekit\.json is not valid JSON"),
    Case("meta-is-a-list", lambda t, f: ["inspect", moe_with(t, f, lambda d: write(d / "moekit.json", "[]"))],
         r"unsupported moekit checkpoint format None \(expected moekit/2 or moekit/1\)"),
    Case("meta-symlink-dev-zero",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: ((d / "moekit.json").unlink(),
                                                            symlink(d / "moekit.json", "/dev/zero")))],
         r"moekit\.json leads outside the checkpoint directory"),
    Case("meta-too-large",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: os.truncate(d / "moekit.json", 65 << 20))],
         r"moekit\.json is 65 MiB; more than 64 MiB is refused"),
    Case("meta-missing", lambda t, f: ["inspect", moe_with(t, f, lambda d: (d / "moekit.json").unlink())],
         r"is not a moekit checkpoint \(no moekit\.json\)"),
    Case("meta-missing-layers", lambda t, f: ["inspect", meta_set(t, f, "layers", DELETE)],
         r"moekit\.json is invalid: layers: Field required"),
    Case("meta-wrong-format", lambda t, f: ["export", meta_set(t, f, "format", "moekit/9"), "--format", "mixtral",
                                            "--out", t / "hf"], r"unsupported moekit checkpoint format 'moekit/9'"),
    Case("meta-extra-key", lambda t, f: ["inspect", meta_set(t, f, "layers.0.evil", 1)],
         r"moekit\.json is invalid: layers\.0\.evil: Extra inputs are not permitted"),
    Case("meta-million-experts", lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.num_experts", 1_000_000)],
         r"the metadata says", seconds=5),
    Case("meta-million-experts-collect",
         lambda t, f: collect(meta_set(t, f, "layers.1.layout.num_experts", 1_000_000), t / "t.npz",
                              *texts(("en", text(t, f)))), r"the metadata says", seconds=5),
    Case("meta-huge-intermediate",
         lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.intermediate_size", 1 << 40)],
         r"the metadata says"),
    Case("meta-negative-index", lambda t, f: ["inspect", meta_set(t, f, "layers.0.index", -1)],
         r"layers\.0\.index: Input should be greater than or equal to 0"),
    Case("meta-zero-experts", lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.num_experts", 0)],
         r"layers\.0\.layout\.num_experts: Input should be greater than or equal to 1"),
    Case("meta-unknown-activation", lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.act", "evil_act")],
         r"unknown activation 'evil_act'"),
    Case("meta-top-k-above-experts", lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.top_k", 9)],
         r"top_k 9 > num_experts 4"),
    Case("meta-unknown-dtype", lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.dtype", "int8")],
         r"layers\.0\.layout\.dtype"),
    Case("meta-unknown-architecture", lambda t, f: ["inspect", meta_set(t, f, "architecture", "EvilForCausalLM")],
         r"model class 'EvilForCausalLM' is not a transformers or moekit model class"),
    Case("meta-architecture-auto-class",
         lambda t, f: ["inspect", meta_set(t, f, "architecture", "AutoModelForCausalLM")],
         r"model class 'AutoModelForCausalLM' is not a transformers or moekit model class"),
    Case("meta-layer-does-not-exist", lambda t, f: ["inspect", meta_set(t, f, "layers.1.index", 99)],
         r"layer model\.layers\.3\.mlp does not exist in the model"),
    Case("meta-stack-does-not-exist", lambda t, f: ["inspect", meta_set(t, f, "layers.0.stack", "model.nowhere")],
         r"layer model\.layers\.1\.mlp does not exist in the model"),
    Case("meta-layer-listed-twice",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: edit_json(d / "moekit.json",
                                                                     lambda m: m["layers"].append(m["layers"][0])))],
         r"layer model\.layers\.1\.mlp is listed twice"),
    Case("meta-router-of-unknown", lambda t, f: ["inspect", meta_set(t, f, "layers.1.router_of", "model.layers.9.mlp")],
         r"router_of 'model\.layers\.9\.mlp' is not an earlier layer"),
    Case("meta-shape-disagrees-with-headers",
         lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.intermediate_size", 65)], r"the metadata says"),
    Case("meta-dtype-disagrees-with-headers",
         lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.dtype", "float16")],
         r"is F32\[.*\], the metadata says float16"),
    Case("meta-alias-to-missing-tensor", lambda t, f: ["inspect", meta_set(t, f, "aliases", {"x.weight": "ghost"})],
         r"tensor aliases point at tensors the model does not have"),
    Case("meta-invalid-spec", lambda t, f: ["inspect", meta_set(t, f, "spec.num_experts", 0)],
         r"invalid MoE spec in .*moekit\.json: num_experts"),
    Case("meta-extra-tensor-in-weights",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: _add_tensor(d, "ghost.weight"))],
         r"weights do not match its metadata .*unexpected \['ghost\.weight'\]"),
]


def _add_tensor(folder: Path, name: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors[name] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


TRACE = r"not a moekit routing trace"
TRACES = [
    Case("trace-id-at-num-experts", lambda t, f: ["select", "topk", trace_with(t, f, ids=set_item((0, 0, 0), 4)),
                                                  "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"expert ids of layer model\.layers\.1\.mlp outside \[0, 4\)"),
    Case("trace-id-below-minus-one", lambda t, f: ["routes", "report", trace_with(t, f, ids=set_item((1, 0, 1), -2)),
                                                   "--out", t / "rep"],
         r"expert ids of layer model\.layers\.3\.mlp outside \[0, 4\)"),
    Case("trace-shapes-disagree", lambda t, f: ["select", "rise", trace_with(t, f, token=lambda a: a[:-1]),
                                                "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"ids has shape \(2, \d+, 2\) \(int16\), expected \(2, \d+, 2\) \(integer\) for 2 layers"),
    Case("trace-weights-not-float",
         lambda t, f: ["select", "esft", trace_with(t, f, weights=lambda a: a.astype(np.int32)),
                                                  "--target", "en", "--out", t / "s.json"],
         r"weights has shape .*\(int32\), expected .*\(float\)"),
    Case("trace-not-a-zip", lambda t, f: ["select", "topk", write(t / "t.npz", "just text"), "--target", "en",
                                          "--budget", 2, "--out", t / "s.json"], rf"{TRACE} \(BadZipFile"),
    Case("trace-truncated",
         lambda t, f: ["routes", "report", also(f.copy(f.trace, t / "t.npz"), truncate(t / "t.npz", 0.6)),
                                          "--out", t / "rep"], TRACE),
    Case("trace-missing", lambda t, f: ["select", "topk", t / "none.npz", "--target", "en", "--budget", 2,
                                        "--out", t / "s.json"], r"trace .*none\.npz does not exist"),
    Case("trace-is-a-directory", lambda t, f: ["routes", "report", existing_dir(t / "t.npz"), "--out", t / "rep"],
         r"trace .*t\.npz is not a regular file"),
    Case("trace-missing-field", lambda t, f: ["select", "topk", trace_with(t, f, lang=None), "--target", "en",
                                              "--budget", 2, "--out", t / "s.json"], rf"{TRACE} \(missing lang\)"),
    Case("trace-meta-deeply-nested",
         lambda t, f: ["select", "topk", trace_with(t, f, meta=np.array("[" * 100_000)), "--target", "en",
                       "--budget", 2, "--out", t / "s.json"], r"trace metadata is nested too deeply"),
    Case("trace-meta-python-code",
         lambda t, f: ["routes", "report", trace_with(t, f, meta=np.array("__import__('os').system('touch pwned')")),
                       "--out", t / "rep"], r"unreadable trace metadata \(ValueError\)"),
    Case("trace-meta-not-a-mapping", lambda t, f: ["select", "topk", trace_with(t, f, meta=np.array("[1, 2]")),
                                                   "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"trace metadata must be a mapping"),
    Case("trace-object-array",
         lambda t, f: ["select", "topk", trace_with(t, f, meta=np.array([{"a": 1}], dtype=object)),
                                             "--target", "en", "--budget", 2, "--out", t / "s.json"],
         rf"{TRACE} \(ValueError: Object arrays cannot be loaded"),
    Case("trace-weights-nan", lambda t, f: ["routes", "report", trace_with(t, f, weights=set_item((0, 0, 0), np.nan)),
                                            "--out", t / "rep"], r"routing weights are not finite"),
    Case("trace-lang-out-of-range", lambda t, f: ["select", "topk", trace_with(t, f, lang=set_item(0, 5)),
                                                  "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"language indices outside the 2 languages"),
    Case("trace-zero-experts", lambda t, f: ["select", "topk", trace_with(t, f, num_experts=set_item(0, 0)),
                                             "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"layers must be distinct and have at least one expert each"),
    Case("trace-duplicate-layers",
         lambda t, f: ["routes", "report", trace_with(t, f, layers=np.array(["model.layers.1.mlp"] * 2)),
                       "--out", t / "rep"], r"layers must be distinct"),
    Case("trace-zip-bomb", lambda t, f: ["select", "topk", zip_bomb(t, f), "--target", "en", "--budget", 2,
                                         "--out", t / "s.json"], r"its arrays would take .* GiB \(more than 64 GiB\)"),
    # select: the request does not fit the trace
    Case("select-unknown-target", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "sw",
                                                "--budget", 2, "--out", t / "s.json"],
         r"target language 'sw' is not in the trace \(it has: en, fr\)"),
    Case("select-budget-above-experts", lambda t, f: ["select", "random", f.copy(f.trace, t / "t.npz"), "--target",
                                                      "en", "--budget", 9, "--out", t / "s.json"],
         r"budget must be a whole number between 1 and the 8 experts .*got 9"),
    Case("select-budget-zero", lambda t, f: ["select", "rise", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                             "--budget", 0, "--out", t / "s.json"], r"budget must be .*got 0"),
    Case("select-no-budget", lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                           "--out", t / "s.json"], r"the following arguments are required: --budget"),
    Case("select-setting-of-another-method",
         lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en", "--budget", 2,
                       "--alpha", 3, "--out", t / "s.json"], r"select topk: unrecognized arguments: --alpha 3"),
    Case("select-bad-top-p", lambda t, f: ["select", "esft", f.copy(f.trace, t / "t.npz"), "--target", "en",
                                           "--top-p", 7, "--out", t / "s.json"], r"invalid esft settings: top_p"),
    # routes report: the request does not fit the trace
    Case("report-unknown-reference", lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--reference",
                                                   "sw", "--out", t / "rep"],
         r"language 'sw' not in trace \(has en, fr\)"),
    Case("report-selection-not-json", lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--selection",
                                                    selection(t, "{oops"), "--out", t / "rep"],
         r"sel\.json: not a moekit expert selection \(not JSON"),
    Case("report-selection-unknown-layer",
         lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--selection",
                       selection(t, sel_of(f, {"model.layers.7.mlp": [0]})), "--out", t / "rep"],
         r"selection layer 'model\.layers\.7\.mlp' is not an MoE layer of the trace"),
]

SELECTIONS = [
    Case("prune-selection-not-json", lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, "{oops"),
                                                   "--out", t / "p"], r"not a moekit expert selection \(not JSON"),
    Case("prune-selection-missing", lambda t, f: ["prune", "--model", moe(t, f), "--experts", t / "none.json",
                                                  "--out", t / "p"], r"selection .*none\.json does not exist"),
    Case("prune-selection-ids-out-of-range",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {f.layers[0]: [1, 4]})),
                       "--out", t / "p"],
         r"model\.layers\.1\.mlp: expert ids must be distinct and in \[0, 4\), got \[1, 4\]"),
    Case("prune-selection-negative-id",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {f.layers[1]: [-1]})),
                       "--out", t / "p"], r"model\.layers\.3\.mlp: expert ids must be ≥ 0, got -1"),
    Case("prune-selection-unknown-layer",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {"model.layers.0.mlp": [0]})),
                       "--out", t / "p"],
         r"the selection names layers the model does not have: \['model\.layers\.0\.mlp'\]"),
    Case("prune-selection-all-experts",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {f.layers[0]: [0, 1, 2, 3]})),
                       "--out", t / "p"],
         r"model\.layers\.1\.mlp: disabling 4 of 4 experts leaves fewer than top_k=2"),
    Case("prune-selection-no-experts-key",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, {"method": "x", "budget": 1}),
                       "--out", t / "p"], r"invalid expert selection .*experts: Field required"),
    Case("prune-selection-is-a-list", lambda t, f: ["prune", "--model", moe(t, f), "--experts", selection(t, "[1]"),
                                                    "--out", t / "p"], r"invalid expert selection .*<root>"),
    Case("prune-selection-dev-zero", lambda t, f: ["prune", "--model", moe(t, f), "--experts",
                                                   symlink(t / "s.json", "/dev/zero"), "--out", t / "p"],
         r"selection .*s\.json is not a regular file"),
    Case("prune-dense-model", lambda t, f: ["prune", "--model", dense(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                                            "--out", t / "p"], r"LlamaForCausalLM has no MoE layer moekit can read"),
    Case("finetune-selection-duplicate-ids",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {f.layers[0]: [2, 2]})),
                       "--data", f"en={text(t, f)}", "--steps", 1, "--out", t / "ft"],
         r"model\.layers\.1\.mlp: expert 2 is named twice"),
    Case("finetune-selection-unknown-layer",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {"lm_head": [0]})),
                       "--data", f"en={text(t, f)}", "--steps", 1, "--out", t / "ft"],
         r"the selection names layers the model does not have: \['lm_head'\]"),
    Case("finetune-selection-empty",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", selection(t, sel_of(f, {})),
                       "--data", f"en={text(t, f)}", "--steps", 1, "--out", t / "ft"], r"the selection is empty"),
    Case("finetune-data-missing",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={t / 'none.txt'}", "--out", t / "ft"],
         r"data file for en .*none\.txt does not exist"),
    Case("finetune-data-empty",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={write(t / 'e.txt', chr(10) * 3)}", "--steps", 1, "--out", t / "ft"],
         r"no training text"),
    Case("finetune-data-repeated-language",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", f"en={text(t, f, 'fr')}", "--out", t / "ft"],
         r"--data gives language 'en' twice"),
    Case("finetune-max-length-zero",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--max-length", 0, "--out", t / "ft"],
         r"--max-length must be positive"),
    Case("finetune-no-tokenizer",
         lambda t, f: ["finetune", "--model", moe_with(t, f, lambda d: [p.unlink() for p in d.glob("tokenizer*")]),
                       "--experts", f.copy(f.sel, t / "s.json"), "--data", f"en={text(t, f)}", "--out", t / "ft"],
         r"has no tokenizer files; finetune needs one"),
]

NUMBERS_AND_WRONG_INPUT = [
    # numbers
    Case("upcycle-nan-in-dense-weight",
         lambda t, f: upc(dense_with(t, f, lambda d: tensor_edit(d, "model.layers.2.mlp.up_proj.weight",
                                                                 lambda x: x.__setitem__((0, 0), float("nan")))),
                          t / "moe"),
         r"model\.layers\.2\.mlp\.up_proj\.weight has 1 non-finite value \(NaN or Inf\); pass --allow-nonfinite"),
    Case("upcycle-inf-in-embedding",
         lambda t, f: upc(dense_with(t, f, lambda d: tensor_edit(d, "model.embed_tokens.weight",
                                                                 lambda x: x[:2].fill_(float("inf")))), t / "moe"),
         r"model\.embed_tokens\.weight has 64 non-finite values .*--allow-nonfinite"),
    # upcycle: wrong model, spec or recipe
    Case("upcycle-moekit-checkpoint-as-model", lambda t, f: upc(moe(t, f), t / "moe2"),
         r"is a moekit MoE checkpoint, not a dense model; see `moekit inspect / moekit export`"),
    Case("upcycle-model-missing", lambda t, f: upc(t / "nowhere", t / "moe"),
         r"'.*nowhere' is neither an existing model directory, a built-in model nor a Hugging Face repository id"),
    Case("upcycle-model-is-a-file", lambda t, f: upc(write(t / "model.txt", "x"), t / "moe"),
         r"model\.txt is not a directory"),
    Case("upcycle-layers-beyond-model", lambda t, f: upc(dense(t, f), t / "moe", "--layers", "0,99"),
         r"layers \[99\] do not exist; the model has model\.layers \(4 blocks\)"),
    Case("upcycle-target-matches-nothing", lambda t, f: upc(dense(t, f), t / "moe", "--target", "nothing_here"),
         r"the MoE spec selects no FFN"),
    Case("upcycle-unknown-method", lambda t, f: upc(dense(t, f), t / "moe", "--method", "magic"),
         r"invalid choice: 'magic' \(choose from .*'spri'"),
    Case("upcycle-top-k-above-experts", lambda t, f: ["upcycle", "--model", dense(t, f), "--experts", 2, "--top-k", 3,
                                                      "--out", t / "moe"],
         r"top_k \(3\) cannot exceed num_experts \(2\)"),
    Case("upcycle-zero-experts", lambda t, f: ["upcycle", "--model", dense(t, f), "--experts", 0, "--out", t / "moe"],
         r"spec\.num_experts: Input should be greater than or equal to 1"),
    Case("upcycle-bad-set", lambda t, f: upc(dense(t, f), t / "moe", "--method", "spri", "--set", "init.rho=-1"),
         r"invalid command line: spec\.init\.rho: Input should be greater than or equal to 0"),
    Case("upcycle-set-for-another-method", lambda t, f: upc(dense(t, f), t / "moe", "--set", "init.rho=0.1"),
         r"invalid command line: spec\.init\.rho: Extra inputs are not permitted"),
    Case("upcycle-set-unknown-field", lambda t, f: upc(dense(t, f), t / "moe", "--set", "router.bogus=1"),
         r"invalid command line: spec\.router\.bogus: Extra inputs are not permitted"),
    Case("upcycle-overrides-without-recipe", lambda t, f: upc(dense(t, f), t / "moe", "spec.top_k=1"),
         r"KEY=VALUE overrides need a recipe file"),
    Case("upcycle-no-model", lambda t, f: ["upcycle", "--out", t / "moe"], r"give a recipe file, or --model and --out"),
    Case("upcycle-recipe-missing", lambda t, f: (["upcycle", t / "none.yaml"], t / "moe"),
         r"config file not found: .*none\.yaml"),
    Case("upcycle-recipe-bad-yaml", lambda t, f: (["upcycle", write(t / "r.yaml", "model: [unclosed")], t / "moe"),
         r"r\.yaml is not valid YAML"),
    Case("upcycle-recipe-top-level-list",
         lambda t, f: (["upcycle", write(t / "r.yaml", "- model\n- out\n")], t / "moe"),
         r"r\.yaml must contain a mapping at the top level"),
    Case("upcycle-recipe-unknown-key",
         lambda t, f: (["upcycle", up_recipe(t, f, dense(t, f), t / "moe", bogus=1)], t / "moe"),
         r"invalid .*up\.yaml: bogus: Extra inputs are not permitted"),
    # routes collect
    Case("collect-repeated-language-one-flag",
         lambda t, f: collect(moe(t, f), t / "t.npz", *texts(("en", text(t, f)), ("en", text(t, f, "fr")))),
         r"--texts gives language 'en' twice \(.*en\.txt and .*fr\.txt\); give each once"),
    Case("collect-repeated-language-two-flags",
         lambda t, f: ["routes", "collect", "--model", moe(t, f), "--texts", f"en={text(t, f)}",
                       "--texts", f"en={text(t, f, 'fr')}", "--out", t / "t.npz"],
         r"--texts gives language 'en' twice"),
    Case("collect-texts-missing", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={t / 'none.txt'}"),
         r"text file .*none\.txt does not exist"),
    Case("collect-texts-empty",
         lambda t, f: collect(moe(t, f), t / "t.npz", f"en={write(t / 'e.txt', '  ' + chr(10))}"),
         r"e\.txt has no texts \(one per line\)"),
    Case("collect-texts-not-utf8",
         lambda t, f: collect(moe(t, f), t / "t.npz", f"en={write(t / 'b.txt', b'caf' + bytes([0xE9]))}"),
         r"cannot read text file .*b\.txt: 'utf-8' codec can't decode"),
    Case("collect-max-length-zero", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}",
                                                         extra=["--max-length", 0]), r"--max-length.* must be ≥ 1"),
    Case("collect-batch-size-zero", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}",
                                                         extra=["--batch-size", 0]), r"--batch-size.* must be ≥ 1"),
    Case("collect-no-tokenizer",
         lambda t, f: collect(moe_with(t, f, lambda d: [p.unlink() for p in d.glob("tokenizer*")]), t / "t.npz",
                              f"en={text(t, f)}"), r"has no tokenizer files"),
    Case("collect-layers-regex-matches-nothing",
         lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}", extra=["--layers", "nothing_here"]),
         r"no MoE layer path matches 'nothing_here'"),
    # export / inspect
    Case("export-unknown-format", lambda t, f: ["export", moe(t, f), "--format", "gpt5", "--out", t / "hf"],
         r"invalid choice: 'gpt5' \(choose from 'mixtral', 'qwen2_moe', 'qwen3_moe'\)"),
    Case("export-dense-input", lambda t, f: ["export", dense(t, f), "--format", "mixtral", "--out", t / "hf"],
         r"is not a moekit checkpoint \(no moekit\.json\)"),
    # --layout: the native formats' expert layout (classic | fused); moekit's own format has none
    Case("upcycle-layout-on-moekit-format", lambda t, f: upc(dense(t, f), t / "moe", "--format", "moekit", "--layout",
                                                            "classic"),
         r"--layout classic: the moekit format has no expert layout to choose; --layout applies to --format mixtral"),
    Case("upcycle-layout-without-format", lambda t, f: upc(dense(t, f), t / "moe", "--layout", "fused"),
         r"--layout fused: the moekit format has no expert layout"),
    Case("upcycle-unknown-layout", lambda t, f: upc(dense(t, f), t / "moe", "--format", "mixtral", "--layout", "flat"),
         r"argument --layout: invalid choice: 'flat' \(choose from 'classic', 'fused'\)"),
    Case("export-unknown-layout", lambda t, f: ["export", moe(t, f), "--format", "qwen2_moe", "--layout", "stacked",
                                                "--out", t / "hf"],
         r"argument --layout: invalid choice: 'stacked' \(choose from 'classic', 'fused'\)"),
    Case("inspect-dense-dir", lambda t, f: ["inspect", dense(t, f)], r"is not a moekit checkpoint \(no moekit\.json\)"),
    Case("inspect-missing-dir", lambda t, f: ["inspect", t / "nowhere"], r"nowhere is not a moekit checkpoint"),
    # train / validate
    Case("validate-template-unknown-field",
         lambda t, f: ["validate", recipe(t, f, **{"data.template": "{bogus} {src} {tgt_name}"})],
         r"template uses unknown fields \['bogus'\]"),
    Case("train-template-unknown-field",
         lambda t, f: ["train", recipe(t, f, **{"data.template": "{src} {tgt_name} {bogus}"}), f"out={t / 'run'}"],
         r"template uses unknown fields \['bogus'\]"),
    Case("validate-template-not-format-string",
         lambda t, f: ["validate", recipe(t, f, **{"data.template": "{src} {tgt_name} {"})],
         r"template is not a valid format string"),
    Case("validate-unknown-key", lambda t, f: ["validate", recipe(t, f, **{"train.bogus": 1})],
         r"train\.bogus: Extra inputs are not permitted"),
    Case("train-unknown-key-override", lambda t, f: ["train", recipe(t, f), "optim.lr_typo=1", f"out={t / 'run'}"],
         r"optim\.lr_typo: Extra inputs are not permitted"),
    Case("validate-bad-yaml", lambda t, f: ["validate", write(t / "r.yaml", "name: [oops\n")],
         r"r\.yaml is not valid YAML"),
    Case("train-bad-yaml", lambda t, f: (["train", write(t / "r.yaml", "out: x\n  - : :\n")], t / "x"),
         r"r\.yaml is not valid YAML"),
    Case("validate-top-level-list", lambda t, f: ["validate", write(t / "r.yaml", "- a\n- b\n")],
         r"must contain a mapping at the top level"),
    Case("train-top-level-scalar", lambda t, f: (["train", write(t / "r.yaml", "just a string\n")], t / "x"),
         r"must contain a mapping at the top level"),
    Case("validate-recipe-missing", lambda t, f: ["validate", t / "none.yaml"], r"config file not found"),
    Case("train-unknown-method", lambda t, f: ["train", recipe(t, f, method="magic"), f"out={t / 'run'}"],
         r"method: Value error, unknown method 'magic'; choose one of: dense, lora, moe, simoe"),
    Case("train-top-k-above-experts", lambda t, f: ["train", recipe(t, f), "moe.top_k=9", f"out={t / 'run'}"],
         r"moe: Value error, top_k \(9\) cannot exceed num_experts \(4\)"),
    Case("train-zero-experts", lambda t, f: ["train", recipe(t, f), "moe.num_experts=0", f"out={t / 'run'}"],
         r"moe\.num_experts"),
    Case("train-unknown-direction", lambda t, f: ["train", recipe(t, f), "data.directions=[xx]", f"out={t / 'run'}"],
         r"unknown target languages \['xx'\]"),
    Case("train-override-not-key-value", lambda t, f: ["train", recipe(t, f), "=5", f"out={t / 'run'}"],
         r"override '=5' is not of the form key=value"),
    Case("train-data-file-missing",
         lambda t, f: ["train", recipe(t, f), f"data.train_files=[{t / 'none.jsonl'}]", f"out={t / 'run'}"],
         r"data file not found: .*none\.jsonl"),
    Case("train-base-model-missing", lambda t, f: ["train", recipe(t, f), f"model.path={t / 'nowhere'}",
                                                   f"out={t / 'run'}"],
         r"'.*nowhere' is neither an existing model directory, a built-in model nor a Hugging Face repository id"),
    Case("train-resume-incomplete-checkpoint",
         lambda t, f: also(["train", recipe(t, f), f"out={t / 'run'}", "train.save_every=1", "--resume"],
                           existing_dir(t / ".run.moekit-partial" / "checkpoints" / "checkpoint-1")),
         r"nothing to resume: .*\.run\.moekit-partial has no complete checkpoint"),
    Case("train-resume-incomplete-checkpoint-no-save-every",
         lambda t, f: also(["train", recipe(t, f), f"out={t / 'run'}", "train.save_every=0", "--resume"],
                           existing_dir(t / ".run.moekit-partial" / "checkpoints" / "checkpoint-1")),
         r"nothing to resume: .*\.run\.moekit-partial has no complete checkpoint"),
    Case("demo-bad-override", lambda t, f: ["demo", "moe.top_k=99", "--out", t / "demo"],
         r"invalid demo recipe naive: moe: Value error, top_k \(99\) cannot exceed num_experts \(8\)"),
    # evaluate
    Case("evaluate-not-a-run", lambda t, f: ["evaluate", existing_dir(t / "run")],
         r"is not a finished run \(needs recipe\.yaml and model/\)"),
    Case("evaluate-recipe-bad-yaml",
         lambda t, f: ["evaluate", also(run_dir(t, f), write(t / "run" / "recipe.yaml", "a: ["))],
         r"recipe\.yaml is not valid YAML"),
    Case("evaluate-model-meta-not-json",
         lambda t, f: ["evaluate", also(run_dir(t, f), write(t / "run" / "model" / "moekit.json", "{"))],
         r"moekit\.json is not valid JSON"),
    # speech corpus
    Case("corpus-repeated-language-one-flag",
         lambda t, f: corpus("en", t / "c", "--texts", f"en={text(t, f)}", f"en={text(t, f, 'fr')}"),
         r"--texts gives language 'en' twice"),
    Case("corpus-repeated-language-two-flags",
         lambda t, f: corpus("en", t / "c", "--texts", f"en={text(t, f)}", "--texts", f"en={text(t, f, 'fr')}"),
         r"--texts gives language 'en' twice"),
    Case("corpus-texts-missing", lambda t, f: corpus("en", t / "c", "--texts", f"en={t / 'none.txt'}"),
         r"text files not found"),
    Case("corpus-unknown-language", lambda t, f: corpus("en,xx", t / "c", "--texts", f"en={text(t, f)}",
                                                        f"xx={text(t, f, 'fr')}"), r"unknown languages \['xx'\]"),
    Case("corpus-texts-for-other-language", lambda t, f: corpus("en,fr", t / "c", "--texts", f"en={text(t, f)}"),
         r"texts must give one file for each language"),
    Case("corpus-flite-without-english", lambda t, f: corpus("fr", t / "c", "--texts", f"fr={text(t, f, 'fr')}",
                                                             "--flite-test"), r"flite_test speaks English"),
    Case("corpus-zero-voices", lambda t, f: corpus("en", t / "c", "--texts", f"en={text(t, f)}", "--voices", 0),
         r"invalid speech corpus options: voices: Input should be greater than or equal to 1"),
    # simoe
    Case("simoe-export-not-simoe", lambda t, f: ["simoe", "export", moe(t, f), "--out", t / "x"],
         r"moe is not a SIMoE checkpoint \(no simoe\.json\)"),
    Case("simoe-report-missing-run", lambda t, f: ["simoe", "report", t / "nowhere", "--out", t / "x"],
         r"nowhere is not a SIMoE checkpoint \(no simoe\.json\)"),
]


def btx(t: Path, f: Fx, out) -> tuple[list, Path]:
    """A BTX recipe (two branch copies of the dense model) with output `out`, and --overwrite."""
    spec = {"num_experts": 2, "top_k": 1, "layers": [1],
            "init": {"method": "btx", "include_seed": False, "branches": [str(dense(t, f, f"b{i}")) for i in range(2)]}}
    r = write(t / "btx.yaml", yaml.safe_dump({"model": str(dense(t, f)), "out": str(out), "spec": spec}))
    return ["upcycle", r, "--overwrite"], out


def dense_out_of_range_pruned(d: Path) -> None:
    write(d / "pruned_experts.json", json.dumps({"method": "pruned", "budget": 1,
                                                 "experts": {"model.layers.1.mlp": [9]}}))


MORE = [
    # outputs named in other ways that are, or hold, an input
    Case("upcycle-out-empty-string", lambda t, f: upc(dense(t, f), "", "--overwrite"), IS_CWD, cwd="work"),
    Case("upcycle-out-is-recipe",
         lambda t, f: (["upcycle", up_recipe(t, f, dense(t, f), t / "up.yaml"), "--overwrite"], t / "up.yaml"),
         IS_INPUT),
    Case("upcycle-out-is-btx-branch", lambda t, f: btx(t, f, t / "b1"), r"the output .*b1 is input .*b1"),
    Case("upcycle-btx-branch-missing", lambda t, f: also(btx(t, f, t / "moe"), shutil.rmtree(t / "b1")),
         r"'.*b1' is neither an existing model directory, a built-in model nor a Hugging Face repository id"),
    Case("report-out-is-trace", lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--out", t / "t.npz",
                                              "--overwrite"], IS_INPUT),
    Case("finetune-out-is-data-file",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "en.txt", "--overwrite"], IS_INPUT),
    Case("corpus-out-is-texts-file", lambda t, f: corpus("en", t / "en.txt", "--texts", f"en={text(t, f)}",
                                                         "--overwrite"), IS_INPUT),
    Case("upcycle-out-is-weights-file-of-model",
         lambda t, f: upc(dense(t, f), t / "dense" / "model.safetensors", "--overwrite"), r"is inside input"),
    Case("prune-out-is-weights-file-of-model",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--out", t / "moe" / "model.safetensors", "--overwrite"], r"is inside input"),
    Case("collect-out-is-config-of-model",
         lambda t, f: collect(moe(t, f), t / "moe" / "config.json", f"en={text(t, f)}", extra=["--overwrite"]),
         r"is inside input"),
    # FIFOs and other files that are not regular
    Case("collect-texts-fifo", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={fifo(t / 'en.txt')}"),
         r"text file .*en\.txt is not a regular file", seconds=5),
    Case("finetune-data-fifo",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={fifo(t / 'en.txt')}", "--out", t / "ft"],
         r"data file for en .*en\.txt is not a regular file",
         seconds=20),
    Case("validate-recipe-fifo", lambda t, f: ["validate", fifo(t / "r.yaml")], r"config file not found: .*r\.yaml",
         seconds=20),
    Case("corpus-texts-fifo", lambda t, f: corpus("en", t / "c", "--texts", f"en={fifo(t / 'en.txt')}"),
         r"text files not found", seconds=20),
    Case("select-trace-fifo", lambda t, f: ["select", "topk", fifo(t / "t.npz"), "--target", "en", "--budget", 2,
                                            "--out", t / "s.json"], r"trace .*t\.npz is not a regular file", seconds=5),
    # command-line syntax (argparse)
    Case("list-unknown-kind", lambda t, f: ["list", "models"], r"moekit list: .*invalid choice: 'models'"),
    Case("collect-texts-without-equals", lambda t, f: ["routes", "collect", "--model", moe(t, f), "--texts", "en",
                                                       "--out", t / "t.npz"], r"expected LANG=FILE, got 'en'"),
    # tokenizer files
    Case("dense-tokenizer-json-broken",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "tokenizer.json", "{oops")),
                                                         t / "moe"), r"has tokenizer files but they do not load"),
    Case("dense-tokenizer-config-not-json",
         lambda t, f: upc(dense_with(t, f, lambda d: write(d / "tokenizer_config.json", "{oops")), t / "moe"),
         r"has tokenizer files but they do not load"),
    Case("moe-pruned-experts-out-of-range", lambda t, f: ["inspect", moe_with(t, f, dense_out_of_range_pruned)],
         r"model\.layers\.1\.mlp: expert ids must be distinct and in \[0, 4\), got \[9\]"),
    Case("inspect-a-file", lambda t, f: ["inspect", write(t / "moekit.json", "{}")], r"is not a moekit checkpoint"),
    # the model cannot do what is asked
    Case("export-mixtral-with-dense-layers",
         lambda t, f: ["export", moe(t, f), "--format", "mixtral", "--out", t / "hf"],
         r"cannot export to mixtral: decoder layers \[0, 2\] are dense"),
    Case("export-qwen3-moe-from-llama", lambda t, f: ["export", moe(t, f), "--format", "qwen3_moe", "--out", t / "hf"],
         r"cannot export to qwen3_moe: the source model must be a Qwen3ForCausalLM, got LlamaForCausalLM"),
    Case("finetune-dense-model",
         lambda t, f: ["finetune", "--model", dense(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--steps", 1, "--out", t / "ft"],
         r"has no MoE layer moekit can read"),
    Case("collect-dense-model", lambda t, f: collect(dense(t, f), t / "t.npz", f"en={text(t, f)}"),
         r"has no MoE layer moekit can read"),
    Case("collect-max-texts-zero", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}",
                                                        extra=["--max-texts", 0]), r"--max-texts and --experts-per-load must be ≥ 1"),
    Case("collect-experts-per-load-zero", lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}",
                                                               extra=["--experts-per-load", 0]),
         r"--experts-per-load must be ≥ 1"),
    Case("train-model-is-moekit-checkpoint", lambda t, f: ["train", recipe(t, f), f"model.path={moe(t, f)}",
                                                           f"out={t / 'run'}", "method=dense", "moe=null"],
         r"is a moekit MoE checkpoint, not a dense model"),
    Case("train-data-not-jsonl",
         lambda t, f: ["train", recipe(t, f), f"data.train_files=[{write(t / 'bad.jsonl', 'not json' + chr(10))}]",
                       f"out={t / 'run'}"], r"bad\.jsonl"),
    Case("select-target-without-tokens",
         lambda t, f: ["select", "topk", trace_with(t, f, languages=np.array(["en", "fr", "sw"]),
                                                saliency=lambda a: np.concatenate([a, np.zeros_like(a[:1])])),
                       "--target", "sw",
                       "--budget", 2, "--out", t / "s.json"], r"the trace has no tokens of the target language 'sw'"),
    Case("trace-ids-float", lambda t, f: ["select", "topk", trace_with(t, f, ids=lambda a: a.astype(np.float32)),
                                          "--target", "en", "--budget", 2, "--out", t / "s.json"],
         r"ids has shape .*\(float32\), expected .*\(integer\)"),
    Case("evaluate-data-missing",
         lambda t, f: ["evaluate", also(run_dir(t, f), edit_yaml(t / "run" / "recipe.yaml", "data.test_files",
                                                                 [str(t / "gone.jsonl")]))],
         r"data file not found: .*gone\.jsonl"),
    Case("corpus-too-few-texts", lambda t, f: corpus("en", t / "c", "--texts", f"en={text(t, f)}",
                                                     "--train-per-lang", 5),
         r"en: only 3 distinct texts of at most 200 characters, need 6"),
]

def lock_named(out: Path, kind: str) -> None:
    """A user's entry with the output's lock name beside it: a file, a symbolic link or a directory."""
    lock = out.parent / f".{out.name}.moekit-lock"
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        write(lock, "precious\n")
    elif kind == "link":
        symlink(lock, write(out.parent / "precious.txt", "precious\n"))
    else:
        existing_dir(lock)
        write(lock / "inside.txt", "precious\n")


def text_recipe(t: Path, f: Fx, files: list, fmt: str = "text", **data) -> Path:
    """A `task: text` recipe on the tiny dense model reading `files` as `fmt`."""
    return write(t / "text.yaml", yaml.safe_dump({
        "task": "text", "name": "text", "out": str(t / "run"), "model": {"path": str(dense(t, f))}, "method": "moe",
        "moe": {"num_experts": 4, "top_k": 2, "every": 2},
        "data": {"format": fmt, "train_files": [str(x) for x in files], "test_fraction": 0.25, "max_length": 32, **data},
        "train": {"steps": 1, "batch_size": 2}}))


def wider_dense(path: Path) -> Path:
    """A tiny dense model like the fixture's but with a wider FFN (other weight shapes)."""
    from moekit.testing import tiny_llama, tiny_tokenizer

    tiny_llama(intermediate_size=96).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def evil_pickle(path: Path) -> None:
    """A torch.save file whose unpickling would call os.system (torch.load(weights_only=True) refuses it)."""
    import torch

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"state": Evil()}, path)


def interrupted_run(t: Path, f: Fx, finished: Path, damage: Callable[[Path], object]) -> Path:
    """`.run.moekit-partial` holding a copy of a finished tiny run stopped after its first checkpoint (the second
    removed), with `damage` applied to that checkpoint."""
    partial = f.copy(finished, t / ".run.moekit-partial")
    shutil.rmtree(partial / "checkpoints" / "checkpoint-2")
    damage(partial / "checkpoints" / "checkpoint-1")
    return partial


LOCK_NOT_OURS = r"\.moekit-lock exists and is not a moekit lock; moekit does not touch it: move it away"
LOCK_OUTPUTS = {  # command: (argv builder, output) for each command that writes an output
    "upcycle": lambda t, f: upc(dense(t, f), t / "o"),
    "export": lambda t, f: ["export", moe(t, f), "--format", "mixtral", "--out", t / "o"],
    "collect": lambda t, f: collect(moe(t, f), t / "o", *texts(("en", text(t, f)))),
    "report": lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--out", t / "o"],
    "select": lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en", "--budget", 2,
                            "--out", t / "o"],
    "prune": lambda t, f: ["prune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"), "--out", t / "o"],
    "finetune": lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                              "--data", f"en={text(t, f)}", "--steps", 1, "--out", t / "o"],
    "train": lambda t, f: ["train", recipe(t, f), f"out={t / 'o'}"],
}

LOCKS_AND_KINDS = [
    *(Case(f"lock-name-user-file-{cmd}", lambda t, f, b=build: also(b(t, f), lock_named(t / "o", "file")),
           LOCK_NOT_OURS) for cmd, build in LOCK_OUTPUTS.items()),
    *(Case(f"lock-name-user-{kind}-{cmd}", lambda t, f, b=LOCK_OUTPUTS[cmd], k=kind: also(b(t, f), lock_named(t / "o", k)),
           LOCK_NOT_OURS) for kind in ("link", "dir") for cmd in ("upcycle", "select", "train")),
    # --overwrite replaces an output by one of the same kind only
    Case("upcycle-overwrite-replaces-a-file", lambda t, f: upc(dense(t, f), write(t / "o", "a file"), "--overwrite"),
         r"o exists and is not a directory, and the output is a directory; overwrite replaces an output of the "
         r"same kind only"),
    Case("select-overwrite-replaces-a-directory",
         lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en", "--budget", 2,
                       "--out", also(existing_dir(t / "d"), write(t / "d" / "mine.txt", "x")), "--overwrite"],
         r"d exists and is a directory, and the selection is a file; overwrite replaces"),
    Case("select-overwrite-replaces-an-empty-directory",
         lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en", "--budget", 2,
                       "--out", existing_dir(t / "d"), "--overwrite"], r"d exists and is a directory"),
    Case("collect-overwrite-replaces-a-directory",
         lambda t, f: collect(moe(t, f), also(existing_dir(t / "d"), write(t / "d" / "mine.txt", "x")),
                              *texts(("en", text(t, f))), extra=["--overwrite"]),
         r"d exists and is a directory, and the trace is a file"),
    Case("report-overwrite-replaces-a-file",
         lambda t, f: ["routes", "report", f.copy(f.trace, t / "t.npz"), "--out", write(t / "r", "mine"),
                       "--overwrite"], r"r exists and is not a directory, and the output is a directory"),
    Case("train-overwrite-replaces-a-file", lambda t, f: ["train", recipe(t, f), f"out={write(t / 'o', 'x')}",
                                                          "--overwrite"],
         r"o exists and is not a directory, and the run directory is a directory"),
    Case("select-overwrite-replaces-a-fifo",
         lambda t, f: ["select", "topk", f.copy(f.trace, t / "t.npz"), "--target", "en", "--budget", 2,
                       "--out", fifo(t / "s.json"), "--overwrite"], r"s\.json exists and is not a regular file"),
    Case("upcycle-layers-repeated", lambda t, f: ["upcycle", "--model", dense(t, f), "--layers", "0,0",
                                                  "--experts", 2, "--out", t / "moe"],
         r"layers lists block 0 more than once"),
]

LINKS_OUT = r"leads outside the checkpoint directory"
CONTAINMENT = [  # every file read from a checkpoint lies inside it, symbolic links included
    Case("meta-symlink-outside-export",
         lambda t, f: ["export", moe_with(t, f, link_out(t, "moekit.json", "outside.json")),
                       "--format", "mixtral", "--out", t / "o"], r"moekit\.json " + LINKS_OUT),
    Case("meta-symlink-outside-inspect",
         lambda t, f: ["inspect", moe_with(t, f, link_out(t, "moekit.json", "outside.json"))],
         r"moekit\.json " + LINKS_OUT),
    Case("config-symlink-outside-upcycle",
         lambda t, f: upc(dense_with(t, f, link_out(t, "config.json", "outside.json")), t / "o"),
         r"config\.json " + LINKS_OUT),
    Case("config-symlink-outside-inspect",
         lambda t, f: ["inspect", moe_with(t, f, link_out(t, "config.json", "outside.json"))],
         r"config\.json " + LINKS_OUT),
    Case("tokenizer-symlink-outside-collect",
         lambda t, f: collect(moe_with(t, f, link_out(t, "tokenizer.json", "tok.json")),
                              t / "t.npz", *texts(("en", text(t, f)))), r"tokenizer\.json " + LINKS_OUT),
    Case("generation-config-symlink-outside-train",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "model.path=" + str(dense_with(t, f, lambda d: (
             (d / "generation_config.json").unlink(missing_ok=True),
             symlink(d / "generation_config.json", write(t / "g.json", "{}")))))],
         r"generation_config\.json " + LINKS_OUT),
    Case("index-symlink-outside-upcycle",
         lambda t, f: upc(dense_with(t, f, lambda d: (index(d, "model.safetensors"),
                                                      shutil.move(d / "model.safetensors.index.json", t / "i.json"),
                                                      symlink(d / "model.safetensors.index.json", t / "i.json"))),
                          t / "o"), r"model\.safetensors\.index\.json " + LINKS_OUT),
    Case("dangling-symlink-upcycle",
         lambda t, f: upc(dense_with(t, f, lambda d: symlink(d / "special_tokens_map.json", t / "gone.json")), t / "o"),
         r"special_tokens_map\.json " + LINKS_OUT),
    Case("dangling-symlink-inside-upcycle",
         lambda t, f: upc(dense_with(t, f, lambda d: symlink(d / "vocab.json", d / "gone.json")), t / "o"),
         r"file vocab\.json is missing \(a dangling symbolic link\)"),
    Case("subfolder-symlink-outside-inspect",
         lambda t, f: ["inspect", moe_with(t, f, lambda d: symlink(d / "sub", existing_dir(t / "elsewhere")))],
         r"sub " + LINKS_OUT),
    Case("fifo-in-checkpoint-inspect", lambda t, f: ["inspect", moe_with(t, f, lambda d: fifo(d / "tokenizer.model"))],
         r"tokenizer\.model is not a regular file"),
]

UNEXPECTED_BEFORE = [  # each of these ended in "unexpected ... please report it" before
    Case("collect-layers-bad-regex", lambda t, f: collect(moe(t, f), t / "t.npz", *texts(("en", text(t, f))),
                                                          extra=["--layers", "["]),
         r"layers '\[' is not a valid regular expression"),
    Case("upcycle-recipe-model-nul-byte",
         lambda t, f: (["upcycle", write(t / "up.yaml", yaml.safe_dump({"model": "acme/ti\x00ny", "out": str(t / "o"),
                                                                        "spec": {"num_experts": 2}}))], t / "o"),
         r"model: contains a NUL byte"),
    Case("train-recipe-nul-byte-in-data-file",
         lambda t, f: ["train", recipe(t, f, **{"data.train_files": ["tr\x00ain.jsonl"]}), f"out={t / 'run'}"],
         r"data\.train_files\.0: contains a NUL byte"),
]

def hub_copy(t: Path, f: Fx, damage: Callable[[Path], object] = lambda snap: None) -> Path:
    """A copy of the fixture's Hugging Face cache (links kept as links), `damage` applied to org/tiny's snapshot."""
    from moekit.testing.fake_hub import commit_of

    shutil.copytree(f.hub, t / "hub", symlinks=True)
    damage(t / "hub" / "models--org--tiny" / "snapshots" / commit_of("org/tiny"))
    return t / "hub"


def relink(link: Path, target: Path) -> None:
    link.unlink()
    link.symlink_to(target)


def mixed_mergekit(t: Path, f: Fx) -> Path:
    """A mergekit-moe config with a Llama base and a Qwen3 expert of the same FFN shapes."""
    from moekit.testing import tiny_qwen3, tiny_tokenizer

    tiny_qwen3().save_pretrained(t / "qwen3")
    tiny_tokenizer().save_pretrained(t / "qwen3")
    return write(t / "mk.yml", yaml.safe_dump({"base_model": str(dense(t, f)), "gate_mode": "random",
                                                "experts": [{"source_model": str(t / "dense")},
                                                            {"source_model": str(t / "qwen3")}]}))


HUB_ENV = lambda t: {"HF_HUB_CACHE": t / "hub", "HF_HUB_OFFLINE": 1}  # noqa: E731
HUB_AND_MERGEKIT = [
    Case("hub-link-outside-the-repository",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: relink(s / "config.json",
                                                                                    write(t / "x.json", "{}")))),
         r"config\.json leads outside its Hugging Face cache folder .*models--org--tiny", env=HUB_ENV),
    Case("hub-link-to-another-repository",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: (
             shutil.copytree(s.parent.parent, s.parents[2] / "models--org--other", symlinks=True),
             relink(s / "config.json", s.parents[2] / "models--org--other" / "snapshots" / s.name / "config.json")))),
         r"config\.json leads outside its Hugging Face cache folder", env=HUB_ENV),
    Case("hub-link-dangling",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: (s / "config.json").resolve().unlink())),
         r"links config\.json to blobs that are missing; download the repository again", env=HUB_ENV),
    Case("hub-refs-main-names-a-missing-snapshot",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: write(s.parents[1] / "refs" / "main",
                                                                                  "1" * 40))),
         r"refs/main names commit '1{40}', whose snapshot .* is missing", env=HUB_ENV),
    # issue 37 §5: refs/main holding a path, a FIFO or a device; an output inside the cache
    Case("hub-refs-main-holds-a-path",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: (
             shutil.copytree(f.dense, t / "evil_model"),
             write(s.parents[1] / "refs" / "main", "../../../evil_model")))),
         r"refs/main holds '\.\./\.\./\.\./evil_model', not a commit hash", env=HUB_ENV),
    Case("hub-refs-main-a-fifo",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: (
             (s.parents[1] / "refs" / "main").unlink(), fifo(s.parents[1] / "refs" / "main")))),
         r"Hugging Face cache ref .*refs/main is not a regular file", env=HUB_ENV, seconds=30),
    Case("hub-refs-main-links-to-dev-zero",
         lambda t, f: also(upc("org/tiny", t / "o"), hub_copy(t, f, lambda s: (
             (s.parents[1] / "refs" / "main").unlink(), symlink(s.parents[1] / "refs" / "main", "/dev/zero")))),
         r"Hugging Face cache ref .*refs/main is not a regular file", env=HUB_ENV, seconds=30),
    Case("hub-out-inside-the-repositorys-blobs",
         lambda t, f: also(upc("org/tiny", t / "hub" / "models--org--tiny" / "blobs" / "o"), hub_copy(t, f)),
         r"is inside the Hugging Face cache .*hub, which only huggingface_hub writes", env=HUB_ENV),
    Case("hub-revision-dotdot", lambda t, f: also(upc("org/tiny@../x", t / "o"), hub_copy(t, f)),
         r"'\.\./x' in org/tiny@\.\./x is not a revision name", env=HUB_ENV),
    Case("hub-revision-empty-part", lambda t, f: also(upc("org/tiny@refs//main", t / "o"), hub_copy(t, f)),
         r"is not a revision name", env=HUB_ENV),
    Case("mergekit-mixed-architectures", lambda t, f: (["upcycle", mixed_mergekit(t, f), t / "o"], t / "o"),
         r"the models mix architectures \(llama, qwen3\): .*mergekit-moe refuses this and so does moekit, unless "
         r"--allow-crimes"),
    Case("mergekit-out-shard-size-not-a-count",
         lambda t, f: (["upcycle", mixed_mergekit(t, f), t / "o", "--allow-crimes", "--out-shard-size", "5GB"],
                       t / "o"), r"'5GB' is not a count such as 1000, 500M or 5B"),
    Case("mergekit-load-in-4bit", lambda t, f: (["upcycle", mixed_mergekit(t, f), t / "o", "--load-in-4bit"], t / "o"),
         r"--load-in-4bit \(mergekit-moe\) has no equivalent in moekit"),
    Case("mergekit-num-threads-zero", lambda t, f: (["upcycle", mixed_mergekit(t, f), t / "o", "-j", "0"], t / "o"),
         r"--num-threads takes a whole number of at least 1"),
    Case("upcycle-mergekit-flags-without-a-mergekit-config",
         lambda t, f: upc(dense(t, f), t / "o", "--allow-crimes", "--out-shard-size", "1B"),
         r"--out-shard-size is a mergekit-moe flag: it applies to a mergekit-moe config \(moekit upcycle CONFIG OUT\)"),
    Case("mergekit-seeds-disagree",
         lambda t, f: (["upcycle", mixed_mergekit(t, f), t / "o", "--random-seed", 1, "--seed", 2], t / "o"),
         r"--seed 2 and --random-seed 1 disagree"),
]

def native_sel(t: Path, layers=(0, 1, 2), ids=(0, 1, 2, 3), name="keep.json", **per_layer) -> Path:
    """A selection of the tiny Qwen3-MoE's experts: `ids` in every one of `layers` (or per_layer[f"l{i}"])."""
    experts = {f"model.layers.{i}.mlp": list(per_layer.get(f"l{i}", ids)) for i in layers}
    return selection(t, {"method": "manual", "budget": sum(map(len, experts.values())), "experts": experts}, name)


def prune_native(t: Path, f: Fx, sel: Path, mode: str = "--keep", out: str = "p") -> list:
    return ["prune", "--model", f.copy(f.native, t / "q3"), "--experts", sel, mode, "--out", t / out]


def prune_damaged(t: Path, f: Fx, damage: Callable[[Path], object]) -> list:
    """prune --keep on a copy of the tiny Qwen3-MoE that `damage` changed first."""
    model = f.copy(f.native, t / "q3")
    damage(model)
    return ["prune", "--model", model, "--experts", native_sel(t), "--keep", "--out", t / "p"]


BIGGER_THAN_MEMORY = [
    Case("prune-keep-layer-the-checkpoint-lacks",
         lambda t, f: prune_native(t, f, native_sel(t, layers=(0, 1, 2, 9))),
         r"the selection's layer 'model\.layers\.9\.mlp' is not an MoE layer of .*q3 \(its MoE layers: "
         r"\['model\.layers\.0\.mlp', 'model\.layers\.1\.mlp', 'model\.layers\.2\.mlp'\]\)"),
    Case("prune-keep-not-every-layer", lambda t, f: prune_native(t, f, native_sel(t, layers=(0, 1))),
         r"the selection must cover every MoE layer"),
    Case("prune-drop-every-expert", lambda t, f: prune_native(t, f, native_sel(t, ids=range(8)), "--drop"),
         r"keeping 0 experts per layer leaves fewer than the 2 each token is routed to"),
    Case("prune-keep-fewer-than-top-k", lambda t, f: prune_native(t, f, native_sel(t, ids=(5,))),
         r"keeping 1 experts per layer leaves fewer than the 2 each token is routed to \(num_experts_per_tok\)"),
    Case("prune-keep-uneven-layers", lambda t, f: prune_native(t, f, native_sel(t, l1=(0, 1, 2))),
         r"the layers would keep different numbers of experts \(\[3, 4\]\), but the config holds one expert "
         r"count for every layer; keep the same number per layer \(moekit select usage, reap or ean with top=N\)"),
    Case("prune-keep-expert-out-of-range", lambda t, f: prune_native(t, f, native_sel(t, ids=(0, 1, 2, 8))),
         r"the selection's layer 'model\.layers\.0\.mlp' names expert 8, outside \[0, 8\)"),
    # issue 37 §5: selection entries of the wrong type, repeated, out of range, or naming no MoE block
    Case("prune-drop-expert-out-of-range", lambda t, f: prune_native(t, f, native_sel(t, ids=(99,)), "--drop"),
         r"the selection's layer 'model\.layers\.0\.mlp' names expert 99, outside \[0, 8\)"),
    Case("prune-drop-duplicate-id", lambda t, f: prune_native(t, f, native_sel(t, ids=(5, 5, 6)), "--drop"),
         r"model\.layers\.0\.mlp: expert 5 is named twice"),
    Case("prune-keep-ids-booleans", lambda t, f: prune_native(t, f, native_sel(t, ids=(True, False))),
         r"experts\.model\.layers\.0\.mlp\.0: Input should be a valid integer"),
    Case("prune-keep-ids-floats", lambda t, f: prune_native(t, f, native_sel(t, ids=(0.0, 1.0, 2.0, 3.0))),
         r"experts\.model\.layers\.0\.mlp\.0: Input should be a valid integer"),
    Case("prune-keep-ids-strings", lambda t, f: prune_native(t, f, native_sel(t, ids=("0", "1", "2", "3"))),
         r"experts\.model\.layers\.0\.mlp\.0: Input should be a valid integer"),
    Case("prune-keep-layer-not-an-moe-block",
         lambda t, f: prune_native(t, f, selection(t, {"method": "m", "budget": 4, "experts": {
             "x.layers.0.y": [0, 1, 2, 3]}})),
         r"the selection's layer 'x\.layers\.0\.y' is not an MoE layer of"),
    Case("prune-keep-same-layer-twice",
         lambda t, f: prune_native(t, f, selection(t, {"method": "m", "budget": 8, "experts": {
             "model.layers.0.mlp": [0, 1, 2, 3], "model.layers.0.block_sparse_moe": [0, 1, 2, 3]}})),
         r"the selection's layer 'model\.layers\.0\.block_sparse_moe' is not an MoE layer of"),
    Case("prune-keep-config-top-k-a-string",
         lambda t, f: prune_damaged(t, f, lambda d: edit_json(d / "config.json",
                                                              lambda c: c.update(num_experts_per_tok="2"))),
         r"invalid config\.json: num_experts_per_tok: Input should be a valid integer"),
    Case("prune-keep-config-n-group-a-float",
         lambda t, f: prune_damaged(t, f, lambda d: edit_json(d / "config.json", lambda c: c.update(n_group=2.0))),
         r"invalid config\.json: n_group: Input should be a valid integer"),
    Case("prune-keep-config-a-list", lambda t, f: prune_damaged(t, f, lambda d: write(d / "config.json", "[1, 2]")),
         r"invalid config\.json: <root>: Input should be a valid dictionary"),
    Case("prune-keep-moekit-checkpoint",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts", native_sel(t), "--keep", "--out", t / "p"],
         r"is a moekit checkpoint: removing experts needs a native transformers checkpoint \(`moekit export`"),
    Case("prune-keep-out-inside-model",
         lambda t, f: ["prune", "--model", f.copy(f.native, t / "q3"), "--experts", native_sel(t), "--keep",
                       "--out", t / "q3" / "pruned"], r"the output .*pruned is inside the checkpoint .*q3: write it "
                                                      r"elsewhere"),
    Case("prune-keep-shards-disagree-with-index",
         lambda t, f: ["prune", "--model", also(f.copy(f.native, t / "q3"), index(t / "q3", "model.safetensors",
                                                                                 {"ghost.weight": "model.safetensors"})),
                       "--experts", native_sel(t), "--keep", "--out", t / "p"],
         r"lists tensors its shards do not hold: \['ghost\.weight'\]"),
    Case("collect-stream-on-dense-model",
         lambda t, f: collect(dense(t, f), t / "t.npz", f"en={text(t, f)}", extra=["--stream", "on"]),
         r"has no MoE layer moekit can read"),
    Case("collect-stream-bad-value",
         lambda t, f: collect(moe(t, f), t / "t.npz", f"en={text(t, f)}", extra=["--stream", "maybe"]),
         r"argument --stream: invalid choice: 'maybe'"),
    Case("select-reap-trace-without-saliency",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=None), "--top", 2, "--out", t / "s.json"],
         r"the trace has no saliency sums, which reap needs"),
    Case("select-reap-top-above-experts",
         lambda t, f: ["select", "reap", f.copy(f.trace, t / "t.npz"), "--top", 5, "--out", t / "s.json"],
         r"top 5 is more than the experts of model\.layers\.1\.mlp \(4\)"),
    Case("select-reap-top-below-top-k",
         lambda t, f: ["select", "usage", f.copy(f.trace, t / "t.npz"), "--top", 1, "--out", t / "s.json"],
         r"keeping 1 experts per layer leaves fewer than the 2 each token is routed to"),
    Case("select-out-hard-link-of-the-trace",
         lambda t, f: ["select", "usage", f.copy(f.trace, t / "t.npz"), "--top", 2, "--overwrite",
                       "--out", also(t / "hl.npz", os.link(t / "t.npz", t / "hl.npz"))],
         r"the selection .*hl\.npz is input .*t\.npz; choose another selection path"),
    Case("select-out-spelled-as-a-directory",
         lambda t, f: ["select", "usage", f.copy(f.trace, t / "t.npz"), "--top", 2, "--out", f"{t / 's.json'}/"],
         r"names a directory \(a trailing '/'\), and the .* is a file"),
    Case("select-reap-without-top",
         lambda t, f: ["select", "reap", f.copy(f.trace, t / "t.npz"), "--out", t / "s.json"],
         r"the following arguments are required: --top"),
    Case("trace-saliency-wrong-shape",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=lambda a: a[:, :1]), "--top", 2,
                       "--out", t / "s.json"], r"saliency has shape \(2, 1, 4, 6\) \(float64\), expected \(2, 2, 4, 6\)"),
    Case("trace-saliency-negative",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=lambda a: -a - 1), "--top", 2,
                       "--out", t / "s.json"], r"finite, non-negative sums"),
]

PICKLED = r"cannot resume from .*checkpoint-1: .*{} holds pickled Python objects other than tensors \(it names " \
          r"posix\.system\); it is refused and nothing in it ran$"
MESSAGES = [  # the outcome was right, the words misled
    *(Case(f"train-resume-pickle-{name.split('.')[0]}",
           lambda t, f, n=name: also(["train", recipe(t, f), f"out={t / 'run'}", "--resume"],
                                     interrupted_run(t, f, f.finished_run, lambda c: evil_pickle(c / n))),
           PICKLED.format(re.escape(name))) for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth")),
    Case("btx-branch-shape-differs",
         lambda t, f: also(btx(t, f, t / "moe"), shutil.rmtree(t / "b1"), wider_dense(t / "b1")),
         r"b1: model\.layers\.\d+\.mlp\.\w+\.weight is \[.*\] in the weights but \[.*\] by the config\.json of "
         r"the base model .*dense$"),
    Case("dense-index-absolute-shard-not-pickle",
         lambda t, f: upc(dense_with(t, f, lambda d: (index(d, str(t / "w.safetensors")),
                                                      shutil.move(d / "model.safetensors", t / "w.safetensors"))),
                          t / "o"),
         r"shard name '/.*w\.safetensors' is an absolute path; the index must name files inside the checkpoint"),
    Case("trace-ids-minus-two",
         lambda t, f: ["select", "topk", trace_with(t, f, ids=set_item((0, 0, 0), -2)), "--target", "en",
                       "--budget", 2, "--out", t / "s.json"],
         r"outside \[0, 4\) \(-1, which pads a smaller top-k, is the only other id allowed\)"),
    *(Case(f"text-data-{name}", lambda t, f, b=build: ["train", text_recipe(t, f, [b(t)])], msg) for name, build, msg in [
        ("directory", lambda t: existing_dir(t / "docs.txt"), r"data file .*docs\.txt is not a regular file"),
        ("fifo", lambda t: fifo(t / "docs.txt"), r"data file .*docs\.txt is not a regular file"),
        ("dev-zero", lambda t: Path("/dev/zero"), r"data file /dev/zero is not a regular file"),
        ("symlink-to-dev-zero", lambda t: symlink(t / "z.txt", "/dev/zero"), r"data file .*z\.txt is not a regular file"),
        ("corrupt-jsonl", lambda t: write(t / "d.jsonl", '{"text": "a"}\n{"text": oops}\n'),
         r"cannot read .*d\.jsonl as json: line 2 is not valid JSON"),
        ("corrupt-csv", lambda t: write(t / "d.csv", 'text,x\n"a",1\n"b",2,3\n'),
         r"cannot read .*d\.csv as csv: .*Expected 2 fields in line 3, saw 3"),
        ("missing-column", lambda t: write(t / "d.jsonl", '{"body": "a"}\n' * 4),
         r"d\.jsonl: record \d: has no column 'text' \(its columns: body\)"),
        ("number-in-text-column", lambda t: write(t / "d.jsonl", '{"text": 0}\n' + '{"text": "abc"}\n' * 4),
         r"d\.jsonl: record 0: column 'text' must hold text, got int '0'"),
        ("null-in-text-column", lambda t: write(t / "d.jsonl", '{"text": "abc"}\n' * 4 + '{"text": null}\n'),
         r"d\.jsonl: record 4: column 'text' must hold text, got null"),
    ]),
    Case("text-data-alpaca-missing-output",
         lambda t, f: ["train", text_recipe(t, f, [write(t / "a.jsonl", (json.dumps({"instruction": "x"}) + "\n") * 4)],
                                            "alpaca")], r"a\.jsonl: record \d: has no column 'output'"),
]


DRY_RUN = [  # `moekit train|finetune --dry-run` (moekit.training.plan): refused before any plan, nothing written
    Case("train-dry-run-model-missing",
         lambda t, f: ["train", recipe(t, f), f"model.path={t / 'nowhere'}", f"out={t / 'run'}", "--dry-run"],
         r"'.*nowhere' is neither an existing model directory, a built-in model nor a Hugging Face repository id"),
    Case("train-dry-run-device-memory-overflows",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "--dry-run", "--device-memory", "1e400GB"],
         r"argument --device-memory: not a size: '1e400GB'"),
    Case("train-dry-run-devices-zero",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "--dry-run", "--devices", 0],
         r"argument --devices: must be a positive count, got '0'"),
    Case("train-dry-run-expert-parallel-not-dividing-devices",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "--dry-run", "--devices", 4, "--expert-parallel", 3],
         r"expert parallelism over 3 ranks needs a device count it divides .* 4 devices given"),
    Case("train-dry-run-expert-parallel-not-dividing-experts",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "--dry-run", "--devices", 8, "--expert-parallel", 8],
         r"expert parallelism over 8 ranks must divide every MoE layer's expert count; .* 4 experts"),
    Case("finetune-dry-run-devices-zero",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--dry-run", "--devices", 0],
         r"argument --devices: must be a positive count, got '0'"),
]


def ds(t: Path, config: dict) -> str:
    """train.trainer_args with a DeepSpeed config file `config`."""
    return f"train.trainer_args={json.dumps({'deepspeed': str(write(t / 'ds.json', json.dumps(config)))})}"


WORLD2 = lambda t: {"WORLD_SIZE": "2"}  # noqa: E731  (a launch of 2 processes, as torchrun sets it)
ZERO3 = {"zero_optimization": {"stage": 3}}
BEYOND_ONE_DEVICE = [  # issue 31: refused before any work (a real launch would stop every rank the same way)
    Case("train-expert-parallel-without-launch",
         lambda t, f: ["train", recipe(t, f), "train.expert_parallel=2", f"out={t / 'run'}"],
         r"expert parallelism over 2 ranks needs a distributed launch of at least 2 processes .* single process"),
    Case("train-expert-parallel-larger-than-world",
         lambda t, f: ["train", recipe(t, f), "train.expert_parallel=4", f"out={t / 'run'}"],
         r"expert parallelism over 4 ranks needs a process count it divides; this launch has 2", env=WORLD2),
    Case("train-expert-parallel-not-dividing-experts",
         lambda t, f: ["train", recipe(t, f), "train.expert_parallel=3", f"out={t / 'run'}"],
         r"expert parallelism over 3 ranks must divide every MoE layer's expert count; this model's layers have "
         r"4 experts", env=lambda t: {"WORLD_SIZE": "3"}),
    Case("train-expert-parallel-dense-model",
         lambda t, f: ["train", recipe(t, f, method="dense", moe=DELETE), "train.expert_parallel=2", f"out={t / 'run'}"],
         r"expert parallelism over 2 ranks needs MoE layers; this model has none", env=WORLD2),
    Case("finetune-expert-parallel-not-dividing-experts",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--expert-parallel", 3],
         r"expert parallelism over 3 ranks must divide every MoE layer's expert count", env=lambda t: {"WORLD_SIZE": "3"}),
    Case("train-fsdp-without-launch", lambda t, f: ["train", recipe(t, f), "train.fsdp=true", f"out={t / 'run'}"],
         r"train.fsdp shards the model over the processes of a distributed launch"),
    Case("train-deepspeed-unknown-stage",
         lambda t, f: ["train", recipe(t, f), ds(t, {"zero_optimization": {"stage": 4}}), f"out={t / 'run'}"],
         r"DeepSpeed config: zero_optimization.stage 4 is no ZeRO stage \(DeepSpeed has 0, 1, 2, 3\)"),
    Case("train-deepspeed-batch-contradicts-recipe",
         lambda t, f: ["train", recipe(t, f), ds(t, {**ZERO3, "train_micro_batch_size_per_gpu": 7}), f"out={t / 'run'}"],
         r"DeepSpeed config: train_micro_batch_size_per_gpu is 7, but moekit sets it from train.batch_size \(2\): "
         r"write \"auto\" or leave it out"),
    # issue 37 §3: sections that would replace the recipe's optimizer or schedule; a mistyped ZeRO key
    Case("train-deepspeed-optimizer-section",
         lambda t, f: ["train", recipe(t, f), ds(t, {**ZERO3, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
                       f"out={t / 'run'}"],
         r"DeepSpeed config: an `optimizer` section would replace the optimizer moekit builds from the recipe"),
    Case("train-deepspeed-scheduler-section",
         lambda t, f: ["train", recipe(t, f), ds(t, {**ZERO3, "scheduler": {"type": "WarmupDecayLR"}}),
                       f"out={t / 'run'}"],
         r"a `scheduler` section would replace the learning-rate schedule moekit builds from the recipe"),
    Case("train-deepspeed-mistyped-zero-key",
         lambda t, f: ["train", recipe(t, f), ds(t, {"zero_optimization": {
             "stage": 3, "stage3_param_persistance_threshold": 10}}), f"out={t / 'run'}"],
         r"DeepSpeed config: zero_optimization.stage3_param_persistance_threshold: Extra inputs are not permitted"),
    Case("train-zero3-with-expert-parallel",
         lambda t, f: ["train", recipe(t, f), ds(t, ZERO3), "train.expert_parallel=2", f"out={t / 'run'}"],
         r"train.expert_parallel cannot run under DeepSpeed ZeRO-3 \(train.trainer_args.deepspeed\)", env=WORLD2),
    Case("train-zero3-with-fsdp",
         lambda t, f: ["train", recipe(t, f), ds(t, ZERO3), "train.fsdp=true", f"out={t / 'run'}"],
         r"train.fsdp cannot run under DeepSpeed ZeRO-3 \(train.trainer_args.deepspeed\): FSDP2 shards the "
         r"parameters itself"),
    Case("finetune-deepspeed-unknown-stage",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft",
                       "--deepspeed", write(t / "ds.json", json.dumps({"zero_optimization": {"stage": "three"}}))],
         r"zero_optimization.stage 'three' is no ZeRO stage"),
    Case("finetune-zero3-weight-decay",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts", f.copy(f.sel, t / "s.json"),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--weight-decay", 0.01,
                       "--deepspeed", write(t / "ds.json", json.dumps(ZERO3))],
         r"selective fine-tuning under DeepSpeed ZeRO-3 .* weight decay would move the experts not selected: it "
         r"needs weight decay 0"),
    # issue 37 §3 (training beyond one device): a DeepSpeed checkpoint resumed on another number of processes
    Case("train-resume-deepspeed-checkpoint-of-another-launch",
         lambda t, f: also(["train", recipe(t, f), f"out={t / 'run'}", "--resume"],
                           interrupted_run(t, f, f.finished_run, deepspeed_checkpoint)),
         r"cannot resume from .*checkpoint-1: its DeepSpeed optimizer state has 2 partitions \(in global_step1\), "
         r"this launch 1 processes"),
    # `accelerate launch --num_processes 2` without an accelerate config on a CPU machine: its simple launcher runs
    # one process with these variables (checked on accelerate 1.15: engine.json said "processes": 1)
    Case("train-accelerate-launch-started-one-process-of-several",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}"],
         r"accelerate launch started one process where several were asked for: .* multi_gpu option",
         env=lambda t: {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
]


# issue 37 §7 (fuzz finds): inputs that bench/fuzz.py and tests/test_fuzz.py found crashing a reader (a traceback),
# hanging it, or making it allocate what the input declares; each is refused in one line now


def npy_lie(t: Path, fx: Fx, shape: str = "(4398046511104,)") -> Path:
    """An uncompressed trace whose ids.npy header declares `shape` (8 TiB of int16) over the few bytes it holds."""
    import zipfile

    path = trace_with(t, fx)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = f"{{'descr': '<i2', 'fortran_order': False, 'shape': {shape}, }}".ljust(117) + "\n"
    members["ids.npy"] = members["ids.npy"][:8] + struct.pack("<H", len(header)) + header.encode() + b"\0" * 8
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, data in members.items():
            z.writestr(n, data)
    return path


def header_dims(d: Path) -> None:
    """model.safetensors re-written with one more tensor of shape [2**64, 0]: no bytes, a dim beyond int64."""
    blob = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["extra"] = {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [end, end]}
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


NOT_UTF8 = b'{"src": "\xff"}\n'

FUZZ_FINDS = [
    Case("fuzz-index-shard-name-a-list",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, ["model.safetensors"])), t / "o"),
         r"shard name \['model\.safetensors'\] is not a plain file name"),
    Case("fuzz-index-shard-name-with-nul",
         lambda t, f: upc(dense_with(t, f, lambda d: index(d, "model\x00.safetensors")), t / "o"),
         r"shard name 'model\\x00\.safetensors' is not a plain file name"),
    Case("fuzz-shard-links-to-itself",
         lambda t, f: upc(dense_with(t, f, lambda d: ((d / "model.safetensors").unlink(),
                                                      symlink(d / "model.safetensors", "model.safetensors"))), t / "o"),
         r"model\.safetensors is missing \(a dangling symbolic link\)"),
    Case("fuzz-header-dim-beyond-int64", lambda t, f: upc(dense_with(t, f, header_dims), t / "o"),
         r"model\.safetensors is not a readable safetensors file \(bad entry for 'extra'\)"),
    Case("fuzz-config-field-of-wrong-type", lambda t, f: upc(dense_with(t, f, config_set("mlp_bias", 1)), t / "o"),
         r"config\.json does not load: .*mlp_bias.* expected bool, got int"),
    Case("fuzz-config-architectures-a-mapping",
         lambda t, f: upc(dense_with(t, f, config_set("architectures", {"0": "LlamaForCausalLM"})), t / "o"),
         r"config\.json: architectures must be a list of class names"),
    Case("fuzz-config-2-to-the-64-layers",
         lambda t, f: upc(dense_with(t, f, config_set("num_hidden_layers", 2**64)), t / "o"),
         r"config\.json: num_hidden_layers is 18446744073709551616, but no tensor of its weights has a layer index "
         r"above", seconds=30),
    Case("fuzz-config-negative-size",
         lambda t, f: upc(dense_with(t, f, config_set("intermediate_size", -64)), t / "o"),
         r"config\.json describes no model that can be built: RuntimeError: Trying to create tensor with negative "
         r"dimension"),
    Case("fuzz-config-zero-attention-heads",
         lambda t, f: upc(dense_with(t, f, config_set("num_attention_heads", 0)), t / "o"),
         r"config\.json does not load: integer modulo by zero"),
    Case("fuzz-config-dtype-a-list",
         lambda t, f: upc(dense_with(t, f, config_set("dtype", ["float32"] * 3)), t / "o"),
         r"config\.json does not load: list index out of range"),
    Case("fuzz-config-rope-theta-beyond-int64",
         lambda t, f: upc(dense_with(t, f, config_set("rope_parameters", {"rope_theta": -2**63 - 1,
                                                                          "rope_type": "default"})), t / "o"),
         r"config\.json describes no model that can be built: OverflowError: can't convert negative int"),
    Case("fuzz-config-unknown-rope-type",
         lambda t, f: upc(dense_with(t, f, config_set("rope_parameters", {"rope_theta": 1e4, "rope_type": "DEFAULT"})),
                          t / "o"), r"config\.json (does not load|describes no model that can be built)"),
    Case("fuzz-config-wider-than-its-weights",
         lambda t, f: ["routes", "collect", "--model", dense_with(t, f, config_set("hidden_size", 4096)), "--texts",
                       f"en={text(t, f)}", "--out", t / "t.npz"],
         r"\S+\.weight is \[128, 32\] in the weights but \[128, 4096\] by its config\.json"),
    Case("fuzz-moekit-json-stack-not-a-block-list", lambda t, f: ["inspect", meta_set(t, f, "layers.0.stack", "")],
         r"layer model\.layers\.1\.mlp does not exist in the model \( is not a list of blocks with a block 1\)"),
    Case("fuzz-moekit-json-init-method-a-list",
         lambda t, f: ["inspect", meta_set(t, f, "spec.init.method", ["naive"])],
         r"expert init method must be a name, got \['naive'\]"),
    Case("fuzz-moekit-json-layout-beyond-tensor-sizes",
         lambda t, f: ["inspect", meta_set(t, f, "layers.0.layout.intermediate_size", 10**30)],
         r"moekit\.json: the layout of layer model\.layers\.1\.mlp cannot be built"),
    Case("fuzz-trace-npy-header-declares-8-tib", lambda t, f: ["routes", "report", npy_lie(t, f), "--out", t / "r"],
         r"ids\.npy declares 8796093022208 bytes of data but holds"),
    Case("fuzz-trace-ids-0-d", lambda t, f: ["routes", "report", trace_with(t, f, ids=np.array(3, np.int16)),
                                             "--out", t / "r"], r"ids has shape \(\) \(int16\), expected"),
    Case("fuzz-mergekit-experts-a-number",
         lambda t, f: (["upcycle", write(t / "mk.yml", yaml.safe_dump({"base_model": str(dense(t, f)), "experts": 3})),
                        t / "o"], t / "o"), r"experts: Input should be a valid list"),
    Case("fuzz-deepspeed-nested-too-deeply",
         lambda t, f: ["train", recipe(t, f), "train.trainer_args=" + json.dumps(
             {"deepspeed": str(write(t / "ds.json", "[" * 100_000 + "]" * 100_000))}), f"out={t / 'run'}"],
         r"DeepSpeed config .*ds\.json is not JSON"),
    Case("fuzz-jsonl-not-utf8",
         lambda t, f: ["train", recipe(t, f), f"data.train_files=[{write(t / 'bad.jsonl', NOT_UTF8)}]",
                       f"out={t / 'run'}"], r"bad\.jsonl:1: not UTF-8 \(byte 0x"),
    Case("fuzz-jsonl-number-too-long",
         lambda t, f: ["train", recipe(t, f), f"data.train_files=[{write(t / 'big.jsonl', '9' * 5000)}]",
                       f"out={t / 'run'}"], r"big\.jsonl:1: not valid JSON \(Exceeds the limit"),
    Case("fuzz-data-file-starts-with-null",
         lambda t, f: ["train", text_recipe(t, f, [write(t / "d.jsonl", 'null\n{"text": "a b"}\n')])],
         r"d\.jsonl: line 1 is not a JSON object \(each record of a JSON data file is one\)"),
    Case("fuzz-covost-row-shorter-than-header",
         lambda t, f: s2tt(t, lambda d: covost_first_row(d, "c0.wav\tsentence 0")),
         r"covost_v2\.en_de\.train\.tsv:2: the row has fewer fields than the header's 4$"),
    Case("fuzz-covost-clip-path-leaves-clips",
         lambda t, f: s2tt(t, lambda d: covost_first_row(d, "../../../etc/passwd\tsentence 0\tde 0\tspk0")),
         r"covost_v2\.en_de\.train\.tsv:2: clip path '\.\./\.\./\.\./etc/passwd' leaves the clips folder"),
]


def covost_first_row(folder: Path, row: str) -> None:
    """The first row of the tiny CoVoST layout's train split replaced by `row`."""
    tsv = folder / "covost_v2.en_de.train.tsv"
    lines = tsv.read_text().splitlines()
    tsv.write_text("\n".join([lines[0], row, *lines[2:]]) + "\n")

# issue 39 (speech-LLM recipes, task speech_llm): bad data and a model that is no speech-LLM, refused before training

def s2tt(t: Path, damage: Callable[[Path], object] = lambda d: None, *overrides: str) -> list:
    """`moekit train recipes/spri_s2tt.yaml` on a tiny Qwen3-ASR and a tiny CoVoST 2 layout (direction de) that
    `damage` changes first."""
    from moekit.testing.speech_llm import save_tiny_covost, save_tiny_qwen3_asr

    data = save_tiny_covost(t / "covost", directions=("de",))
    damage(data)
    return ["train", Path(__file__).resolve().parents[1] / "recipes" / "spri_s2tt.yaml",
            f"model.path={save_tiny_qwen3_asr(t / 'qwen3_asr')}", f"data.path={data}", "data.directions=[de]",
            "train.steps=1", f"out={t / 'run'}", *overrides]


def _tsv_without_translation(d: Path) -> None:
    tsv = d / "covost_v2.en_de.train.tsv"
    tsv.write_text(tsv.read_text().replace("\ttranslation\t", "\ttarget\t"))


SPEECH_LLM = [
    Case("train-s2tt-covost-tsv-missing-column", lambda t, f: s2tt(t, _tsv_without_translation),
         r"covost_v2.en_de.train.tsv has no column translation \(CoVoST 2's split files have path, sentence, "
         r"translation, client_id\)"),
    Case("train-s2tt-clip-does-not-decode",
         lambda t, f: s2tt(t, lambda d: write(d / "clips" / "c2.wav", b"RIFF\0\0\0\0WAVEnot audio")),
         r"1 unusable row in .* \(1 unreadable audio\), first covost_v2.en_de.train.tsv:4: clip does not read as "
         r"audio .*; data.on_bad=skip leaves them out and counts them"),
    Case("train-s2tt-direction-without-rows",
         lambda t, f: s2tt(t, lambda d: write(d / "covost_v2.en_de.test.tsv", "path\tsentence\ttranslation\n")),
         r"direction en->de has no test rows left \(data.max_seconds=15.0, data.max_prompt_tokens=512\)"),
    Case("train-s2tt-audio-longer-than-filter", lambda t, f: s2tt(t, lambda d: None, "data.max_seconds=0.5"),
         r"direction en->de has no train rows left \(left out: \{'over_max_seconds': 6\}\)"),
    Case("train-s2tt-text-only-model", lambda t, f: [*s2tt(t), f"model.path={dense(t, f)}"],
         r"is a llama model, not a speech-LLM: task speech_llm trains qwen3_asr, qwen2_audio models"),
]

# issue 39 item 4 (transcription alone, the stage 0 of bench/spri_s2tt.py): which files hold the transcripts
SPEECH_LLM_TRANSCRIPTS = [
    Case("train-s2tt-transcription-alone-without-its-files", lambda t, f: s2tt(t, lambda d: None, "data.directions=[en]"),
         r"transcription \(direction en\) reads the English transcripts of a translation direction's files: name one "
         r"besides en, or name it in data.transcripts_from"),
    Case("train-s2tt-transcripts-from-unknown-language",
         lambda t, f: s2tt(t, lambda d: None, "data.directions=[en]", "data.transcripts_from=xx"),
         r"unknown transcripts_from language 'xx'"),
]

def deepspeed_checkpoint(folder: Path) -> None:
    """What a 2-process DeepSpeed run writes in place of optimizer.pt (the partitions' contents are not read)."""
    (folder / "optimizer.pt").unlink()
    (folder / "global_step1").mkdir()
    for rank in (0, 1):
        (folder / "global_step1" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")

# issue 37 §4 "Pruning and selections" and §5 traces: misshapen tensors, selections made for another model, REAP's
# gate on an older trace, saliency sums that rank nothing
def transposed(folder: Path, name: str) -> Path:
    """`folder` with tensor `name`'s header shape reversed: the same byte count, the wrong shape."""
    f = folder / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name]["shape"] = header[name]["shape"][::-1]
    f.write_bytes(data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(n) + data[8 + n:])
    return folder


def other_model_sel(t: Path, experts: dict, counts: dict, config: str | None = None) -> Path:
    """A selection whose source is another model: the config of moekit.testing's builder `config` (e.g. tiny_olmoe)
    and the MoE layers `counts`."""
    import moekit.testing
    from moekit.routing.trace import config_digest

    digest = None if config is None else config_digest(getattr(moekit.testing, config)().config)
    source = {"config_sha256": digest, "experts": counts, "trace": "other.npz"}
    return selection(t, {"method": "reap", "budget": sum(map(len, experts.values())), "experts": experts,
                         "source": source})


GATE_PROJ = "model.layers.1.mlp.experts.2.gate_proj.weight"
MISSHAPEN = re.escape(GATE_PROJ) + r" is \[32, 24\] in the weights but \[24, 32\] by its config\.json$"
OTHER = r"the selection was made for another model \(trace other\.npz\): "
NATIVE_LAYERS = {f"model.layers.{i}.mlp": 8 for i in range(3)}
PRUNING_AND_SELECTIONS = [
    Case("prune-keep-transposed-tensor",
         lambda t, f: prune_damaged(t, f, lambda d: transposed(d, GATE_PROJ)), MISSHAPEN),
    *(Case(f"collect-stream-{mode}-transposed-tensor",
           lambda t, f, m=mode: collect(transposed(f.copy(f.native, t / "q3"), GATE_PROJ), t / "t.npz",
                                        f"en={text(t, f)}", extra=["--stream", m]), MISSHAPEN)
      for mode in ("on", "off")),
    Case("prune-keep-selection-of-another-model",
         lambda t, f: prune_native(t, f, other_model_sel(t, {n: [0, 1, 2, 3] for n in NATIVE_LAYERS}, NATIVE_LAYERS,
                                                         "tiny_olmoe")),
         OTHER + r"its config \(sha256 [0-9a-f]{12}\) is not this model's \([0-9a-f]{12}\); pass --allow-other-model "
                 r"to use it anyway$"),
    Case("prune-selection-of-another-models-expert-counts",
         lambda t, f: ["prune", "--model", moe(t, f), "--experts",
                       other_model_sel(t, {f.layers[0]: [0]}, {f.layers[0]: 8, f.layers[1]: 4}), "--out", t / "p"],
         OTHER + r"model\.layers\.1\.mlp has 8 experts there, 4 here; pass --allow-other-model"),
    Case("finetune-selection-of-a-layer-the-model-lacks",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts",
                       other_model_sel(t, {f.layers[0]: [0]}, {f.layers[0]: 4, "model.layers.2.mlp": 4}),
                       "--data", f"en={text(t, f)}", "--out", t / "ft"],
         OTHER + r"model\.layers\.2\.mlp has 4 experts there, no such MoE layer here"),
    Case("select-reap-softmax-gate-on-an-older-trace",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=lambda a: a[..., :4]), "--top", 2, "--gate",
                       "softmax", "--out", t / "s.json"],
         r"the trace's saliency sums hold no plain softmax gate \(recorded by an older moekit\): record the trace "
         r"again"),
    Case("trace-saliency-float16",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=lambda a: a.astype(np.float16)), "--top", 2,
                       "--out", t / "s.json"], r"saliency has shape \(2, 2, 4, 6\) \(float16\), expected "
                                               r"\(2, 2, 4, 6\) float64"),
    Case("trace-saliency-fractional-counts",
         lambda t, f: ["select", "usage", trace_with(t, f, saliency=set_item((0, 0, 0, 0), 0.5)), "--top", 2,
                       "--out", t / "s.json"],
         r"saliency counts \(routed token slots\) must be whole numbers"),
    Case("trace-saliency-overflows-over-languages",
         lambda t, f: ["select", "reap", trace_with(t, f, saliency=set_item((..., 0, 0, 3), 1e308)), "--top", 2,
                       "--out", t / "s.json"],
         r"saliency must hold finite, non-negative sums \(also summed over its 2 languages\)"),
    Case("trace-weights-float16",
         lambda t, f: ["select", "esft", trace_with(t, f, weights=lambda w: w.astype(np.float16)), "--target", "en",
                       "--out", t / "s.json"],
         r"routing weights are float16, expected float32"),
]

# issue 37 §5 (bad inputs helper): PEFT adapters beside the weights, hostile configs, YAML alias bombs, chat
# templates that hang or leave the sandbox, data lines that are not UTF-8 or nest too deeply


def peft_adapter(model: Path, dest: Path | None = None) -> Path:
    """A PEFT LoRA adapter of `model` saved into `dest` (default: `model` itself, beside its weights), as
    PeftModel.save_pretrained writes it; B is random (not zero), so applying it changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                          LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(dest or model)
    return dest or model


def native_with(t: Path, f: Fx, damage: Callable[[Path], object]) -> Path:
    """A copy of the tiny Qwen3-MoE that `damage` changed first."""
    model = f.copy(f.native, t / "q3")
    damage(model)
    return model


def config_set(key: str, value):
    """A change for dense_with / prune_damaged: config.json's `key` set to `value`."""
    return lambda d: edit_json(d / "config.json", lambda c: c.update({key: value}))


def dry_run_on(t: Path, f: Fx, damage: Callable[[Path], object]) -> list:
    """train --dry-run of the tiny recipe on a copy of the dense model that `damage` changed first."""
    return ["train", recipe(t, f, **{"model.path": str(dense_with(t, f, damage))}), f"out={t / 'run'}", "--dry-run"]


def laughs(levels: int = 9) -> str:
    """Billion laughs in YAML: level i is a list of ten aliases of level i-1, so level 9 expands to 10**9 items."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def chat_run(t: Path, f: Fx, template: str) -> list:
    """train on two ShareGPT records with the dense model's chat template replaced by `template`."""
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    files = [write(t / "chat.jsonl", (json.dumps(record) + "\n") * 4)]
    return also(["train", text_recipe(t, f, files, "chat")], write(t / "dense" / "chat_template.jinja", template))


SHAREGPT = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
ALPACA_LINE = json.dumps({"instruction": "say hi", "input": "", "output": "hi"})
PAIR_LINE = json.dumps({"src": "the day", "tgt": "le jour", "tgt_lang": "fr"})


def not_utf8(line: str) -> bytes:
    """`line` with byte 0xff (never UTF-8) inside its first "hi"."""
    return line.encode().replace(b"hi", b"h\xffi", 1)


DEEP = "[" * 200_000 + "]" * 200_000
ADAPTER = r"holds a PEFT adapter \(adapter_config\.json\); moekit reads only whole models: merge it into its base " \
          r"model first \(peft's merge_and_unload, then save_pretrained\)"
ISSUE37_BAD_INPUTS = [
    *(Case(f"collect-stream-{mode}-model-with-peft-adapter",
           lambda t, f, m=mode: collect(native_with(t, f, peft_adapter), t / "t.npz",
                                        *texts(("en", text(t, f))), extra=["--stream", m]), ADAPTER)
      for mode in ("on", "off")),
    Case("upcycle-dense-with-peft-adapter", lambda t, f: upc(peft_adapter(dense(t, f)), t / "o"), ADAPTER),
    Case("upcycle-peft-adapter-folder", lambda t, f: upc(peft_adapter(dense(t, f), t / "lora"), t / "o"), ADAPTER),
    Case("prune-keep-model-with-peft-adapter", lambda t, f: prune_damaged(t, f, peft_adapter), ADAPTER),
    Case("train-dry-run-hidden-size-2-40", lambda t, f: dry_run_on(t, f, config_set("hidden_size", 2**40)),
         r"model\.embed_tokens\.weight is \[128, 32\] in the weights but \[128, 1099511627776\] by its config\.json"),
    Case("train-dry-run-attention-heads-2-40",
         lambda t, f: dry_run_on(t, f, config_set("num_attention_heads", 2**40)),
         r"config\.json does not load: .*hidden size \(32\) is not a multiple of the number of attention heads "
         r"\(1099511627776\)"),
    Case("train-override-python-tag",
         lambda t, f: ["train", recipe(t, f), "model.path=!!python/object/apply:os.system [touch pwned]",
                       f"out={t / 'run'}", "--dry-run"],
         r"override 'model\.path=!!python/object/apply:os\.system \[touch pwned\]' is not valid YAML: could not "
         r"determine a constructor for the tag 'tag:yaml\.org,2002:python/object/apply:os\.system'"),
    Case("validate-recipe-yaml-alias-bomb",
         lambda t, f: ["validate", write(t / "r.yaml", f.recipe.read_text() + laughs())],
         r"r\.yaml is not valid YAML: its aliases expand to more than 100000 values \(an alias bomb\?\)",
         seconds=30),
    Case("train-override-yaml-alias-bomb",
         lambda t, f: ["validate", recipe(t, f), "train.trainer_args={" + laughs().replace("\n", ", ") + "}"],
         r"override 'train\.trainer_args=.*' is not valid YAML: its aliases expand to more than 100000 values",
         seconds=30),
    Case("upcycle-mergekit-yaml-alias-bomb",
         lambda t, f: ["upcycle", write(t / "mk.yml", f"base_model: {dense(t, f)}\n{laughs()}experts: *l9\n"), t / "o"],
         r"mk\.yml is not valid YAML: its aliases expand to more than 100000 values", seconds=30),
    Case("upcycle-config-200000-layers",
         lambda t, f: upc(dense_with(t, f, config_set("num_hidden_layers", 200_000)), t / "o"),
         r"config\.json: num_hidden_layers is 200000, but no tensor of its weights has a layer index above 3",
         seconds=30),
    # a count of layer slots (HRM-Text's num_hidden_layers beside num_layers_per_stack) may exceed the layers held
    # up to 512, not beyond
    Case("upcycle-config-5000-layer-slots",
         lambda t, f: upc(dense_with(t, f, lambda d: edit_json(d / "config.json", lambda c: c.update(
             num_hidden_layers=5000, num_layers_per_stack=4))), t / "o"),
         r"config\.json: num_hidden_layers is 5000, but no tensor of its weights has a layer index above 3",
         seconds=30),
    Case("collect-stream-on-config-200000-layers",
         lambda t, f: collect(native_with(t, f, config_set("num_hidden_layers", 200_000)), t / "t.npz",
                              *texts(("en", text(t, f))), extra=["--stream", "on"]),
         r"num_hidden_layers is 200000, but no tensor of its weights has a layer index above 2", seconds=30),
    Case("train-chat-template-loops-forever",
         lambda t, f: chat_run(t, f, "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) "
                                     "%}{% endfor %}{% endfor %}{% endfor %}"),
         r"chat\.jsonl: record \d: the tokenizer's chat template did not finish rendering within 10 s", seconds=60),
    Case("train-chat-template-leaves-the-sandbox",
         lambda t, f: chat_run(t, f, "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
         r"chat\.jsonl: record \d: the tokenizer's chat template tried to leave the Jinja sandbox \(access to "
         r"attribute '__class__' of 'str' object is unsafe\); the sandbox held and stopped it"),
    *(Case(f"text-data-{fmt}-{name}", lambda t, f, b=bad, g=good, m=fmt: ["train", text_recipe(
        t, f, [write(t / "d.jsonl", f"{g}\n{g}\n".encode() + b + b"\n")], m)], msg)
      for fmt, good in (("chat", SHAREGPT), ("alpaca", ALPACA_LINE))
      for name, bad, msg in (
          ("invalid-utf8", not_utf8(good), rf"d\.jsonl as json: line 3 is not UTF-8 \(byte 0xff at column "
                                           rf"{good.index('hi') + 2}\)"),
          ("nested-200000-deep", DEEP.encode(),
           r"d\.jsonl as json: line 3 is not valid JSON: nested deeper than Python reads$"))),
    *(Case(f"translation-jsonl-{name}",
           lambda t, f, b=bad: ["train", recipe(t, f, **{"data.train_files": [str(write(
               t / "p.jsonl", f"{PAIR_LINE}\n".encode() + b + b"\n"))]}),
                                f"out={t / 'run'}"], msg)
      for name, bad, msg in (("invalid-utf8", not_utf8(PAIR_LINE.replace("the day", "hi")),
                              rf"p\.jsonl:2: not UTF-8 \(byte 0xff at column {PAIR_LINE.index('the') + 2}\)"),
                             ("nested-200000-deep", DEEP.encode(),
                              r"p\.jsonl:2: not valid JSON: nested deeper than Python reads$"))),
]


CASES = [*GUARDS, *DRY_RUN, *REMOTE_CODE, *CHECKPOINT_FILES, *TRACES, *SELECTIONS, *NUMBERS_AND_WRONG_INPUT, *MORE,
         *LOCKS_AND_KINDS, *CONTAINMENT, *UNEXPECTED_BEFORE, *MESSAGES, *HUB_AND_MERGEKIT, *BIGGER_THAN_MEMORY,
         *BEYOND_ONE_DEVICE, *SPEECH_LLM, *PRUNING_AND_SELECTIONS,
         *ISSUE37_BAD_INPUTS, *FUZZ_FINDS, *SPEECH_LLM_TRANSCRIPTS]

# issue 37 §6 (model cards and the mergekit command line)
def llama_base_gpt2_expert(t: Path, f: Fx) -> Path:
    """A mergekit-moe config with a Llama base (gate/up/down FFNs) and a GPT-2 expert (c_fc/c_proj): expert sources
    give their FFN tensors only, and this one has none of the base's."""
    from moekit.testing import tiny_gpt2

    tiny_gpt2().save_pretrained(t / "gpt2")
    return write(t / "mk.yml", yaml.safe_dump({"base_model": str(dense(t, f)), "gate_mode": "random",
                                                "experts": [{"source_model": str(dense(t, f, "d2"))},
                                                            {"source_model": str(t / "gpt2")}]}))


CASES += [
    Case("mergekit-crimes-tensors-differ",
         lambda t, f: (["upcycle", llama_base_gpt2_expert(t, f), "--allow-crimes", t / "o"], t / "o"),
         r"gpt2 \(GPT2LMHeadModel\) and the base model .*dense \(LlamaForCausalLM\) mix architectures whose tensors "
         r"differ: the first has no model\.layers\.0\.mlp\.gate_proj\.weight$"),
]


# issue 39 (more): a recipe's model.path holding an upcycled checkpoint is trained as it is only if it was upcycled
# with the recipe's own MoE spec, and in moekit's format

def upcycled_qwen3_asr(t: Path) -> Path:
    """A tiny Qwen3-ASR upcycled with 4 experts (spri_s2tt.yaml has 8), saved in moekit's format."""
    from moekit.checkpoint.dense import load_dense
    from moekit.checkpoint.format import save
    from moekit.moe.spec import MoESpec
    from moekit.testing.speech_llm import save_tiny_qwen3_asr
    from moekit.checkpoint.upcycle_model import upcycle

    dense = load_dense(save_tiny_qwen3_asr(t / "qwen3_asr_dense"))
    return save(upcycle(dense, MoESpec(num_experts=4, top_k=2, every=4, shared_expert=True, init="spri")), t / "up")


OTHER_SPEC = (r"was upcycled with moe\.shared_expert=False \(its moekit.json\), the recipe has moe\.shared_expert=True: "
              r"give the recipe the checkpoint's spec, or start from the dense model$")
CASES += [
    Case("train-upcycled-checkpoint-other-spec",
         lambda t, f: ["train", recipe(t, f), f"model.path={moe(t, f)}", f"out={t / 'run'}"], OTHER_SPEC),
    Case("train-dry-run-upcycled-checkpoint-other-spec",
         lambda t, f: ["train", recipe(t, f), f"model.path={moe(t, f)}", "--dry-run"], OTHER_SPEC),
    Case("train-upcycled-checkpoint-native-format",
         lambda t, f: ["train", recipe(t, f), f"out={t / 'run'}", "model.path=" + str(also(
             f.copy(f.native, t / "native"), write(t / "native" / "moekit_spec.json", "{}")))],
         r"native is an upcycled checkpoint in a native MoE format \(moekit_spec.json\); method=moe trains a dense "
         r"model or its upcycled checkpoint in moekit's format$"),
    Case("train-s2tt-upcycled-checkpoint-other-experts", lambda t, f: [*s2tt(t), f"model.path={upcycled_qwen3_asr(t)}"],
         r"up was upcycled with moe\.num_experts=4 \(its moekit.json\), the recipe has moe\.num_experts=8"),
    Case("train-dry-run-s2tt-model-without-processor",  # the plan's sequence length comes from the processor
         lambda t, f: [*s2tt(t), "--dry-run", "model.path=" + str(also(t / "qwen3_asr", *(
             p.unlink() for p in (t / "qwen3_asr").iterdir() if p.name.startswith(("processor", "tokenizer")))))],
         r"qwen3_asr has no usable processor: "),
]

# i37-rest (issue 37 leftovers: finetune --dry-run's selection check, a config wider than its weights on every load
# path, mergekit expert sources with FFN tensors only)
CASES += [
    Case("finetune-dry-run-selection-of-a-layer-the-model-lacks",
         lambda t, f: ["finetune", "--model", moe(t, f), "--experts",
                       other_model_sel(t, {f.layers[0]: [0]}, {f.layers[0]: 4, "model.layers.2.mlp": 4}),
                       "--data", f"en={text(t, f)}", "--out", t / "ft", "--dry-run"],
         OTHER + r"model\.layers\.2\.mlp has 4 experts there, no such MoE layer here"),
    # a config declaring 200,000 experts over 8-expert weights: refused on every load path before its size is
    # allocated (before the fix: 1.7 GiB of per-expert names for the shape check, 5 GiB of experts streamed)
    *(Case(f"config-200000-experts-{name}", lambda t, f, a=argv: a(t, native_with(t, f, config_set(
        "num_local_experts", 200_000))), re.escape(f"q3: model.layers.0.mlp.gate.weight is [8, 32] in the weights "
                                                  "but [200000, 32] by its config.json") + "$")
      for name, argv in (("inspect", lambda t, m: ["inspect", m]),
                         *((f"collect-stream-{mode}", lambda t, m, mode=mode: collect(
                             m, t / "t.npz", "en=" + str(write(t / "en.txt", "the day\n")), extra=["--stream", mode]))
                           for mode in ("on", "off")),
                         ("prune", lambda t, m: ["prune", "--model", m, "--experts", native_sel(t), "--out", t / "p"]),
                         ("prune-keep", lambda t, m: ["prune", "--model", m, "--experts", native_sel(t), "--keep",
                                                      "--out", t / "p"]))),
    *(Case(f"moekit-json-200000-experts-{name}", lambda t, f, a=argv: a(t, moe_with(t, f, lambda d: edit_json(
        d / "moekit.json", lambda m: [dig(m, f"layers.{i}.layout.num_experts", 200_000) for i in (0, 1)]))),
           r"moe/model\.safetensors: model\.layers\.1\.mlp\.router\.weight is F32\[4, 32\], the metadata says "
           r"float32\[200000, 32\]$")
      for name, argv in (*((f"collect-stream-{mode}", lambda t, m, mode=mode: collect(
                             m, t / "t.npz", "en=" + str(write(t / "en.txt", "the day\n")), extra=["--stream", mode]))
                           for mode in ("on", "off")),
                         ("export", lambda t, m: ["export", m, "--format", "mixtral", "--out", t / "e"]))),
]


def params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.bug)] if c.bug else [])
            for c in cases]


def test_ids_are_distinct_and_enough():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 110


@pytest.mark.parametrize("case", params(CASES))
def test_bad_input(case, fx, tmp_path, run, monkeypatch):
    check(run, case, tmp_path, fx, monkeypatch)


# ---------------------------------------------------------------------------------------------- positive controls


@pytest.mark.parametrize("form", ["one-flag", "two-flags"])
def test_texts_of_two_languages_are_accepted_in_both_forms(form, fx, tmp_path, run, monkeypatch):
    """The repeated-language refusal does not catch distinct languages, in either form of the option."""
    monkeypatch.chdir(tmp_path)
    en, fr = text(tmp_path, fx), text(tmp_path, fx, "fr")
    given = {"one-flag": ["--texts", f"en={en}", f"fr={fr}"],
             "two-flags": ["--texts", f"en={en}", "--texts", f"fr={fr}"]}[form]
    rc, _, err = run("routes", "collect", "--model", fx.moe, *given, "--out", tmp_path / "t.npz", "--max-length", 16)
    assert rc == 0, err
    from moekit.routing.trace import RoutingTrace

    assert RoutingTrace.load(tmp_path / "t.npz").languages == ["en", "fr"]
    assert sorted(os.listdir(tmp_path)) == ["en.txt", "fr.txt", "t.npz"]  # no lock or temporary left


def test_overwrite_of_an_earlier_output_still_works(fx, tmp_path, run, monkeypatch):
    """The guards refuse what they must, not an ordinary --overwrite of an earlier output."""
    monkeypatch.chdir(tmp_path)
    out = write(tmp_path / "s.json", "{}")
    rc, _, err = run("select", "topk", fx.trace, "--target", "en", "--budget", 2, "--out", out, "--overwrite")
    assert rc == 0, err
    assert json.loads(out.read_text())["method"] == "topk"
    assert os.listdir(tmp_path) == ["s.json"]  # no lock or temporary left


def test_report_and_selection_read_padding_slots(fx, tmp_path, run, monkeypatch):
    """Expert id -1 pads a slot (a smaller top-k): `routes report` and `select` leave such slots out, also when a
    padding slot carries the largest weight or a token has no expert at a layer (np.bincount on -1 crashed)."""
    monkeypatch.chdir(tmp_path)

    def pad(ids):
        ids[0, 0, 0] = -1  # one slot of token 0 at layer 0
        ids[1, 1, :] = -1  # every slot of token 1 at layer 1
        return ids

    trace = trace_with(tmp_path, fx, ids=pad, weights=lambda w: set_item((0, 0, 0), 9.0)(w))
    rc, _, err = run("routes", "report", trace, "--out", tmp_path / "r")
    assert rc == 0, err
    metrics = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert metrics and (tmp_path / "r" / "report.md").is_file()
    from moekit.routing.trace import RoutingTrace
    from moekit.routing import stats

    t = RoutingTrace.load(trace)
    choice = stats.top1(t)
    assert choice[0, 0] == t.ids[0, 0, 1] and choice[1, 1] == -1  # the padding slot never wins
    table = stats.contingency(choice[0], choice[1], 4, 4)
    assert table.sum() == (choice[0] >= 0).sum() - 1  # token 1 has no expert at layer 1: left out
    rc, _, err = run("select", "topk", trace, "--target", "en", "--budget", 2, "--out", tmp_path / "s.json")
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------- issue 37 §5 (bad inputs helper): tests that are no rows


def test_a_1_gib_model_card_is_read_only_for_its_header(tmp_path):
    """The card's base_model comes from README.md's YAML header within its first 64 KiB: a 1 GiB README (sparse here)
    is not read whole (it was: 2.38 GiB peak), and the header is still found."""
    import tracemalloc

    from moekit.checkpoint.card import CARD_HEADER_BYTES, card_base_model

    readme = write(tmp_path / "README.md", "---\nbase_model: org/base\n---\n\n# a card\n")
    os.truncate(readme, 1 << 30)
    tracemalloc.start()
    try:
        found = card_base_model(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == "org/base"
    assert peak < 4 * CARD_HEADER_BYTES, f"{peak} bytes allocated"
    write(tmp_path / "README.md", "---\nbase_model: org/base\n" + "x" * CARD_HEADER_BYTES + "\n---\n")
    assert card_base_model(tmp_path) is None  # a header that does not end within the bytes read is not guessed at


HANG = """import sys, time
import moekit.checkpoint.remove, moekit.routing.streamed as streamed
from moekit.cli.main import main
streamed.needs_spill = lambda *a: True  # the calibration set is too large to keep in memory: spill it
streamed._run_layer = moekit.checkpoint.remove.report = lambda *a, **k: time.sleep(600)  # stop mid-way
sys.exit(main(sys.argv[1:]))
"""


def killed_midway(argv: list, tmp: Path, leftover: Callable[[], list[Path]]) -> list[Path]:
    """Run the CLI with `argv` in a subprocess made to hang mid-way (HANG), SIGKILL it once `leftover()` (its
    temporaries) lists something with a file in it, and return what it left."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HANG, *map(str, argv)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not any(p.is_dir() and any(p.iterdir()) for p in leftover()):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no temporary appeared within 240 s"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    return leftover()


def test_collect_killed_midway_leaves_nothing_after_the_next_run(fx, tmp_path, run, monkeypatch):
    """routes collect --stream on, SIGKILLed while its hidden states are spilled: the next run removes the spill
    folder and the dead lock, writes the same trace as an uninterrupted run, and changes nothing else."""
    import tempfile

    from moekit.routing import streamed
    from moekit.routing.trace import RoutingTrace

    work, scratch = tmp_path / "work", tmp_path / "scratch"
    model, en = fx.copy(fx.native, work / "q3"), text(work, fx)
    write(scratch / "keep.txt", "someone else's temporary file")
    argv = collect(model, work / "t.npz", *texts(("en", en)), extra=["--stream", "on", "--max-length", 16])
    before = {d: snapshot(d) for d in (work, scratch)}
    left = killed_midway(argv, scratch, lambda: sorted(scratch.glob(f".{streamed.SPILL}.moekit-tmp-*")))
    assert len(left) == 1 and (work / ".t.npz.moekit-lock").is_file()  # what SIGKILL left
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(streamed, "needs_spill", lambda *a: True)
    rc, _, err = run(*argv)
    assert rc == 0, err
    assert snapshot(scratch) == before[scratch]  # the spill folder gone, nothing else touched
    after = snapshot(work)
    assert {k: v for k, v in after.items() if k != "t.npz"} == before[work]  # lock gone, inputs unchanged
    rc, _, err = run(*collect(model, tmp_path / "ref.npz", *texts(("en", en)), extra=argv[-4:]))
    assert rc == 0, err
    got, ref = RoutingTrace.load(work / "t.npz"), RoutingTrace.load(tmp_path / "ref.npz")
    assert np.array_equal(got.ids, ref.ids) and np.array_equal(got.weights, ref.weights)


def test_prune_killed_midway_leaves_nothing_after_the_next_run(fx, tmp_path, run, monkeypatch):
    """prune --keep, SIGKILLed while it writes the pruned checkpoint: the next run removes the dead run's temporary
    output and lock, writes the same checkpoint as an uninterrupted run, and changes nothing else."""
    work = tmp_path / "work"
    model, sel = fx.copy(fx.native, work / "q3"), native_sel(work)
    argv = ["prune", "--model", model, "--experts", sel, "--keep", "--out", work / "p"]
    before = snapshot(work)
    left = killed_midway(argv, tmp_path, lambda: sorted(work.glob(".p.moekit-tmp-*")))
    assert len(left) == 1 and (work / ".p.moekit-lock").is_file()  # what SIGKILL left
    rc, _, err = run(*argv)
    assert rc == 0, err
    after = snapshot(work)
    assert {k: v for k, v in after.items() if not k.startswith("p")} == before  # temporary and lock gone
    rc, _, err = run(*argv[:-1], tmp_path / "ref")
    assert rc == 0, err
    ref = snapshot(tmp_path / "ref")
    assert {k.removeprefix("p/"): v for k, v in after.items() if k.startswith("p/") and k != "p/README.md"} == \
        {k: v for k, v in ref.items() if k != "README.md"}  # the card names the command, which differs


def test_a_layer_count_beyond_any_model_is_refused_where_no_weights_tell():
    """Without safetensors to compare with (a GGUF's metadata), a layer count above MAX_LAYERS is refused outright,
    in sub-configs too; MAX_LAYERS itself is accepted."""
    from moekit.checkpoint.dense import MAX_LAYERS, check_layer_limit
    from moekit.errors import CheckpointError

    check_layer_limit({"num_hidden_layers": MAX_LAYERS, "text_config": {"n_layer": 2}}, "c")
    with pytest.raises(CheckpointError, match=r"^c: text_config\.num_layers is 10001, more layers than any model"):
        check_layer_limit({"text_config": {"num_layers": MAX_LAYERS + 1}}, "c")
