"""Training progress for transformers' Trainer: optimizer steps done of max_steps with the latest training loss,
reported through moekit.progress (the command line shows a bar with an ETA on a terminal, plain lines otherwise);
nothing is printed here, and the log dicts go to log_history.json, not to the screen."""
from __future__ import annotations

from transformers import TrainerCallback

from moekit.progress import report


class TrainProgress(TrainerCallback):
    """Reports "training" after every optimizer step on the main process: `step/max_steps loss L`, L the loss of
    the last logging step (Trainer averages it over `logging_steps`)."""

    def __init__(self):
        self.loss: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # the Trainer logs after on_step_end: the step again, with its loss
            self.loss = float(logs["loss"])
            self.on_step_end(args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            report("training", state.global_step, state.max_steps, "" if self.loss is None else f"loss {self.loss:.4f}")
