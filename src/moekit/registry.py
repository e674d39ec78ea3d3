"""A tiny name -> object registry; one registry per extension point (init methods, exporters, ...)."""
from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from moekit.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def declared(package: str, registry: str) -> dict[str, str]:
    """{name: the registered class's docstring ("" for an object)} for every name the modules
    of `package` register in `registry` (`@REGISTRY.register("name")` on a class, or
    `REGISTRY.register("name")(obj)`), sorted by name and read from their source without importing them: the
    command line lists the choices of its options this way without importing torch. Its names equal
    `REGISTRY.names()` (tested)."""
    spec = importlib.util.find_spec(package)
    found = {}
    for folder in spec.submodule_search_locations:
        for path in Path(folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                for call in getattr(node, "decorator_list", [node]):
                    if _registers(call, registry):
                        doc = ast.get_docstring(node) if isinstance(node, ast.ClassDef) else None
                        found.setdefault(call.args[0].value, doc or "")  # a class comes before its decorator
    return dict(sorted(found.items()))


def _registers(node: ast.AST, registry: str) -> bool:
    """Whether `node` is the call `registry.register("name")`."""
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "register" and isinstance(f.value, ast.Name)
            and f.value.id == registry and len(node.args) == 1 and isinstance(node.args[0], ast.Constant))
