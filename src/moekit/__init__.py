"""moekit: Mixture-of-Experts models from dense checkpoints.

The public API is imported on first use (PEP 562), so `import moekit` and the command line's start stay
light; importing moekit registers its checkpoint format with transformers' Auto classes (moekit._auto).
"""
from importlib import import_module

from moekit import _auto
from moekit.errors import MoekitError

_API = {"MoELayer": "moekit.moe", "MoESpec": "moekit.moe", "RouterSpec": "moekit.moe", "moe_layers": "moekit.moe",
        "load": "moekit.checkpoint.format", "save": "moekit.checkpoint.format", "upcycle": "moekit.checkpoint.upcycle_model",
        "upcycle_checkpoint": "moekit.checkpoint.upcycle", "export_checkpoint": "moekit.checkpoint.upcycle",
        "export_model": "moekit.checkpoint.export", "MoETrainer": "moekit.training.trainer",
        "MoECallback": "moekit.training.trainer", "AuxConfig": "moekit.training.recipe", "load_recipe": "moekit.training.recipe",
        "FreezeConfig": "moekit.methods.freeze", "training_args": "moekit.training.args"}

__all__ = ["MoekitError", *_API]

_auto.install()


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'moekit' has no attribute {name!r}")
    value = getattr(import_module(_API[name]), name)
    globals()[name] = value
    return value
