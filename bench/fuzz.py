"""Fuzz every reader of untrusted input (moekit.testing.fuzz, issue 37 §7): --cases per reader (default 10,000),
resumable, counts per outcome written to BENCHMARKS.md.

Cases run in chunks, each chunk in a child process (a reader that kills its process, e.g. with SIGSEGV, costs the
chunk, which is then rerun one case per process to name the case). Progress is kept in --state after every
chunk: run the same command again to continue where it stopped; --cases can be raised to go on further. The state
is small and committed (bench/results/fuzz/state.json: per reader the cases done, the count of each outcome, the
seconds spent and the first failures), so BENCHMARKS.md's section regenerates from the repository with --report-only.

    nice -n 19 .venv/bin/python bench/fuzz.py --cases 10000 --write BENCHMARKS.md
    .venv/bin/python bench/fuzz.py --report-only --write BENCHMARKS.md   # the section again, from the state alone
    .venv/bin/python bench/fuzz.py --show runs/fuzz/case --reader trace --index 123   # rebuild one case's input
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import cpu_name, write_section  # bench/report.py  # noqa: E402

from moekit._fs import write_text_atomic  # noqa: E402
from moekit.testing.fuzz import OUTCOMES, WALL_FACTOR, run_reader, write_case  # noqa: E402
from moekit.testing.fuzz_readers import READERS  # noqa: E402

STATE = Path("bench/results/fuzz/state.json")


def is_main(state_path: Path) -> bool:
    return state_path.name == STATE.name


def marks(state_path: Path) -> tuple[str, str]:
    """The section of a state file: the main one's (state.json), or one section per other state file (e.g.
    rerun.json: the same cases again on later code)."""
    name = "" if is_main(state_path) else f" {state_path.stem}"
    return f"<!-- fuzz{name} -->", f"<!-- /fuzz{name} -->"


def state_option(state_path: Path) -> str:
    return "" if is_main(state_path) else f" --state {state_path}"


def publish(args, state: dict) -> None:
    """Put the state's section into --write (a no-op without --write)."""
    if args.write:
        write_section(args.write, section(state, args.state), marks(args.state))


KEEP = 20  # failures kept per reader in the state file


def child(args) -> None:
    """Run one chunk in this process; print one JSON line per case."""
    def show(index, result):
        print(json.dumps({"index": index, "outcome": result.outcome, "detail": result.detail}), flush=True)

    run_reader(READERS[args.reader], Path(args.work), count=0)  # the seed, built once
    print(json.dumps({"ready": True}), flush=True)
    run_reader(READERS[args.reader], Path(args.work), args.seed, args.start, args.count, show, args.timeout)


def run_chunk(args, name: str, start: int, count: int) -> list[dict]:
    """The results of cases start..start+count-1 of `name`, from a child process; the case a child died in (the
    one after the last it reported) is a crash named by the exit status, and the rest go on in a new child."""
    cmd = [sys.executable, __file__, "--child", "--reader", name, "--start", str(start), "--count", str(count),
           "--seed", str(args.seed), "--work", str(args.work), "--timeout", str(args.timeout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:  # not even the seed: the harness itself is broken
        raise SystemExit(f"{name}: the child process failed before any case: {proc.stderr.strip()[-2000:]}")
    results = lines[1:]
    if proc.returncode == 0 and len(results) == count:
        return results
    died = start + len(results)
    results.append({"index": died, "outcome": "crash",
                    "detail": f"the process died (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"})
    return results + (run_chunk(args, name, died + 1, start + count - died - 1) if died + 1 < start + count else [])


def load_state(path: Path) -> dict:
    """{reader: {"next": cases done, "counts": {outcome: n}, "failures": [the first KEEP], "seconds": spent,
    "seed", "date", "machine" and "limit" (the time limit per case, in words): of its last chunk}}; these four may be
    missing (states written before they were kept: seed 0, date and machine unknown, OLD_LIMIT)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def fuzz(args, report) -> dict:
    """Every reader in turn up to --cases; `report(state)` after every chunk."""
    state = load_state(args.state)
    for name in args.readers:
        entry = state.setdefault(name, {"next": 0, "counts": {}, "failures": [], "seconds": 0.0, "seed": args.seed})
        if entry.get("seed", 0) != args.seed:
            raise SystemExit(f"{name}: {args.state} holds seed {entry.get('seed', 0)}'s cases, not seed {args.seed}'s")
        while entry["next"] < args.cases:
            n = min(args.chunk, args.cases - entry["next"])
            t0 = time.perf_counter()
            for r in run_chunk(args, name, entry["next"], n):
                entry["counts"][r["outcome"]] = entry["counts"].get(r["outcome"], 0) + 1
                if r["outcome"] not in ("ok", "error") and len(entry["failures"]) < KEEP:
                    entry["failures"].append(r)
            entry["next"] += n
            entry["seconds"] += time.perf_counter() - t0
            entry["date"] = str(date.today())
            entry["machine"] = f"{cpu_name()}, {os.cpu_count()} cores"
            entry["limit"] = limit_text(args.timeout)
            args.state.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.state, json.dumps(state, indent=1))
            report(state)
            print(f"{name}: {entry['next']} cases {entry['counts']} ({entry['seconds']:.0f} s)", file=sys.stderr)
    return state


def recheck(args) -> dict:
    """Every kept failure's case again on this code, each in its own child process: its outcome and the date are
    kept beside the failure (so the section says, from the state, which failures the fixes since ended)."""
    state = load_state(args.state)
    for name in args.readers:
        for f in state.get(name, {}).get("failures", []):
            (r,) = run_chunk(args, name, f["index"], 1)
            f["recheck"] = {"outcome": r["outcome"], "date": str(date.today()),
                            **({} if r["outcome"] in ("ok", "error") else {"detail": r["detail"][-300:]})}
            print(f"{name} case {f['index']}: {f['outcome']} -> {r['outcome']}", file=sys.stderr)
    write_text_atomic(args.state, json.dumps(state, indent=1))
    return state


def failure_line(name: str, f: dict) -> str:
    again = f.get("recheck")
    now = f"; rechecked {again['date']}: **{again['outcome']}**" if again else ""
    return f"- {name} case {f['index']}: {f['outcome']}: {' '.join(f['detail'].split())[-200:]}{now}"


def table(state: dict) -> list[str]:
    """The counts table, one row per reader of `state`."""
    rows = [f"| {name} | {e['next']:,} | " + " | ".join(f"{e['counts'].get(o, 0):,}" for o in OUTCOMES)
            + f" | {1000 * e['seconds'] / max(e['next'], 1):.0f} |" for name, e in sorted(state.items())]
    return ["| reader | cases | " + " | ".join(OUTCOMES) + " | ms / case |", "|---|" + "---:|" * (len(OUTCOMES) + 2),
            *rows]


def command(state: dict, state_path: Path = STATE) -> str:
    """The command that runs the cases of `state` (and continues them where they stopped)."""
    readers = "" if set(state) == set(READERS) else " --readers " + " ".join(sorted(state))
    seeds = {e.get("seed", 0) for e in state.values()}
    seed = f" --seed {seeds.pop()}" if seeds != {0} and len(seeds) == 1 else ""
    return (f"bench/fuzz.py --cases {max(e['next'] for e in state.values())}{readers}{seed}{state_option(state_path)} "
            "--write BENCHMARKS.md")


OLD_LIMIT = "10 s of wall time"  # the limit of the cases run before the state kept it


def limit_text(timeout: float) -> str:
    return f"{timeout:g} s of CPU time ({WALL_FACTOR * timeout:g} s of wall time for a read that blocks)"


def grouped(state: dict, key: str, missing: str) -> str:
    """A per-reader value of the state in words: the value, or each value with its readers where they differ."""
    by = {}
    for name, e in sorted(state.items()):
        by.setdefault(e.get(key, missing), []).append(name)
    return "; ".join(f"{v} ({', '.join(names)})" if len(by) > 1 else v for v, names in by.items())


def section(state: dict, state_path: Path = STATE) -> str:
    """BENCHMARKS.md's fuzz section of a state file, from the state alone (so --report-only rebuilds it byte for
    byte)."""
    dates = sorted(e["date"] for e in state.values() if "date" in e)
    where, limit = grouped(state, "machine", "not recorded"), grouped(state, "limit", OLD_LIMIT)
    failures = [failure_line(name, f) for name, e in sorted(state.items()) for f in e["failures"]]
    rechecked = [f["recheck"]["outcome"] for e in state.values() for f in e["failures"] if "recheck" in f]
    fixed = sum(o in ("ok", "error") for o in rechecked)
    mark, option = marks(state_path), state_option(state_path)
    title = f": {state_path.stem}" if option else ""
    return "\n".join([
        mark[0], f"## Fuzzing the readers of untrusted input{title} (bench/fuzz.py)", "",
        (f"Last cases run {dates[-1]}; " if dates else "") + f"machine: {where} (`{command(state, state_path)}`; the "
        f"same command continues a run that stopped; `bench/fuzz.py --report-only{option} --write BENCHMARKS.md` "
        f"rebuilds this section from {STATE if not option else state_path}). Cases 0..N-1 of each reader "
        "(moekit.testing.fuzz_readers): structure-aware mutations of a valid tiny input, read by the library call in "
        f"a child process with a time limit per case of {limit} and an address space of 2 GiB more than the process "
        "had. ok: accepted; error: one MoekitError line; crash, "
        "timeout, memory (a declared size allocated before it was checked), touched (a file changed outside the "
        "case's output): failures, each to become a fixed bug and a row in tests/test_bad_inputs.py. ms / case: wall "
        "time per case, child processes included, while other jobs shared the machine (the runs were started at nice "
        "19).", "",
        *table(state), "",
        *([f"Failures kept (first {KEEP} per reader; `bench/fuzz.py --recheck` reruns each on the current code, one "
            "child process per case, and keeps its outcome here):", "", *failures, ""] if failures else []),
        *([f"Rechecked: {fixed} of {len(rechecked)} kept failures now end in ok or one error line."]
          if rechecked else []), mark[1]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=10_000, help="cases per reader (default: %(default)s)")
    p.add_argument("--readers", nargs="+", default=sorted(READERS), choices=sorted(READERS), metavar="READER",
                   help="readers to fuzz (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the fuzz seed (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=500, help="cases per child process (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help=f"CPU seconds per case; {WALL_FACTOR}x that of wall time stops a read that blocks "
                        "(default: %(default)s)")
    p.add_argument("--state", type=Path, default=STATE,
                   help="progress file, committed; each has its own section (default: %(default)s)")
    p.add_argument("--work", type=Path, default=Path("runs/fuzz/work"), help="seeds and cases (default: %(default)s)")
    p.add_argument("--write", type=Path, help="BENCHMARKS.md to put the table in")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the section from --state into --write (or print it)")
    p.add_argument("--recheck", action="store_true",
                   help="run each kept failure's case again on the current code, keep its outcome in --state, stop")
    p.add_argument("--show", type=Path, help="write case --index of --reader into this folder and stop")
    p.add_argument("--reader", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help="the case --show writes (default: %(default)s)")
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.show:
        run_reader(READERS[args.reader], args.work, count=0)  # the seed
        print(write_case(READERS[args.reader], args.work / args.reader / "seed", args.seed, args.index, args.show))
        return None
    if args.recheck:
        return publish(args, recheck(args))
    if args.report_only:
        state = load_state(args.state)
        if not state:
            raise SystemExit(f"{args.state}: no fuzz state to report")
        return publish(args, state) if args.write else print(section(state, args.state))
    fuzz(args, lambda state: publish(args, state))


if __name__ == "__main__":
    main()
