"""`moekit` entry point: parse the command line, run one command, map errors to exit codes.

Exit codes: 0 success; 2 usage, input or any other error (one line `moekit: error: ...` on stderr, no
traceback; MOEKIT_DEBUG=1 shows it); 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (temporary outputs removed).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from moekit.cli import (demo, evaluate, export, finetune, inspect, listing, routes, select, simoe, speech, train,
                        upcycle)
from moekit._fs import Terminated, install_signal_handlers
from moekit.errors import MoekitError, OutputExistsError

COMMANDS = (upcycle, inspect, export, listing, train, evaluate, demo, routes, select, finetune, speech, simoe)


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error (subparsers inherit it)."""

    def error(self, message: str):
        print(f"moekit: error: {self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moekit", description="Mixture-of-Experts models from dense checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that `key=value` words after options go to commands that take overrides."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        takes = getattr(args, "overrides", None) is not None
        if not takes or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging

    logging.disable_progress_bar()  # moekit draws its own progress; keep transformers' bars out of it
    try:
        args = parse(argv)
    except SystemExit as e:  # argparse has printed usage or help
        return e.code if isinstance(e.code, int) else 2
    install_signal_handlers()
    try:
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


def message(e: Exception) -> str:
    """One line for the user: moekit's own errors as they are (in CLI words), anything else named."""
    if isinstance(e, OutputExistsError):
        text = f"{e.message}; pass --overwrite to replace it"
    elif isinstance(e, MoekitError):
        text = str(e)
    elif isinstance(e, MemoryError):
        text = "out of memory; use a smaller model or setting, or a machine with more memory"
    elif isinstance(e, OSError):
        text = f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}"
    else:
        text = f"unexpected {type(e).__name__}: {e} (set MOEKIT_DEBUG=1 for the traceback, and please report it)"
    return " ".join(text.split())  # one line
