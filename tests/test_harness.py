"""The test harness's own rules for subprocesses (conftest.run_checked): a native crash shows each thread's Python
stack, and a command given a `rerun` runs it once after such a crash, never after an ordinary failure."""
import sys

import pytest
from conftest import crashed, run_checked

SEGFAULT = [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"]  # reads address 0: SIGSEGV
FAILS = [sys.executable, "-c", "raise SystemExit(3)"]
PRINTS = [sys.executable, "-c", "print('second')"]


def test_a_native_crash_shows_the_python_stack():
    with pytest.raises(AssertionError, match=r"(?s)Fatal Python error: Segmentation fault.*line 1 in <module>"):
        run_checked(SEGFAULT)


def test_a_crash_runs_the_rerun_once_with_a_warning():
    with pytest.warns(UserWarning, match="SIGSEGV .* run once more: Fatal Python error"):
        assert run_checked(SEGFAULT, rerun=PRINTS) == "second\n"
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match="Segmentation fault"):
        run_checked(SEGFAULT, rerun=SEGFAULT)  # a second crash fails


def test_an_ordinary_failure_is_not_rerun():
    with pytest.raises(AssertionError):
        run_checked(FAILS, rerun=PRINTS)


def test_torchruns_report_of_a_rank_is_a_crash():
    report = "exitcode  : -11 (pid: 19619)  (SIGSEGV)\n    traceback : Signal 11 (SIGSEGV) received by PID 19619"
    assert crashed(1, report) == "SIGSEGV"
    assert crashed(1, "traceback : Signal 15 (SIGTERM) received by PID 19618") is None  # torchrun ending a rank
    assert crashed(-6, "") == "SIGABRT" and crashed(-9, "") is None and crashed(2, "error") is None
