"""The other readers' environment for tests/test_clients.py, created once and cached (`make clients`, or the test's
first use): a virtual environment with transformers 4.57.6 (the last 4.x release, and the one llama.cpp's
converter pins) on torch 2.13.0 (the local CPU wheel), and llama.cpp's own convert_hf_to_gguf.py with gguf-py from
the same tree, taken from the llama-cpp-python 0.3.36 source distribution (vendored llama.cpp 0c1e570) that pip
downloads. Package registries only; nothing else is fetched.

    python tests/clients_env.py          # create it (a few minutes once; instant when cached)

Where: $MOEKIT_CLIENTS, else ~/.cache/moekit-test/clients-<hash of the pins>. Built in a temporary sibling and
renamed into place when complete, under a file lock (pytest-xdist workers wait for one another).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e570; bench/clients.py builds the same tree
PACKAGES = ["torch==2.13.0", "transformers==4.57.6", "numpy==2.4.6", "sentencepiece==0.2.3", "tqdm==4.70.1",
            "PyYAML==6.0.4", "requests==2.34.2"]
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
VENDOR = f"{SDIST}/vendor/llama.cpp"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")  # what the converter needs of the tree


def root() -> Path:
    if os.environ.get("MOEKIT_CLIENTS"):
        return Path(os.environ["MOEKIT_CLIENTS"])
    key = hashlib.sha256(" ".join([*PACKAGES, LLAMA_CPP_PYTHON]).encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "moekit-test" / f"clients-{key}"


def python() -> Path:
    return root() / "venv" / "bin" / "python"


def llama_cpp() -> Path:
    """The converter's folder: convert_hf_to_gguf.py, conversion/, gguf-py/."""
    return root() / "llama.cpp"


def sdist(dest: Path) -> Path:
    """The llama-cpp-python source distribution, downloaded by pip into `dest` (no wheel, no dependencies)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"{SDIST}.tar.gz"))
    if not found:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dest)])
        found = sorted(dest.glob(f"{SDIST}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON} gave no {SDIST}.tar.gz in {dest}")
    return found[0]


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def _build(tmp: Path) -> None:
    _run([sys.executable, "-m", "venv", str(tmp / "venv")])
    _run([str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet", *PACKAGES])
    with tarfile.open(sdist(tmp / "dl")) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(VENDOR + "/")
                   and m.name[len(VENDOR) + 1:].startswith(KEEP) and (m.isfile() or m.isdir())]
        tar.extractall(tmp / "x", members=members, filter="data")
    (tmp / "x" / VENDOR).rename(tmp / "llama.cpp")
    shutil.rmtree(tmp / "x")
    shutil.rmtree(tmp / "dl")
    (tmp / "READY").write_text("\n".join([*PACKAGES, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]) + "\n")


def ensure() -> Path:
    """The environment's folder, created if missing (RuntimeError with pip's output if it cannot be)."""
    out = root()
    if (out / "READY").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "READY").is_file():  # another process built it meanwhile
            return out
        if out.exists():
            shutil.rmtree(out)  # an incomplete one (not renamed into place by this code, or damaged)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            _build(tmp)
            tmp.chmod(0o755)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(ensure())
