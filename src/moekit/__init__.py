"""moekit: Mixture-of-Experts models from dense checkpoints.

Every command of the command line is a typed function here, with the command's defaults and validation
(`moekit.export`, `moekit.inspect`, `moekit.select`, `moekit.train`, ...), and `moekit.routes`, `moekit.simoe`
and `moekit.speech` are modules of functions. The public API is imported on first use (PEP 562), so
`import moekit` and the command line's start stay light; the `TYPE_CHECKING` imports below let type checkers
and documentation tools see the same names statically. Importing moekit registers its checkpoint format with
transformers' Auto classes (moekit._auto).
"""
from importlib import import_module
from typing import TYPE_CHECKING, Any

from moekit import _auto
from moekit.errors import MoekitError

if TYPE_CHECKING:
    from moekit import routes, simoe, speech
    from moekit.checkpoint.convert import export
    from moekit.checkpoint.format import load, save
    from moekit.checkpoint.summary import InspectSummary, inspect
    from moekit.checkpoint.upcycle import upcycle_checkpoint
    from moekit.checkpoint.upcycle_model import upcycle
    from moekit.methods.freeze import FreezeConfig
    from moekit.moe import MoELayer, MoESpec, RouterSpec, moe_layers
    from moekit.selection.api import prune, select
    from moekit.training.api import evaluate, finetune, finetune_plan, plan, train
    from moekit.training.args import training_args
    from moekit.training.recipe import AuxConfig, load_recipe
    from moekit.training.simoe_run import simoe_export, simoe_report
    from moekit.training.trainer import MoECallback, MoETrainer

    __version__: str

_API = {"MoELayer": "moekit.moe", "MoESpec": "moekit.moe", "RouterSpec": "moekit.moe", "moe_layers": "moekit.moe",
        "load": "moekit.checkpoint.format", "save": "moekit.checkpoint.format",
        "upcycle": "moekit.checkpoint.upcycle_model", "upcycle_checkpoint": "moekit.checkpoint.upcycle",
        "export": "moekit.checkpoint.convert", "inspect": "moekit.checkpoint.summary",
        "InspectSummary": "moekit.checkpoint.summary", "select": "moekit.selection.api",
        "prune": "moekit.selection.api", "finetune": "moekit.training.api", "finetune_plan": "moekit.training.api",
        "train": "moekit.training.api",
        "evaluate": "moekit.training.api", "plan": "moekit.training.api",
        "MoETrainer": "moekit.training.trainer", "MoECallback": "moekit.training.trainer",
        "AuxConfig": "moekit.training.recipe", "load_recipe": "moekit.training.recipe",
        "FreezeConfig": "moekit.methods.freeze", "training_args": "moekit.training.args",
        "simoe_report": "moekit.training.simoe_run", "simoe_export": "moekit.training.simoe_run"}
_MODULES = ("routes", "simoe", "speech")  # public modules of functions (`moekit.routes.collect`)

__all__ = ["InspectSummary", "MoECallback", "MoELayer", "MoESpec", "MoETrainer", "MoekitError", "AuxConfig", "FreezeConfig",
           "RouterSpec", "__version__", "evaluate", "export", "finetune", "finetune_plan", "inspect", "load",
           "load_recipe",
           "moe_layers", "plan", "prune", "routes", "save", "select", "simoe", "simoe_export", "simoe_report",
           "speech", "train", "training_args",
           "upcycle", "upcycle_checkpoint"]  # written out for static readers (griffe); tests/test_api.py: = _API's

_auto.install()


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from moekit._version import version

        value: Any = version()
    elif name in _MODULES:
        value = import_module(f"moekit.{name}")
    elif name in _API:
        value = getattr(import_module(_API[name]), name)
    else:
        raise AttributeError(f"module 'moekit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
