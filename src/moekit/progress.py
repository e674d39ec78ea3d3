"""Progress of long-running library work (upcycling, export, training, evaluation, speech synthesis), reported
as log records on the `moekit.progress` logger: the library prints nothing itself. The command line shows them
(a bar on a terminal, plain lines otherwise; moekit.cli.common.progress); a program sees them by enabling the
logger, e.g. `logging.basicConfig(level=logging.INFO)` prints lines such as `upcycling 3/8 model.layers.5.mlp`.

Each record carries `record.progress = (task, done, total, note)` for handlers that draw bars. One mechanism for
every depth of call (a Trainer callback, a generation loop inside an evaluation inside a training run) without
passing a callback through every signature.
"""
from __future__ import annotations

import logging

LOGGER = logging.getLogger("moekit.progress")


def report(task: str, done: int, total: int | None = None, note: str = "") -> None:
    """`done` of `total` units of `task` are finished (total None: unknown); `note` says which (a layer path, a
    language, the loss)."""
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info("%s %d/%s%s", task, done, "?" if total is None else total, f" {note}" if note else "",
                    extra={"progress": (task, done, total, note)})
