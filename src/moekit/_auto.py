"""Register moekit's checkpoint format with transformers' Auto classes (moekit.checkpoint.auto) as soon as
transformers' auto modules are imported, without importing transformers at `import moekit` (which keeps the
command line's start fast): a finder on sys.meta_path wraps the loading of those two modules."""
from __future__ import annotations

import importlib.abc
import sys

CONFIG, MODELS = "transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto"


def _register(name: str) -> None:
    from moekit.checkpoint import auto

    auto.register_config() if name == CONFIG else auto.register()


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in (CONFIG, MODELS):
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     and (s := f.find_spec(name, path, target)) is not None), None)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(name)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now if transformers' auto modules are loaded, and whenever they load later."""
    for name in (CONFIG, MODELS):
        if name in sys.modules:
            _register(name)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
