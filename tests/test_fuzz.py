"""Issue 37 §7: every reader of untrusted input, fuzzed (moekit.testing.fuzz): the first N cases of seed 0 end in
success or one clear error, never a crash, a timeout, an allocation of what the input declares, or a file touched.

N is a few hundred for the readers that take a few milliseconds a case and 100-200 for those that build a model,
load a GGUF or go through `datasets` (about 0.1-0.2 s a case), so the whole file runs in about two and a half
minutes on one core. bench/fuzz.py runs 10,000 cases per reader (BENCHMARKS.md).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from moekit.errors import ConfigError
from moekit.testing.fuzz import FAILURES, Reader, run_case, run_reader, write_case
from moekit.testing.fuzz_readers import READERS

CASES = {"safetensors": 300, "safetensors-index": 300, "trace": 300, "selection": 300, "deepspeed": 300,
         "jsonl-pairs": 300, "jsonl-instruct": 300, "speech-manifest": 300, "ct2": 300, "moekit-json": 200,
         "config-json": 150, "hf-cache": 150, "mergekit-yaml": 150, "recipe": 150, "alpaca": 150, "sharegpt": 150,
         "gguf": 100, "covost-tsv": 200}


# CPU seconds per case: three times bench/fuzz.py's 10 s (PyYAML takes seconds to refuse a recipe nested 10**5 deep:
# it recurses to Python's limit first; CI's slower cores)
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_every_reader_has_a_ci_count():
    assert set(CASES) == set(READERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reader_survives_its_fuzz_cases(name, work):
    failures = []
    counts = run_reader(READERS[name], work, seed=0, start=0, count=CASES[name], timeout=TIMEOUT,
                        on_case=lambda i, r: failures.append((i, r)) if r.outcome in FAILURES else None)
    shown = "\n".join(f"case {i}: {r.outcome}: {r.detail}" for i, r in failures[:10])
    assert not failures, f"{name}: {dict(counts)}\n{shown}"
    assert counts["ok"] > 0 and counts["error"] > 0, dict(counts)  # both paths reached: the mutations are not all fatal


def test_cases_are_reproducible_by_index(work, tmp_path):
    """Case i of a seed is the same bytes on every call (what lets bench/fuzz.py resume, and a failure be rebuilt)."""
    reader = READERS["selection"]
    run_reader(reader, work, count=0)  # builds the seed
    seed = work / reader.name / "seed"
    a, b, c = (write_case(reader, seed, 0, i, tmp_path / n) for i, n in ((7, "a"), (7, "b"), (8, "c")))
    assert (a / "sel.json").read_bytes() == (b / "sel.json").read_bytes() != (c / "sel.json").read_bytes()


def _probe(tmp_path: Path, read, mutate=lambda rng, seed, case: None) -> str:
    (tmp_path / "seed").mkdir(exist_ok=True)
    (tmp_path / "cases").mkdir(exist_ok=True)
    reader = Reader("probe", lambda seed: None, mutate, read)
    return run_case(reader, tmp_path / "seed", tmp_path / "cases", 0, 0, timeout=0.5).outcome


def _spin() -> None:
    while True:
        pass


def _write_outside(case: Path) -> None:
    (case.parent / "stray.txt").write_text("x")


@pytest.mark.parametrize("read, outcome", [
    (lambda case: None, "ok"),
    (lambda case: (_ for _ in ()).throw(ConfigError("bad input")), "error"),
    (lambda case: {}["missing"], "crash"),
    (lambda case: _spin(), "timeout"),
    (lambda case: time.sleep(5), "timeout"),
    (lambda case: time.sleep(1), "ok"),
    (lambda case: np.ones(2**40, dtype=np.uint8), "memory"),
    (_write_outside, "touched"),
])
def test_the_harness_tells_each_outcome(read, outcome, tmp_path):
    """Each outcome class is detected: the 1 TiB allocation fails under the case's address-space limit, the endless
    loop is cut by the CPU time limit (0.5 s), a read blocked for 5 s by the wall-time backstop (6 × 0.5 s), while a
    case that waits 1 s without computing is not a timeout (the time other jobs take from a case is not its own),
    and the file written beside the case folder is seen."""
    assert _probe(tmp_path, read) == outcome


def test_a_case_may_not_change_its_own_input(tmp_path):
    def mutate(rng, seed, case):
        (case / "in.txt").write_text("input")

    assert _probe(tmp_path, lambda case: os.utime(case / "in.txt", ns=(0, 0)), mutate) == "touched"


CLI = {"trace": lambda case: ["routes", "report", case / "t.npz", "--out", case / "out"],
       "recipe": lambda case: ["validate", case / "recipe.yaml"]}


@pytest.mark.parametrize("name", sorted(CLI))
def test_cli_on_fuzz_cases_is_one_line_and_touches_nothing(name, work):
    """End to end for two readers: the first refused fuzz case through `python -m moekit` in a subprocess: exit
    2, exactly one line `moekit: error: ...` on stderr, no traceback, no file of the case changed or added."""
    import subprocess
    import sys

    from moekit.testing.fuzz import state_of

    reader = READERS[name]
    refused = []
    run_reader(reader, work, count=40, on_case=lambda i, r: refused.append(i) if r.outcome == "error" else None)
    for index in refused[:1]:
        case = write_case(reader, work / name / "seed", 0, index, work / name / f"cli-{index}")
        before = state_of(case)
        proc = subprocess.run([sys.executable, "-m", "moekit", *map(str, CLI[name](case))], capture_output=True,
                              text=True, timeout=120, cwd=case, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("moekit: error: "), proc.stderr
        assert state_of(case) == before


def test_ct2_zero_size_variable_reads(tmp_path):
    """Fuzz find (ct2 case 5874): a zero-size int32 variable crashed torch's byte view (stride 0)."""
    import torch

    from moekit.assets import ct2
    from moekit.testing.fuzz_binary import ct2_bytes

    blob, _ = ct2_bytes({"a": torch.zeros(0, 3, dtype=torch.int32), "b": torch.ones(2)})
    (tmp_path / "model.bin").write_bytes(blob)
    ck = ct2.read_model_bin(tmp_path / "model.bin")
    assert ck.variables["a"].shape == (0, 3) and ck.variables["a"].dtype == torch.int32
    assert torch.equal(ck.variables["b"], torch.ones(2))


def test_bench_report_only_rebuilds_the_section_from_the_state(tmp_path):
    """bench/fuzz.py --report-only: BENCHMARKS.md's section from the committed state alone (a state written before
    "seed", "date", "machine" and "limit" were kept reads as seed 0 on an unrecorded machine with a wall-time limit),
    no "known" column, the text
    outside the section kept, a rechecked failure's new outcome beside it."""
    import json
    import subprocess
    import sys

    state = {"trace": {"next": 2000, "counts": {"ok": 500, "error": 1499, "crash": 1}, "seconds": 30.0,
                       "failures": [{"index": 17, "outcome": "crash", "detail": "TypeError:\n  boom",
                                     "recheck": {"outcome": "error", "date": "2026-11-28"}}]},
             "ct2": {"next": 1000, "counts": {"ok": 10, "error": 989, "timeout": 1}, "seconds": 16.4, "failures": [],
                     "seed": 0, "date": "2026-11-27", "machine": "AMD EPYC CPU, 2 cores",
                     "limit": "10 s of CPU time (60 s of wall time for a read that blocks)"}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\nbefore\n\n<!-- fuzz -->\nold\n<!-- /fuzz -->\n\nafter\n")
    script = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
    proc = subprocess.run([sys.executable, str(script), "--report-only", "--state", str(tmp_path / "state.json"),
                           "--write", str(bench), "--work", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = bench.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n<!-- fuzz -->\n") and text.endswith("<!-- /fuzz -->\n\nafter\n")
    lines = text.splitlines()
    head = lines.index("| reader | cases | ok | error | crash | timeout | memory | touched | ms / case |")
    assert lines[head + 1:head + 5] == ["|---|---:|---:|---:|---:|---:|---:|---:|---:|",
                                        "| ct2 | 1,000 | 10 | 989 | 0 | 1 | 0 | 0 | 16 |",
                                        "| trace | 2,000 | 500 | 1,499 | 1 | 0 | 0 | 0 | 15 |", ""]
    assert "- trace case 17: crash: TypeError: boom; rechecked 2026-11-28: **error**" in lines
    assert "Rechecked: 1 of 1 kept failures now end in ok or one error line." in lines
    assert ("Last cases run 2026-11-27; machine: AMD EPYC CPU, 2 cores (ct2); not recorded (trace) "
            "(`bench/fuzz.py --cases 2000 --readers ct2 trace --write BENCHMARKS.md`") in text
    assert ("with a time limit per case of 10 s of CPU time (60 s of wall time for a read that blocks) (ct2); 10 s of "
            "wall time (trace) and an address space") in text
    assert not (tmp_path / "nothing").exists()  # nothing ran


@pytest.mark.parametrize("state", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "bench" / "results"
                                                           / "fuzz").glob("*.json")))
def test_benchmarks_fuzz_sections_are_the_committed_states(state):
    """BENCHMARKS.md's fuzz sections are what `bench/fuzz.py --report-only` makes of the committed state files."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "fuzz.py"), "--report-only", "--state",
                           f"bench/results/fuzz/{state}"], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.rstrip("\n")
    assert section.splitlines()[0].startswith("<!-- fuzz") and section in (root / "BENCHMARKS.md").read_text()


def test_bench_other_state_files_get_their_own_section(tmp_path):
    """A state file other than state.json (e.g. the same cases rerun on later code) is its own section, beside the main
    one, and its commands name it."""
    import json
    import subprocess
    import sys

    entry = {"next": 10, "counts": {"ok": 1, "error": 9}, "seconds": 1.0, "failures": []}
    script = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\n<!-- fuzz -->\nmain\n<!-- /fuzz -->\n")
    (tmp_path / "rerun.json").write_text(json.dumps({"trace": entry}))
    proc = subprocess.run([sys.executable, str(script), "--report-only", "--state", str(tmp_path / "rerun.json"),
                           "--write", str(bench)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = bench.read_text()
    assert text.startswith("# Benchmarks\n\n<!-- fuzz -->\nmain\n<!-- /fuzz -->\n\n<!-- fuzz rerun -->\n"
                           "## Fuzzing the readers of untrusted input: rerun (bench/fuzz.py)\n")
    assert text.endswith("<!-- /fuzz rerun -->\n")
    assert (f"`bench/fuzz.py --cases 10 --readers trace --state {tmp_path / 'rerun.json'} --write BENCHMARKS.md`; "
            f"the same command continues a run that stopped; `bench/fuzz.py --report-only --state "
            f"{tmp_path / 'rerun.json'} --write BENCHMARKS.md` rebuilds this section from "
            f"{tmp_path / 'rerun.json'})") in text


def test_bench_recheck_reruns_each_kept_failure_on_this_code(tmp_path):
    """bench/fuzz.py --recheck: a kept failure's case runs again in a child process and its outcome on this code is
    kept beside it in the state (case 0 of trace, which the current code reads or refuses in one line); the counts
    are not touched."""
    import json
    import subprocess
    import sys

    failure = {"index": 0, "outcome": "crash", "detail": "TypeError: from an older version"}
    state = {"trace": {"next": 10, "counts": {"error": 9, "crash": 1}, "seconds": 1.0, "failures": [failure]}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    script = Path(__file__).resolve().parents[1] / "bench" / "fuzz.py"
    proc = subprocess.run([sys.executable, str(script), "--recheck", "--readers", "trace", "--state",
                           str(tmp_path / "state.json"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    after = json.loads((tmp_path / "state.json").read_text())["trace"]
    assert after["counts"] == {"error": 9, "crash": 1} and after["next"] == 10
    again = after["failures"][0].pop("recheck")
    assert after["failures"][0] == failure and again["outcome"] in ("ok", "error") and set(again) == {"outcome", "date"}


def test_gguf_declared_counts_are_checked_against_the_file(tmp_path):
    """Fuzz find (gguf cases 505, 930): a metadata array declaring 7.9e18 items made gguf's reader loop over it
    (4.3 GiB and over a minute before the time limit); the counts walk refuses it from the header, and passes the
    valid file. A tensor count beyond the file is refused the same way."""
    import struct

    from moekit.assets.gguf_header import check_gguf_counts
    from moekit.errors import AssetError
    from moekit.testing.fuzz import write_case
    from moekit.testing.fuzz_readers import READERS

    reader, seed_dir = READERS["gguf"], tmp_path / "seed"
    seed_dir.mkdir()
    reader.build(seed_dir)
    check_gguf_counts(seed_dir / "m.gguf")  # the valid file
    for index in (505, 930):
        case = write_case(reader, seed_dir, 0, index, tmp_path / f"case-{index}")
        with pytest.raises(AssetError, match=r"metadata entry \d+ array length 7,881,700,033,987,346,432 at byte \d+ "
                                             r"does not fit in its 16,896 bytes"):
            check_gguf_counts(case / "m.gguf")
    data = bytearray((seed_dir / "m.gguf").read_bytes())
    data[8:16] = struct.pack("<Q", 2**40)
    (tmp_path / "t.gguf").write_bytes(data)
    with pytest.raises(AssetError, match=r"tensor count 1,099,511,627,776 at byte 16 does not fit"):
        check_gguf_counts(tmp_path / "t.gguf")
