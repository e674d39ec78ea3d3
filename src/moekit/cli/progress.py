"""Showing, on stderr, the progress the library reports (moekit.progress) while a command's long work runs: a
rich bar per task on a terminal, plain lines otherwise (so that redirected logs show it too)."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

from moekit.cli.common import err_console
from moekit.progress import LOGGER


class Lines(logging.Handler):
    """`task done/total note (elapsed s, ETA s)` lines: a task's first and last (done == total), and in between at
    most one a second per task. The ETA comes from the task's rate since its first report (or its restart,
    when `done` goes back: the next language's generation, say)."""

    def __init__(self):
        super().__init__()
        self.start = time.monotonic()
        self.tasks: dict[str, tuple[float, int, float]] = {}  # task -> (since, done then, last line shown)

    def emit(self, record: logging.LogRecord) -> None:
        task, done, total, note = record.progress
        now = time.monotonic()
        since, done0, shown = self.tasks.get(task, (now, done, -1.0))
        if done < done0:
            since, done0 = now, done
        if now - shown < 1 and done != total:
            self.tasks[task] = since, done0, shown
            return
        self.tasks[task] = since, done0, now
        eta = f", ETA {(now - since) / (done - done0) * (total - done):.0f} s" if total and done > done0 else ""
        print(f"{task} {done}/{'?' if total is None else total}{f' {note}' if note else ''} "
              f"({now - self.start:.0f} s{eta})", file=sys.stderr, flush=True)

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc) -> None:
        pass


class Bars(logging.Handler):
    """A rich bar per task: done/total, elapsed, remaining time, note."""

    def __init__(self, console):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        super().__init__()
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                             console=console, transient=True)
        self.ids: dict[str, tuple[int, int]] = {}  # task -> (rich task id, done)

    def emit(self, record: logging.LogRecord) -> None:
        task, done, total, note = record.progress
        if task not in self.ids:
            self.ids[task] = self.bars.add_task(task, total=total, note=note), done
        tid, before = self.ids[task]
        if done < before:  # the task starts over
            self.bars.reset(tid, total=total)
        self.bars.update(tid, completed=done, total=total, note=note)
        self.ids[task] = tid, done

    def __enter__(self) -> Bars:
        self.bars.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.stop()


@contextlib.contextmanager
def progress() -> Iterator[None]:
    """While the block runs, show the library's progress records on stderr (and nowhere else)."""
    console = err_console()
    handler = Bars(console) if console.is_terminal else Lines()
    level, propagate = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    try:
        with handler:
            yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
        LOGGER.propagate = propagate
