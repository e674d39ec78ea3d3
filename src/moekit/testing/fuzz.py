"""A structure-aware fuzz harness for moekit's readers of untrusted bytes (issue 37 §7).

Each reader (moekit.testing.fuzz_readers.READERS) has a valid seed input built from a tiny fixture, mutators that
know the input's structure (a JSON or YAML tree, a safetensors header, an .npz's arrays, a CTranslate2 or GGUF
field, a cache's links), and the library call that reads it, run in this process. Every case ends in one outcome:

  ok       the reader accepted the input
  error    a MoekitError whose message is one non-empty line once the CLI prints it (moekit.cli.main.message)
  crash    any other exception (a traceback at the CLI), or a MoekitError with an empty message
  timeout  the case used more than its CPU time limit (SIGPROF), or blocked past the wall-time backstop (SIGALRM,
           WALL_FACTOR × the limit); each raises a BaseException the reader cannot swallow. CPU time, not wall
           time, so that other jobs on the machine do not turn a slow case into a timeout
  memory   an allocation failed under the address-space limit set around each case (RLIMIT_AS: the process's
           size then plus MEMORY_BUDGET): a size the input declares was allocated before it was checked
  touched  a file was created, changed or removed outside the case's own input (the seed, the fuzz root)

Why our own mutators and not hypothesis or atheris: a case must be reproducible and countable by its index alone
(`random.Random(f"{reader}:{seed}:{index}")`), so that bench/fuzz.py can stop anywhere and resume at the next
index with its counts, and CI runs exactly the first N cases of a fixed seed. Hypothesis chooses, shrinks and
replays examples from its own database and stops when it likes; atheris needs a compiled extension (not on PyPI
for every Python this project supports) and finds inputs by coverage, not by the file structures these readers
parse. The mutators below aim at those structures directly: types, missing and duplicated keys, huge and
non-finite numbers, deep nesting, wrong shapes, dtypes and offsets, YAML tags and aliases, links leading out.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("ok", "error", "crash", "timeout", "memory", "touched")
FAILURES = ("crash", "timeout", "memory", "touched")
MEMORY_BUDGET = 2 << 30  # bytes of address space a case may add (the fixtures are a few hundred KiB)
TIMEOUT = 10.0  # seconds of CPU time a case may use
WALL_FACTOR = 6  # a case that computes nothing (a read blocked on a FIFO) is stopped after this × TIMEOUT of wall time


@dataclass
class Reader:
    """One reader of untrusted input: `build(seed_dir)` writes the valid seed once; `mutate(rng, seed_dir, case_dir)`
    writes one case's input into the empty `case_dir`; `read(case_dir)` is the library call under test."""

    name: str
    build: Callable[[Path], None]
    mutate: Callable[[random.Random, Path, Path], None]
    read: Callable[[Path], object]
    output: str | None = None  # what `read` writes into the case folder (allowed when it succeeds, and only then)


@dataclass
class Result:
    outcome: str
    detail: str = ""  # the error line, or the crash's type, message and innermost frame


class _Timeout(BaseException):
    """Raised by SIGPROF or SIGALRM inside the reader; a BaseException, so `except Exception` in a reader lets it
    through."""


def _alarm(signum, frame):
    raise _Timeout()


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """`seconds` of this process's CPU time (ITIMER_PROF), and WALL_FACTOR × that of wall time (ITIMER_REAL)."""
    timers = ((signal.ITIMER_PROF, signal.SIGPROF, seconds),
              (signal.ITIMER_REAL, signal.SIGALRM, WALL_FACTOR * seconds))
    old = [signal.signal(sig, _alarm) for _, sig, _ in timers]
    for which, _, limit in timers:
        signal.setitimer(which, limit)
    try:
        yield
    finally:
        for (which, sig, _), handler in zip(timers, old):
            signal.setitimer(which, 0)
            signal.signal(sig, handler)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def memory_limit(budget: int = MEMORY_BUDGET) -> Iterator[None]:
    """RLIMIT_AS at the process's current size plus `budget` while the block runs (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space() + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def state_of(root: Path, skip: str | None = None) -> dict[str, tuple]:
    """{relative path: (mode, size, mtime_ns, link target)} of everything under `root` (but `skip` and what it
    holds), links not followed; folders by mode only (their entries are listed themselves)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if skip is not None and (rel == skip or rel.startswith(skip + os.sep)):
                continue
            st = os.lstat(p)
            target = os.readlink(p) if os.path.islink(p) else None
            out[rel] = (st.st_mode, 0, 0, target) if name in dirnames else (st.st_mode, st.st_size, st.st_mtime_ns, target)
    return out


_MEMORY = re.compile(r"can't allocate memory|bad_alloc|Cannot allocate memory|out of memory", re.I)


def classify(e: BaseException) -> Result:
    """The outcome of a reader that raised `e`."""
    from moekit.cli.main import message
    from moekit.errors import MoekitError

    if isinstance(e, _Timeout):
        return Result("timeout")
    text = " ".join(str(e).split())
    chain = [e]
    while chain[-1].__context__ is not None and len(chain) < 20:  # a reader that wraps a MemoryError still allocated
        chain.append(chain[-1].__context__)
    if any(isinstance(c, MemoryError) or _MEMORY.search(str(c)) for c in chain):
        return Result("memory", f"{type(e).__name__}: {text[:300]}")
    if isinstance(e, MoekitError) and text and "\n" not in message(e):
        return Result("error", message(e)[:300])
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "moekit" in f.filename and "testing" not in f.filename]
    where = "".join(f" at {Path(f.filename).name}:{f.lineno}" for f in [*ours[-1:], *frames[-1:]] if f)
    detail = f"{type(e).__name__}: {text[:300]}{where}"
    return Result("crash", detail)


def write_case(reader: Reader, seed_dir: Path, seed: int, index: int, case: Path) -> Path:
    """Case `index` of `seed` written into the (new, empty) folder `case`: the same bytes on every call."""
    _remove(case)
    case.mkdir(parents=True)
    reader.mutate(random.Random(f"{reader.name}:{seed}:{index}"), seed_dir, case)
    return case


def run_case(reader: Reader, seed_dir: Path, root: Path, seed: int, index: int,
             timeout: float = TIMEOUT, budget: int = MEMORY_BUDGET) -> Result:
    """Build case `index` of `seed` in a fresh folder under `root`, read it in this process, classify the outcome;
    the folder is removed afterwards. The reader runs with the case folder as working directory."""
    case = write_case(reader, seed_dir, seed, index, root / f"case-{index}")
    before = state_of(case), state_of(seed_dir), sorted(os.listdir(root))
    cwd = os.getcwd()
    os.chdir(case)
    try:
        with _silenced(), memory_limit(budget), _deadline(timeout):
            reader.read(case)
        result = Result("ok")
    except BaseException as e:  # noqa: BLE001  (the outcome of every case is recorded, whatever it raised)
        if isinstance(e, KeyboardInterrupt):
            raise
        result = classify(e)
    finally:
        os.chdir(cwd)
    made = reader.output is not None and result.outcome == "ok" and (case / reader.output).exists()
    if (state_of(case, reader.output if made else None), state_of(seed_dir), sorted(os.listdir(root))) != before:
        result = Result("touched", f"the reader changed files outside its output ({result.outcome} otherwise)")
    _remove(case)
    return result


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """File descriptors 1 and 2 on /dev/null while a case runs (transformers' load reports, warnings)."""
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        yield
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def _remove(case: Path) -> None:
    for dirpath, dirnames, _ in os.walk(case):  # a mutator may have removed write or execute bits
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
    shutil.rmtree(case, ignore_errors=True)


def run_reader(reader: Reader, work: Path, seed: int = 0, start: int = 0, count: int = 100,
               on_case: Callable[[int, Result], None] | None = None, timeout: float = TIMEOUT) -> Counter:
    """Cases start .. start+count-1 of `reader` (seed inputs built once under `work`; case `start` read once
    beforehand without its time limit, so that imports do not count); counts per outcome. `on_case(index,
    result)` sees every result (e.g. to save progress or keep the failures)."""
    work = Path(work).resolve()  # each case runs in its own folder: relative paths would point elsewhere
    seed_dir, root = work / reader.name / "seed", work / reader.name / "cases"
    if not (seed_dir / ".built").exists():
        shutil.rmtree(seed_dir, ignore_errors=True)
        seed_dir.mkdir(parents=True)
        reader.build(seed_dir)
        (seed_dir / ".built").write_text("")
    root.mkdir(parents=True, exist_ok=True)
    if count:  # the first read imports what the reader needs (seconds): not counted against a case's time
        run_case(reader, seed_dir, root, seed, start, 30 * timeout)
    counts = Counter()
    for index in range(start, start + count):
        result = run_case(reader, seed_dir, root, seed, index, timeout)
        counts[result.outcome] += 1
        if on_case is not None:
            on_case(index, result)
    return counts


# ---------------------------------------------------------------------------------------------- mutators


def huge_ints() -> list:
    return [2**31, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30]


INTERESTING = [None, True, False, 0, -1, 1, 3, 7, 255, 65536, *huge_ints(), 0.5, -0.0, 1e308, -1e308, math.nan,
               math.inf, -math.inf, "", "x", "0", "1", "-1", "true", "null", "NaN", "../x", "/etc/passwd", "a\x00b",
               "é\u202e\ud7ff", "x" * 5000, [], [0], [[]], {}, {"a": 1}, {"": None}]


def nodes(obj, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON-like tree (the root is ())."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += nodes(v, path + (i,))
    return out


def _get(obj, path: tuple):
    for p in path:
        obj = obj[p]
    return obj


def tweak(rng: random.Random, value):
    """A value near `value` of the same kind, or of another kind, or an interesting one."""
    if isinstance(value, bool) or value is None:
        return rng.choice(INTERESTING)
    if isinstance(value, int):
        return rng.choice([-value, value + 1, value - 1, value * 2**rng.randint(8, 64), 0, float(value), str(value),
                           rng.choice(huge_ints()), [value]])
    if isinstance(value, float):
        return rng.choice([-value, value * 1e300, math.nan, math.inf, int(value) if math.isfinite(value) else 0,
                           str(value)])
    if isinstance(value, str):
        return rng.choice([value + value, value[: len(value) // 2], "", value.upper(), value + "\x00", f"../{value}",
                           f"/{value}", value * 1000, value.encode("utf-8", "surrogatepass").hex(), [value]])
    if isinstance(value, list):
        return rng.choice([value[:-1], value + value[-1:], list(reversed(value)), value * 50, [value], {}, value[:0]])
    if isinstance(value, dict):
        return rng.choice([[value], dict(list(value.items())[::-1]), {k: None for k in value}, {}])
    return rng.choice(INTERESTING)


def mutate_tree(rng: random.Random, obj, times: int | None = None):
    """`obj` (a JSON-like tree, not changed) with 1 to 3 structural mutations: a value tweaked or replaced by an
    interesting one, a key deleted, renamed or added, a list item duplicated or removed, two subtrees swapped."""
    obj = json.loads(json.dumps(obj))
    for _ in range(times or rng.choice([1, 1, 1, 2, 3])):
        paths = nodes(obj)
        path = rng.choice(paths)
        op = rng.randrange(8)
        if not path:
            obj = tweak(rng, obj) if op < 2 else obj
            continue
        parent, key = _get(obj, path[:-1]), path[-1]
        if op <= 2:
            parent[key] = tweak(rng, parent[key])
        elif op == 3:
            parent[key] = rng.choice(INTERESTING)
        elif op == 4:
            del parent[key]
        elif op == 5 and isinstance(parent, dict):
            parent[rng.choice([f"{key}_", str(key).upper(), "extra", "__class__", ""])] = parent.pop(key)
        elif op == 5:
            parent.insert(key, parent[key])
        elif op == 6:
            other = rng.choice(paths)
            if other and other[:len(path)] != path and path[:len(other)] != other:
                oparent = _get(obj, other[:-1])
                parent[key], oparent[other[-1]] = oparent[other[-1]], parent[key]
        else:
            parent[key] = rng.choice([{"extra": parent[key]}, [parent[key]] * 3, {str(i): parent[key] for i in range(3)}])
        obj = json.loads(json.dumps(obj))  # no shared subtrees (a later swap could make a cycle of them)
    return obj


def mutate_text(rng: random.Random, text: str) -> bytes:
    """Text damaged at the byte level: truncated, a byte flipped, invalid UTF-8 or a NUL inserted, a BOM, CRLF,
    deep nesting around it, a huge line appended."""
    data = text.encode("utf-8", "surrogatepass")
    op, at = rng.randrange(9), rng.randrange(len(data) + 1)
    if op == 0:
        return data[:at]
    if op == 1 and data:
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    if op == 2:
        return data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + data[at:]
    if op == 3:
        return b"\xef\xbb\xbf" + data
    if op == 4:
        return data.replace(b"\n", b"\r\n")
    if op == 5:
        depth = rng.choice([100, 1000, 10**5])
        return b"[" * depth + data + b"]" * depth
    if op == 6:
        return data + b"\n" + b"x" * rng.choice([10**5, 10**6])
    if op == 7:
        return data[:at] + data[at:][::-1]
    return data[:at] + data[rng.randrange(len(data) + 1):]


def json_bytes(rng: random.Random, obj, text_rate: float = 0.2) -> bytes:
    """A mutated tree as JSON (NaN and Infinity written as Python's json writes them), sometimes also damaged as
    text, or with a key written twice."""
    obj = mutate_tree(rng, obj)
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
    r = rng.random()
    if r < text_rate:
        return mutate_text(rng, text)
    if r < text_rate + 0.05 and isinstance(obj, dict) and obj:
        k = rng.choice(list(obj))
        return (text[:-1] + f", {json.dumps(k)}: {json.dumps(rng.choice(INTERESTING))}}}").encode()
    if r < text_rate + 0.08:
        return rng.choice([b"1e999999", b"-" + b"9" * 5000, b"\"" + b"\\ud800" + b"\"", b"", b"null", b"[]"])
    return text.encode("utf-8", "surrogatepass")


YAML_SNIPPETS = ["!!python/object/apply:os.system ['true']", "!!python/name:os.system", "!!binary aGVsbG8=",
                 "!!timestamp 2001-12-14t21:59:43.10-05:00", "!!set {a, b}", "!!float .nan", "!!float -.inf",
                 "!!int 0x7fffffffffffffffffff", "!!str 3", "!!omap [a: 1]", "&a [1, 2]", "*undefined", "{a: *a}",
                 "? [complex, key]", "0o777", "1_000", "~", "yes", "1e400", ".inf", "2001-12-14", "!custom x",
                 "[" * 200 + "]" * 200, "|\n  block\n  text", ">-\n  folded"]


def yaml_bytes(rng: random.Random, obj) -> bytes:
    """A mutated tree as YAML, sometimes with a scalar replaced by YAML's own syntax (tags, anchors and aliases,
    merge keys, sexagesimals), a document marker, a tab, or damaged as text."""
    import yaml

    text = yaml.safe_dump(mutate_tree(rng, obj), sort_keys=False, allow_unicode=rng.random() < 0.5)
    r = rng.random()
    if r < 0.35:
        lines = text.splitlines()
        i = rng.randrange(len(lines))
        head, sep, _ = lines[i].partition(": ")
        snippet = rng.choice(YAML_SNIPPETS)
        lines[i] = f"{head}: {snippet}" if sep else f"{lines[i]} {snippet}"
        return ("\n".join(lines) + "\n").encode()
    if r < 0.45:
        anchor = "base: &b {x: 1}\n"
        return rng.choice([anchor + "<<: *b\n" + text, "%YAML 1.1\n---\n" + text, text + "---\nsecond: 1\n",
                           text.replace("  ", "\t", 1), "a: &a [x]\nb: [*a, *a, *a]\n" + text]).encode()
    if r < 0.55:
        return mutate_text(rng, text)
    return text.encode()


def mutate_bytes(rng: random.Random, data: bytes, fields: list[tuple[int, int]] | None = None) -> bytes:
    """`data` with 1 to 3 damages: a byte flipped, a range cut or repeated, truncated, or, when `fields` lists
    (offset, width) of its integer fields, one of them overwritten with an interesting value."""
    data = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.randrange(6 if fields else 4)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[at:at + rng.randint(1, 64)]
        elif op == 2:
            data[at:at] = data[at:at + rng.randint(1, 64)] * rng.randint(1, 4)
        elif op == 3:
            del data[at:]
        elif fields:
            off, width = rng.choice(fields)
            if off + width <= len(data):
                value = rng.choice([0, 1, 2**(8 * width) - 1, 2**(8 * width - 1), 2**(8 * width - 1) - 1,
                                    int.from_bytes(data[off:off + width], "little") + rng.choice([-1, 1, 2**20])])
                data[off:off + width] = (value % 2**(8 * width)).to_bytes(width, "little")
    return bytes(data)


def copy_seed(seed_dir: Path, case_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """The seed's files (hidden ones and `skip` left out) copied into the case folder."""
    for p in seed_dir.iterdir():
        if p.name.startswith(".") or p.name in skip:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, case_dir / p.name, symlinks=True)
        else:
            shutil.copy2(p, case_dir / p.name, follow_symlinks=False)
