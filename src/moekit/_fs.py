"""Safe outputs: every file or directory moekit writes goes through `output()`.

What it guarantees (docs/safety.md):

* **Nothing the user did not name is touched.** Before any work, `guard()` refuses an output that
  equals or contains an input of the command, the working directory, or an ancestor of either, an
  output that is a symbolic link, an existing output without `overwrite`, an unwritable parent and a
  disk without room for the expected bytes.
* **One writer per output.** An exclusive `flock` on `.NAME.moekit-lock` beside the output is held
  from the first check to the final rename; a second writer fails at once. The lock file is created
  complete and locked under a unique name and then linked into place, so an existing entry of that name
  (a user's file, a symbolic link, a directory) is never opened for writing, truncated or removed: it is
  refused unless it is a moekit lock, and a dead holder's lock is replaced (`_Lock`).
* **Complete or nothing.** The output is built in a temporary sibling `.NAME.moekit-tmp-PID-XXXX` and
  renamed into place only when complete; an existing output (with `overwrite`) is swapped out
  atomically (`renameat2(RENAME_EXCHANGE)` where the kernel has it). A failure, Ctrl-C, SIGTERM or
  SIGHUP removes the temporary. Temporaries of dead processes are removed by the next writer.
* **Write faults are one line.** ENOSPC, EFBIG, EDQUOT, EACCES, EPERM and EROFS become `WriteError`.

Leaf module: no torch, no transformers.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from moekit.errors import MoekitError, OutputBusyError, OutputExistsError, UnsafeOutputError, WriteError

TMP, LOCK, PARTIAL = ".moekit-tmp-", ".moekit-lock", ".moekit-partial"
_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
_RUST_OS_ERROR = re.compile(r"os error (\d+)")  # safetensors (Rust) reports I/O errors in its message
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that every cleanup runs (the CLI exits 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within, SIGTERM and SIGHUP left at their default (which kills without cleanup) raise `Terminated`, as SIGINT
    raises KeyboardInterrupt; on leaving, they are as they were. Main thread only. Around every write, and around
    each CLI command: a command run in-process (a test, a notebook) must not leave its caller's SIGTERM raising
    in Python code only, which a process stuck in native code never reaches (`timeout` could not end such a
    pytest on the GPU machine, 2026-11-29)."""
    changed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                changed.append(sig)
                signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig in changed:
            signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Signals that arrive during cleanup or the final rename are delivered after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def guard(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
          need_bytes: int = 0, what: str = "output", kind: str = "dir") -> Path:
    """Check, before any work, that `out` may be written (see the module docstring); returns its real path.

    `inputs` are every file or directory the command reads (model, data, recipe, trace, selection, ...). An
    output may lie inside an input directory only while it does not exist (a new file there loses nothing).
    `kind` ("dir" or "file") is what the output will be: `overwrite` replaces a directory by a directory and a
    regular file by a regular file, never one kind by another.
    """
    given = Path(out)
    if given.is_symlink():
        raise UnsafeOutputError(f"the {what} {given} is a symbolic link; give the path it points to")
    if kind == "file" and str(out).endswith(("/", os.sep)):
        raise UnsafeOutputError(f"the {what} {out} names a directory (a trailing '/'), and the {what} is a file")
    real = _real(given)
    exists = real.exists()
    for name, path in [*((f"input {p}", _real(p)) for p in inputs), ("the working directory", _real(os.getcwd()))]:
        inside = exists and path in real.parents and name.startswith("input")  # an existing file of an input
        if real == path or real in path.parents or inside or (exists and _same_file(real, path)):
            holds = "is" if real == path or _same_file(real, path) else "contains" if real in path.parents \
                else "is inside"
            raise UnsafeOutputError(f"the {what} {given} {holds} {name}; choose another {what} path")
    hub = _real(hub_cache())
    if real == hub or hub in real.parents:
        raise UnsafeOutputError(f"the {what} {given} is inside the Hugging Face cache {hub}, which only "
                                f"huggingface_hub writes; choose another {what} path")
    if exists and not overwrite and (not real.is_dir() or any(real.iterdir())):
        raise OutputExistsError(real, f"{given} exists{' and is not empty' if real.is_dir() else ''}")
    if exists and (real.is_dir() if kind == "file" else not real.is_dir() if kind == "dir" else False):
        has, wants = ("a directory", "a file") if kind == "file" else ("not a directory", "a directory")
        raise UnsafeOutputError(f"{given} exists and is {has}, and the {what} is {wants}; overwrite replaces an "
                                f"output of the same kind only: choose another {what} path or remove {given}")
    if exists and kind == "file" and not stat.S_ISREG(os.stat(real).st_mode):
        raise UnsafeOutputError(f"{given} exists and is not a regular file; choose another {what} path")
    anchor = _existing_ancestor(real.parent)
    if not anchor.is_dir():
        raise UnsafeOutputError(f"cannot create {given}: {anchor} is not a directory")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write {given}: {anchor} is not writable")
    check_space(given, need_bytes)
    return real


def _same_file(a: Path, b: Path) -> bool:
    """Whether two existing paths are one file (a hard link of an input is that input)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def hub_cache() -> Path:
    """The Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), read now."""
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub")


def check_space(out: str | os.PathLike, need_bytes: int) -> None:
    """WriteError unless the file system that will hold `out` has `need_bytes` free."""
    anchor = _existing_ancestor(_real(out).parent)
    free = shutil.disk_usage(anchor).free
    if need_bytes > free:
        raise WriteError(f"not enough disk space for {out}: it needs about {size_text(need_bytes)}, "
                         f"{size_text(free)} are free on the file system of {anchor} "
                         f"({size_text(need_bytes - free)} short)")


def size_text(n: int) -> str:
    """Bytes for people, three significant digits: 950 bytes, 12.3 MB, 1.02 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def peak_memory() -> int:
    """This process's peak resident memory in bytes: VmHWM (its own address space; ru_maxrss would also count
    the parent's resident memory at fork), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_memory() -> int:
    """Bytes of memory this machine can give a process now (Linux MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def write_errno(exc: BaseException) -> int | None:
    """The errno of a disk or permission fault anywhere in `exc`'s chain (OSError, or a Rust I/O error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = exc.errno if isinstance(exc, OSError) else None
        if code is None and (m := _RUST_OS_ERROR.search(str(exc))):
            code = int(m.group(1))
        if code in _WRITE_ERRNOS:
            return code
        exc = exc.__cause__ or exc.__context__
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _remove_stale(parent: Path, name: str) -> None:
    """Temporaries and lock temporaries of `name` left by processes that died (e.g. SIGKILL, power loss): only
    entries named exactly as moekit names them (its pid and an 8-hex-digit token) and owned by this user, so a
    user's file that merely starts like one (`.s.json.moekit-tmp-999999-notes`) is never touched."""
    pattern = re.compile(f"(?:{re.escape(f'.{name}{TMP}')}|{re.escape(f'.{name}{LOCK}')}-)(\\d+)-[0-9a-f]{{8}}")
    for entry in parent.iterdir():
        m = pattern.fullmatch(entry.name)
        pid = m and int(m.group(1))
        if pid and pid != os.getpid() and not _pid_alive(pid) and entry.lstat().st_uid == os.getuid():
            remove(entry)


def scratch(name: str) -> Path:
    """A new empty directory `.NAME.moekit-tmp-PID-XXXXXXXX` (this user's only) in the system's temporary directory,
    for work files the caller removes (`remove`) when done; the ones that killed processes left (SIGKILL) are
    removed first (`_remove_stale`: nothing else is touched)."""
    parent = Path(tempfile.gettempdir())
    _remove_stale(parent, name)
    path = parent / f".{name}{TMP}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


class _Lock:
    """An exclusive flock on `.NAME.moekit-lock` beside the output, held from the first check to the final
    rename (see the module docstring).

    The lock file is written in full (`moekit-lock pid N`) and flocked under a unique temporary name, then
    linked to the lock name, which fails if anything holds that name: so the name only ever shows a complete,
    locked moekit lock, and nothing that was there before is opened for writing, truncated or removed. An
    existing entry of that name is a moekit lock whose holder is alive (busy), a moekit lock whose holder died
    (no flock: removed, then acquired), or something else, which is refused untouched. The holder removes the
    lock on release, and only while the name still holds the file it created.
    """

    _CONTENT = re.compile(rb"moekit-lock pid (\d+)\n")

    def __init__(self, out: Path):
        self.path, self.out, self.fd = out.parent / f".{out.name}{LOCK}", out, None

    def acquire(self) -> None:
        fd = self._locked_temporary()
        try:
            while True:
                try:
                    os.link(self._tmp, self.path, follow_symlinks=False)
                    break
                except FileExistsError:
                    self._clear_stale()
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
        self.fd = fd

    def _locked_temporary(self) -> int:
        self._tmp = self.path.with_name(f"{self.path.name}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            content = memoryview(f"moekit-lock pid {os.getpid()}\n".encode())
            while content:  # a short write (a file size limit) is followed by one that raises
                content = content[os.write(fd, content):]
        except BaseException:
            os.close(fd)
            os.unlink(self._tmp)
            raise
        return fd

    def _clear_stale(self) -> None:
        """The lock name is taken: busy if a live process holds it, removed if it is a dead moekit process's
        lock, refused untouched if it is anything else."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return  # its holder released it meanwhile: try again
        except OSError:  # a symbolic link (ELOOP), ...
            fd = None
        try:
            st = os.fstat(fd) if fd is not None else None
            content = os.pread(fd, 64, 0) if st is not None and stat.S_ISREG(st.st_mode) else b""
            match = self._CONTENT.fullmatch(content)
            if match is None:
                raise UnsafeOutputError(f"{self.path} exists and is not a moekit lock; moekit does not touch it: "
                                        f"move it away to write {self.out}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OutputBusyError(f"{self.out} is being written by another moekit process (pid "
                                      f"{match.group(1).decode()}); wait for it to finish or choose another output")
            with contextlib.suppress(FileNotFoundError):  # a dead holder's lock: remove it if it is still the one
                if os.stat(self.path, follow_symlinks=False).st_ino == st.st_ino:
                    os.unlink(self.path)
        finally:
            if fd is not None:
                os.close(fd)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS):  # file system or kernel without RENAME_EXCHANGE
        return False
    raise OSError(code, os.strerror(code), str(b))


def _commit(tmp: Path, out: Path, overwrite: bool, kind: str) -> None:
    """Move the complete temporary into place; never replace something that appeared meanwhile unless
    `overwrite` (other moekit writers are locked out; this covers everyone else)."""
    exists = out.exists() or out.is_symlink()
    if exists and not overwrite and (kind == "file" or not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(out, f"{out} appeared while moekit was writing it; nothing was replaced")
    if not exists:
        if kind == "file":
            os.link(tmp, out)  # fails if `out` appeared this instant
            tmp.unlink()
        else:
            os.rename(tmp, out)
        return
    if not _exchange(tmp, out):
        old = out.parent / f".{out.name}{TMP}{os.getpid()}-old-{secrets.token_hex(4)}"
        os.rename(out, old)
        os.rename(tmp, out)
        tmp = old
    remove(tmp)  # now the old output


_local = threading.local()  # .reserved: {output: (inputs, overwrite)} this thread has locked


def _reserved() -> dict[Path, tuple[list, bool]]:
    if not hasattr(_local, "reserved"):
        _local.reserved = {}
    return _local.reserved


@contextlib.contextmanager
def reserve(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
            need_bytes: int = 0, what: str = "output", kind: str = "dir") -> Iterator[Path]:
    """Check `out` (`guard`) and lock it for this process, before the work that produces it; yields its real
    path. `output(out)` inside the block (e.g. in a library call such as `moekit.save`) then writes it under
    this lock, with these inputs and `overwrite`. The CLI reserves each command's output first thing."""
    real = guard(out, inputs, overwrite, need_bytes, what, kind)
    if real in _reserved():
        yield real
        return
    created = [p for p in reversed(real.parents) if not p.exists()]
    with signals_raise():
        try:
            real.parent.mkdir(parents=True, exist_ok=True)
            lock = _Lock(real)
            lock.acquire()
        except BaseException as e:
            _rmdirs(created)
            if isinstance(e, OSError):
                raise _as_write_error(e, real) from None
            raise
        _reserved()[real] = (list(inputs), overwrite)
        try:
            guard(out, inputs, overwrite, 0, what, kind)  # again, under the lock
            _remove_stale(real.parent, real.name)
            yield real
        finally:
            del _reserved()[real]
            with _signals_deferred():
                lock.release()
                if not real.exists():
                    _rmdirs(created)


def partial_path(out: Path) -> Path:
    """Where `output(partial=True)` builds `out`, kept if interrupted to resume: `.NAME.moekit-partial` beside it."""
    return out.parent / f".{out.name}{PARTIAL}"


@contextlib.contextmanager
def output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
           need_bytes: int = 0, kind: str = "dir", what: str = "output", partial: bool = False,
           keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary path to build `out` in (a directory for kind="dir", a file path for "file");
    when the block ends without error it replaces `out`, otherwise it is removed and `out` is untouched.

    Enter it before the work that produces the output (or `reserve` the output first): the checks and the
    lock come first. `partial`: the temporary is the stable `.NAME.moekit-partial` (reused if present, e.g.
    a training run to resume), and on failure it is kept if `keep(temporary)` says so.
    """
    if kind not in ("dir", "file"):
        raise ValueError(f"kind must be 'dir' or 'file', not {kind!r}")
    real = _real(out)
    if real in _reserved():  # the caller holds the lock: its inputs and overwrite apply
        held_inputs, held_overwrite = _reserved()[real]
        inputs, overwrite = [*held_inputs, *inputs], overwrite or held_overwrite
    with reserve(out, inputs, overwrite, need_bytes, what, kind):
        tmp = partial_path(real) if partial else real.parent / f".{real.name}{TMP}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if kind == "dir":
                tmp.mkdir(exist_ok=partial)
            yield tmp
            with _signals_deferred():
                _commit(tmp, real, overwrite, kind)
        except BaseException as e:
            with _signals_deferred():
                if keep is None or not keep(tmp):
                    remove(tmp)
            if isinstance(e, MoekitError) or not write_errno(e):
                raise
            raise _as_write_error(e, real) from None


def _rmdirs(created: list[Path]) -> None:
    """Remove the parent directories `output` created, deepest first, if still empty."""
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()


def _as_write_error(e: BaseException, out: Path) -> WriteError:
    code = write_errno(e)
    if code is None:
        detail = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        return WriteError(f"cannot write {out}: {detail}")
    hint = {errno.ENOSPC: "; free some space or choose another output",
            errno.EDQUOT: "; free some space or choose another output",
            errno.EFBIG: " (the file system's or the process's file size limit)"}.get(code, "")
    return WriteError(f"cannot write {out}: {os.strerror(code)}{hint}; nothing was written")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace one small file inside a directory moekit owns (results.json in a run directory, ...):
    temp file in the same directory, then rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as e:
        remove(tmp)
        if write_errno(e):
            raise _as_write_error(e, path) from None
        raise
    return path


def regular_file(path: str | os.PathLike, what: str, error: type[MoekitError] = MoekitError,
                 limit: int = 64 << 20) -> Path:
    """`path` if it is a regular file of at most `limit` bytes, else one clear error (so a name pointing at
    /dev/zero or a FIFO, or a huge file, is refused before anything reads it and hangs)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path} is not a regular file")
    if st.st_size > limit:
        raise error(f"{what} {path} is {st.st_size / 2**20:.0f} MiB; more than {limit >> 20} MiB is refused")
    return path


def read_small(path: str | os.PathLike, what: str, error: type[MoekitError] = MoekitError, limit: int = 64 << 20) -> str:
    """The UTF-8 text of an untrusted file (JSON, YAML, text lines): a regular file of at most `limit` bytes."""
    path = regular_file(path, what, error, limit)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {what} {path}: {e}") from None
