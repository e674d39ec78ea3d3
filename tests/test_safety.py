"""Nothing the user owns is lost, no code runs without consent: real signals, a real size limit, two real
writers, a real remote-code directory (subprocesses), and the guarantees of moekit._fs in-process."""
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moekit import _fs
from moekit.errors import OutputBusyError, OutputExistsError, UnsafeOutputError, WriteError
from moekit.testing import tiny_llama, tiny_tokenizer

# the CLI with the streaming writer slowed down: it writes the weights into the temporary directory, signals
# READY (a file) and waits (until the file RELEASE exists, at most SLEEP s), so that a test can act while a save is half-way
SLOW_SAVE = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import moekit.checkpoint.upcycle as up
    from moekit.cli.main import main

    write = up.write_units

    def slow(folder, *args, **kwargs):
        n = write(folder, *args, **kwargs)
        Path(os.environ["READY"]).write_text(str(folder))
        release, deadline = os.environ.get("RELEASE"), time.monotonic() + float(os.environ.get("SLEEP", "60"))
        while time.monotonic() < deadline and not (release and Path(release).exists()):
            time.sleep(0.05)
        return n

    up.write_units = slow
    sys.exit(main(sys.argv[1:]))
''')


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root, hidden ones included (directories as "dir")."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense") / "dense"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def cli(tmp_path, *args, probe: str | None = None, env=None, preexec_fn=None, **kw) -> subprocess.Popen:
    script = None
    if probe is not None:
        script = tmp_path / "probe.py"
        script.write_text(probe)
    cmd = [sys.executable, *([str(script)] if script else ["-m", "moekit"]), *map(str, args)]

    def child_setup():
        # SIGINT at its default, as from a terminal: a shell running the tests in the background
        # (`make test &`) ignores it, and Python then never raises KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, preexec_fn=child_setup, **kw)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended early: {proc.communicate()}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError("timed out waiting for the save to start")
        time.sleep(0.05)


def last_line(err: str) -> str:
    """The one `moekit: ...` line a failed command prints last (progress lines may precede it), no traceback."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [x for x in lines if x.startswith("moekit:")] == lines[-1:], err
    return lines[-1]


def upcycle_args(dense, out, *extra):
    return ["upcycle", "--model", dense, "--experts", 4, "--top-k", 2, "--out", out, *extra]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
@pytest.mark.parametrize("existing", [False, True])
def test_signal_mid_save_leaves_nothing_and_keeps_the_old_output(dense, tmp_path, sig, code, existing):
    out = tmp_path / "work" / "moe"
    if existing:  # --overwrite of an existing output: the old one must survive the interrupted save
        out.mkdir(parents=True)
        (out / "old.txt").write_text("the previous output")
    (tmp_path / "work").mkdir(exist_ok=True)
    before = snapshot(tmp_path / "work")
    ready = tmp_path / "ready"
    proc = cli(tmp_path, *upcycle_args(dense, out, *(["--overwrite"] if existing else [])), probe=SLOW_SAVE,
               env={"READY": str(ready)})
    wait_for(ready, proc)
    assert Path(ready.read_text()).is_dir()  # the half-written temporary exists right now
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert last_line(err).startswith("moekit: interrupted")
    assert snapshot(tmp_path / "work") == before  # no temporary, no lock, the old output byte for byte


def test_a_command_run_in_process_leaves_the_callers_signal_handlers_as_they_were(run):
    """main() makes SIGTERM and SIGHUP raise only while its command runs. Left raising, they made a pytest that
    had run a command in-process unkillable by `timeout` while stuck in native code (a GPU run, 2026-11-29)."""
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    before = [signal.getsignal(s) for s in sigs]
    rc, out, _ = run("list", "formats")
    assert rc == 0 and out
    assert [signal.getsignal(s) for s in sigs] == before


def test_size_limit_is_one_line_and_leaves_nothing(dense, tmp_path):
    """EFBIG (RLIMIT_FSIZE in the child, like a full disk): one line, exit 2, no leftovers."""
    out = tmp_path / "work" / "moe"
    (tmp_path / "work").mkdir()
    limit = 64 * 1024  # the tiny MoE checkpoint is several times larger

    def limit_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = cli(tmp_path, *upcycle_args(dense, out), preexec_fn=limit_size)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    line = last_line(err)
    assert line.startswith("moekit: error: cannot write") and "File too large" in line
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.parametrize("command", ["upcycle", "export", "select"])
def test_a_full_disk_before_the_lock_is_written_leaves_no_lock(dense, tmp_path, command):
    """No room for the lock's few bytes (RLIMIT_FSIZE 8 bytes in the child, room for Python's own start-up: EFBIG
    in the lock's write): one line, exit 2, no lock file (an empty one was left before), the inputs unchanged."""
    work = tmp_path / "work"
    work.mkdir()
    argv = {"upcycle": upcycle_args(dense, work / "o"),
            "export": ["export", dense, "--format", "mixtral", "--out", work / "o"],
            "select": ["select", "topk", dense / "config.json", "--target", "en", "--budget", 1, "--out", work / "o"]}
    before = snapshot(dense)

    def no_room():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8, 8))

    proc = cli(tmp_path, *argv[command], preexec_fn=no_room)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert last_line(err).startswith(f"moekit: error: cannot write {work / 'o'}: File too large"), err
    assert list(work.iterdir()) == [] and snapshot(dense) == before


def test_a_lock_is_never_taken_from_what_moekit_did_not_create(tmp_path):
    """An entry with the lock's name that moekit did not write (a file, a link, a directory) is refused and left
    as it was; a dead moekit process's lock is replaced; a live one's is busy."""
    out = tmp_path / "out"
    lock = tmp_path / f".out{_fs.LOCK}"
    for make in (lambda: lock.write_text("12345"), lambda: lock.symlink_to(tmp_path / "t"), lock.mkdir):
        make()
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(UnsafeOutputError, match="is not a moekit lock; moekit does not touch it"):
            with _fs.output(out):
                pass
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        _fs.remove(lock)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"moekit-lock pid {dead.pid}\n")  # left by a moekit killed with SIGKILL
    with _fs.output(out) as tmp:
        (tmp / "x").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_second_writer_fails_at_once_and_the_first_finishes(dense, tmp_path):
    out = tmp_path / "moe"
    ready = tmp_path / "ready"
    release = tmp_path / "release"  # the first writer stays mid-save until the second has returned
    first = cli(tmp_path, *upcycle_args(dense, out), probe=SLOW_SAVE,
                env={"READY": str(ready), "RELEASE": str(release), "SLEEP": "300"})
    wait_for(ready, first)
    second = cli(tmp_path, *upcycle_args(dense, out, "--overwrite"))
    _, err = second.communicate(timeout=240)
    assert second.returncode == 2 and "being written by another moekit process" in last_line(err)
    assert first.poll() is None  # at once: it did not wait for the first writer, still mid-save
    release.write_text("")
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert (out / "moekit.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe", "probe.py", "ready", "release"]  # no lock, no temporary


def test_temporaries_of_dead_processes_are_removed_live_ones_kept(dense, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".moe{_fs.TMP}{dead.pid}-deadbeef"  # named as moekit names its temporaries
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".moe{_fs.TMP}{os.getpid()}-0123abcd"  # this test process is alive
    live.mkdir()
    notes = tmp_path / f".moe{_fs.TMP}{dead.pid}-notes"  # a user's file that only starts like one
    notes.write_text("mine")
    proc = cli(tmp_path, *upcycle_args(dense, tmp_path / "moe"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert not stale.exists() and live.is_dir() and notes.read_text() == "mine"


def remote_code_dir(tmp_path: Path, marker: Path, where: str) -> Path:
    """A tiny Llama directory whose config (or tokenizer config) names its own Python module; importing the
    module writes `marker`."""
    folder = tmp_path / "custom"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "custom_code.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    f = folder / where
    data = json.loads(f.read_text())
    data["auto_map"] = {"AutoConfig": "custom_code.Config", "AutoModelForCausalLM": "custom_code.Model",
                        "AutoTokenizer": ["custom_code.Tokenizer", None]}
    f.write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("command", ["upcycle", "routes"])
def test_remote_code_never_runs_without_the_flag_even_if_stdin_says_yes(tmp_path, where, command):
    marker = tmp_path / "MARKER"
    folder = remote_code_dir(tmp_path, marker, where)
    (tmp_path / "en.txt").write_text("a b c\n")
    args = (upcycle_args(folder, tmp_path / "out") if command == "upcycle" else
            ["routes", "collect", "--model", folder, "--texts", f"en={tmp_path / 'en.txt'}", "--out", tmp_path / "t.npz"])
    proc = cli(tmp_path, *args, stdin=subprocess.PIPE)
    out, err = proc.communicate("y\ny\ny\n", timeout=120)
    assert proc.returncode == 2, err
    assert "--trust-remote-code" in last_line(err)
    assert not marker.exists() and not (tmp_path / "out").exists() and not (tmp_path / "t.npz").exists()
    assert "[y/N]" not in out + err  # nobody was asked


# ----- moekit._fs in-process -----

def test_guard_refuses_inputs_cwd_ancestors_and_links(tmp_path, monkeypatch):
    model = tmp_path / "proj" / "dense"
    model.mkdir(parents=True)
    monkeypatch.chdir(model)
    for out, why in [(model, "is input"), (tmp_path / "proj", "contains input"), (tmp_path, "contains input")]:
        with pytest.raises(UnsafeOutputError, match=why):
            _fs.guard(out, [model], overwrite=True)
    monkeypatch.chdir(tmp_path / "proj")
    with pytest.raises(UnsafeOutputError, match="the working directory"):
        _fs.guard(tmp_path, [], overwrite=True)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeOutputError, match="symbolic link"):
        _fs.guard(tmp_path / "link", [], overwrite=True)
    assert _fs.guard(model / "moe", [model]) == model / "moe"  # inside an input is fine: nothing is replaced
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UnsafeOutputError, match="not a directory"):
        _fs.guard(tmp_path / "afile" / "out", [])
    with pytest.raises(WriteError, match="disk space"):
        _fs.guard(tmp_path / "big", [], need_bytes=1 << 62)


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_swaps_in_the_complete_output(tmp_path, monkeypatch, exchange):
    if not exchange:  # the move-aside fallback of file systems without RENAME_EXCHANGE
        monkeypatch.setattr(_fs, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with _fs.output(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
        assert (out / "old").read_text() == "old"  # untouched until the new output is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["new"]


def test_failure_keeps_the_old_output_and_removes_new_parents(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError), _fs.output(out) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []  # the parents it created are gone too


def test_an_output_that_appears_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="appeared while"), _fs.output(out) as tmp:
        (tmp / "mine").write_text("x")
        out.mkdir()
        (out / "theirs").write_text("keep")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "theirs").read_text() == "keep"
    f = tmp_path / "f.json"
    with pytest.raises(OutputExistsError), _fs.output(f, kind="file") as tmp:
        tmp.write_text("mine")
        f.write_text("theirs")
    assert f.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "out"]


def test_one_writer_per_output_and_reservation_is_reentrant(tmp_path):
    out = tmp_path / "out"
    with _fs.reserve(out, [tmp_path / "in"]):
        lock = _fs._Lock(out)
        with pytest.raises(OutputBusyError, match=f"pid {os.getpid()}"):
            lock.acquire()  # another open file description: as another process would
        with pytest.raises(UnsafeOutputError):  # the reserved inputs still apply inside
            with _fs.output(out, [out / "x"]):
                pass
        with _fs.output(out) as tmp:  # the library's own write, under the reservation
            (tmp / "x").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # lock file removed
    errors = []

    def writer():
        try:
            with _fs.output(tmp_path / "race", overwrite=True) as tmp:
                (tmp / "x").write_text("1")
                time.sleep(0.2)
        except OutputBusyError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and (tmp_path / "race" / "x").is_file()


def test_partial_is_kept_only_when_asked(tmp_path):
    out = tmp_path / "run"
    work = tmp_path / f".run{_fs.PARTIAL}"
    with pytest.raises(KeyboardInterrupt), _fs.output(out, partial=True, keep=lambda w: (w / "ckpt").exists()) as tmp:
        (tmp / "ckpt").write_text("step 2")
        raise KeyboardInterrupt
    assert (work / "ckpt").read_text() == "step 2" and not out.exists()
    with _fs.output(out, partial=True) as tmp:  # reused, then renamed
        assert (tmp / "ckpt").is_file()
    assert (out / "ckpt").is_file() and not work.exists()


def test_write_faults_are_recognized():
    assert _fs.write_errno(OSError(28, "No space left on device")) == 28
    assert _fs.write_errno(Exception("Error while serializing: IoError(File too large (os error 27))")) == 27
    assert _fs.write_errno(ValueError("bad value")) is None
    with pytest.raises(WriteError, match="No space left"):
        with _fs.output(Path(os.environ.get("TMPDIR", "/tmp")) / f"moekit-enospc-{os.getpid()}") as tmp:
            raise OSError(28, "No space left on device", str(tmp))


def test_read_small_refuses_devices_and_huge_files(tmp_path):
    from moekit.errors import MoekitError

    with pytest.raises(MoekitError, match="not a regular file"):
        _fs.read_small("/dev/zero", "index")
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(2 << 20)
    with pytest.raises(MoekitError, match="refused"):
        _fs.read_small(big, "index", limit=1 << 20)


@pytest.mark.parametrize("command", ["list", "upcycle"])
def test_closed_standard_output_is_one_error_before_any_work(dense, tmp_path, command):
    """`moekit ... >&-`: one error line (standard output is closed) and no output written, where the command once
    wrote its output and then failed with AttributeError on sys.stdout.isatty."""
    args = ["list", "formats"] if command == "list" else upcycle_args(dense, tmp_path / "moe")
    proc = cli(tmp_path, *args, preexec_fn=lambda: os.close(1))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == ["moekit: error: standard output is closed: moekit prints its results there; "
                                        "redirect it to a file or /dev/null instead of closing it"]
    assert not (tmp_path / "moe").exists()
