"""`moekit` entry point: parse the command line, run one command, map errors to exit codes.

Exit codes: 0 success; 2 usage, input or any other error (one line `moekit: error: ...` on stderr, no
traceback; MOEKIT_DEBUG=1 shows it); 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (temporary outputs removed).
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

from moekit.cli import (demo, evaluate, export, finetune, inspect, listing, routes, select, simoe, speech, train,
                        upcycle)
from moekit._fs import Terminated, signals_raise
from moekit.cli.common import Parser
from moekit.errors import MoekitError

# The command modules import only the standard library, rich and moekit's light modules at the top: building
# the parser (`moekit --help`, `moekit CMD --help`) never imports torch or transformers; a command's `run`
# imports what it needs.
COMMANDS = (upcycle, inspect, export, listing, train, evaluate, demo, routes, select, finetune, speech, simoe)
# The library words a remedy as the keyword argument it takes (`overwrite=True`); the command line as its flag.
FLAGS = {f"{name}=True": "--" + name.replace("_", "-")
         for name in ("overwrite", "allow_pickle", "allow_nonfinite", "trust_remote_code", "force", "resume",
                     "allow_same_experts", "allow_crimes", "allow_other_model")}


class Version(argparse.Action):
    """`--version`: looked up only when asked for (importlib.metadata reads the installed distributions)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """`moekit 0.1.0 from /path/to/moekit (Python 3.11)`, like pip's (moekit._version.version)."""
    from moekit._version import PACKAGE, version

    return f"moekit {version()} from {PACKAGE} (Python {sys.version_info.major}.{sys.version_info.minor})"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moekit", description="Mixture-of-Experts models from dense checkpoints.")
    parser.add_argument("--version", action=Version, help="show moekit's version and where it is installed, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that the positional words of commands that take a recipe and overrides may stand between
    and after options, in any order (`moekit upcycle CONFIG --flag OUT`, as mergekit-moe's command line takes them;
    argparse stops at the first option): the recipe first, if none came before, then the overrides."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "overrides", None) is None or any(e.startswith("-") for e in extra):
            chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        if getattr(args, "recipe", "") is None:
            args.recipe, extra = extra[0], extra[1:]
        args.overrides += extra
    return args


def chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that parsed `args` (e.g. `moekit select rise`'s), whose help to name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return chosen(action.choices[getattr(args, action.dest)], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except SystemExit as e:  # argparse has printed usage or help
        return e.code if isinstance(e.code, int) else 2
    quiet_hub_progress()
    with signals_raise():
        return end_process(run(args))


def entry() -> None:
    """The `moekit` command (and `python -m moekit`): main(), then the process ends without the interpreter's teardown,
    which frees torch's and transformers' modules one by one (1.3-2 s of a command's time on a 2-core machine,
    measured 2026-11-30: `import moekit.checkpoint.dense` alone 5.5-6.4 s with it, 4.0-4.4 s without). What an exit
    still does comes first: non-daemon threads joined, atexit handlers run (logging's flush, a Trainer reporter's
    own, temporary directories' finalizers), stdout and stderr flushed. In-process callers use main(), which
    returns."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the interpreter's own call at exit (no public equivalent)
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """stdout and stderr flushed, then the process ends with `code`, without the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed (None), or a reader gone (a pipe into `head`)
            pass
    os._exit(code)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit code."""
    from moekit.cli.common import check_stdout

    try:
        check_stdout()
        args.run(args)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (Terminated)
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        print(f"moekit: interrupted ({signal.Signals(signum).name}); nothing half-written was left",
              file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001  (the one place that turns every error into one line)
        if os.environ.get("MOEKIT_DEBUG"):
            traceback.print_exc()
        print(f"moekit: error: {message(e)}", file=sys.stderr)
        return 2
    return 0


def end_process(code: int) -> int:
    """`code`, returned; but a process whose distributed launch is over (moekit.training.parallel.leave_launch) ends
    here with `code`, its output flushed, without the interpreter's teardown. DeepSpeed keeps its gloo process
    groups referenced past destroy_process_group, so their worker threads outlive it, and a C++ thread that still
    touches Python once the interpreter finalizes aborts the process ("terminate called without an active
    exception", SIGABRT): CI saw it once on a ZeRO-2 rank that had finished, and torchrun then reported the whole
    launch failed. Everything the command writes is written and renamed into place before this point."""
    launch = sys.modules.get("moekit.training.parallel")  # imported by every command that trains
    if launch is None or not launch.left_launch():
        return code
    import logging

    logging.shutdown()  # flushes and closes the handlers
    _exit_now(code)


def quiet_hub_progress() -> None:
    """moekit draws its own progress: keep transformers' and huggingface_hub's bars out of it (the environment
    variable for the modules not imported yet, so that no command imports transformers just for this)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()


def message(e: Exception) -> str:
    """One line for the user: moekit's own errors with their remedies in CLI words (`--overwrite` where the
    library says `overwrite=True`), anything else named."""
    if isinstance(e, MoekitError):
        text = str(e)
        for api, flag in FLAGS.items():
            text = text.replace(api, flag)
    elif isinstance(e, MemoryError):
        text = "out of memory; use a smaller model or setting, or a machine with more memory"
    elif isinstance(e, OSError):
        text = f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}"
    else:
        text = f"unexpected {type(e).__name__}: {e} (set MOEKIT_DEBUG=1 for the traceback, and please report it)"
    return " ".join(text.split())  # one line
