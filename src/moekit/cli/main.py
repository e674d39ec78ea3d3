"""`moekit` entry point: parse the command line, run one command, map errors to exit codes.

Exit codes: 0 success, 2 usage or input error (one message on stderr, no traceback), 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys

from moekit.cli import (demo, evaluate, export, finetune, inspect, listing, routes, select, simoe, speech, train,
                        upcycle)
from moekit.errors import MoekitError

COMMANDS = (upcycle, inspect, export, listing, train, evaluate, demo, routes, select, finetune, speech, simoe)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekit", description="Mixture-of-Experts models from dense checkpoints.")
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
    try:
        args.run(args)
    except MoekitError as e:
        print(f"moekit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moekit: interrupted", file=sys.stderr)
        return 130
    return 0
