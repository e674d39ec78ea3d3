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
    """`fill`: the package whose modules register into this registry, imported on the first lookup, so that a
    lookup never depends on what was imported before (and the registry's owner need not import that package)."""

    def __init__(self, kind: str, fill: str | None = None):
        self.kind, self.fill = kind, fill
        self._items: dict[str, T] = {}

    def _filled(self) -> dict[str, T]:
        if self.fill is not None:
            package, self.fill = self.fill, None
            importlib.import_module(package)
        return self._items

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if not isinstance(name, str):  # a list or mapping from an untrusted file would raise TypeError below
            raise ConfigError(f"{self.kind} must be a name, got {name!r:.100}")
        try:
            return self._filled()[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._filled())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._filled()


def declared(package: str, registry: str) -> dict[str, str]:
    """{name: the registered class's docstring} for every name the modules of `package` register in `registry`
    (`@REGISTRY.register("name")` on a class, or `REGISTRY.register("name")(Class(...))`; "" for any other object),
    sorted by name and read from their source without importing them: the command line lists the choices of its
    options this way without importing torch. Its names equal `REGISTRY.names()` (tested)."""
    return {name: (ast.get_docstring(c) or "") if c is not None else "" for name, c in
            _declared_classes(package, registry)[0].items()}


def declared_fields(package: str, registry: str) -> dict[str, list[tuple[str, str | None, list[str] | None]]]:
    """{name: [(field, default as str(value) or None if required, a Literal's choices or None)]} of the pydantic
    config class each name registers, its bases' fields first (bases defined in `package`), ClassVars and the
    `method` tag left out; read from the source like `declared` (moekit list methods, without torch)."""
    found, classes = _declared_classes(package, registry)
    out = {}
    for name, cls in found.items():
        chain, c = [], cls
        while c is not None:
            chain.insert(0, c)
            c = next((classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes), None)
        fields = {}
        for c in chain:
            for node in c.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                        "ClassVar" not in ast.unparse(node.annotation) and node.target.id != "method":
                    fields[node.target.id] = (_default(node.value), _choices(node.annotation))
        out[name] = [(k, d, ch) for k, (d, ch) in fields.items()]
    return out


def _declared_classes(package: str, registry: str) -> tuple[dict[str, ast.ClassDef | None], dict[str, ast.ClassDef]]:
    """({registered name: its class's definition, None for another object}, {class name: definition}) over the
    modules of `package`."""
    spec = importlib.util.find_spec(package)
    found, classes, made = {}, {}, {}
    for folder in spec.submodule_search_locations:
        for path in sorted(Path(folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = node
                    for call in node.decorator_list:
                        if _registers(call, registry):
                            found.setdefault(call.args[0].value, node)
                elif isinstance(node, ast.Call) and _registers(node.func, registry):
                    arg = node.args[0] if node.args else None  # REGISTRY.register("name")(Class(...))
                    made[node.func.args[0].value] = arg.func.id if isinstance(arg, ast.Call) and \
                        isinstance(arg.func, ast.Name) else None
    for name, cls in made.items():
        found.setdefault(name, classes.get(cls))
    return dict(sorted(found.items())), classes


def _default(value: ast.expr | None) -> str | None:
    """str() of a field's default as pydantic computes it (`= v`, `Field(v, ...)`, `Field(default=v)`,
    `Field(default_factory=list)`), or None for a required field."""
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
        kw = {k.arg: k.value for k in value.keywords}
        if "default_factory" in kw:
            return str({"list": [], "dict": {}, "tuple": ()}[ast.unparse(kw["default_factory"])])
        value = value.args[0] if value.args else kw.get("default")
        if isinstance(value, ast.Constant) and value.value is Ellipsis:
            value = None
    return None if value is None else str(ast.literal_eval(value))


def _choices(annotation: ast.expr) -> list[str] | None:
    """The values of a `Literal[...]` annotation, as strings."""
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("Literal", "typing.Literal"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return [str(ast.literal_eval(i)) for i in items]
    return None


def _registers(node: ast.AST, registry: str) -> bool:
    """Whether `node` is the call `registry.register("name")`."""
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "register" and isinstance(f.value, ast.Name)
            and f.value.id == registry and len(node.args) == 1 and isinstance(node.args[0], ast.Constant))
