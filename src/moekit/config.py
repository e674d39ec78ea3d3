"""Config base class (frozen, extra="forbid") and YAML loading with dotted `key=value` overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from moekit._fs import read_small
from moekit.errors import ConfigError

C = TypeVar("C", bound=BaseModel)


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def validate(cls: type[C] | TypeAdapter, data: Any, source: str = "config") -> C:
    """`cls.model_validate(data)` (a model class) or `cls.validate_python(data)` (a TypeAdapter of a tagged
    union, whose tag is left out of the error locations) with pydantic's errors turned into one ConfigError."""
    union = isinstance(cls, TypeAdapter)
    where = _nul_at(data)
    if where is not None:
        raise ConfigError(f"invalid {source}: {where or '<root>'}: contains a NUL byte, which no path or name may hold")
    try:
        return cls.validate_python(data) if union else cls.model_validate(data)
    except ValidationError as e:
        problems = [f"{'.'.join(map(str, err['loc'][union:])) or '<root>'}: {err['msg']}" for err in e.errors()]
        raise ConfigError(f"invalid {source}: " + "; ".join(problems)) from None


def _nul_at(data: Any, at: str = "") -> str | None:
    """The dotted key of the first string (key or value) in `data` that holds a NUL byte, else None."""
    if isinstance(data, str):
        return at if "\x00" in data else None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for k, v in items:
        key = f"{at}.{k}" if at else str(k)
        if isinstance(k, str) and "\x00" in k:
            return key
        if (found := _nul_at(v, key)) is not None:
            return found
    return None


MAX_YAML_VALUES = 100_000  # with aliases expanded: a recipe holds hundreds, a billion-laughs document 10**9


class _Loader(yaml.SafeLoader):
    """yaml.safe_load's loader that refuses a document whose aliases expand to more than MAX_YAML_VALUES values
    before it builds anything: every reader of the document (validation, dumping) would walk them all."""

    def get_single_data(self):
        node = self.get_single_node()
        if node is not None and _expanded(node, {}) > MAX_YAML_VALUES:
            raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_VALUES} values (an alias bomb?); "
                                 "write the values out")
        return None if node is None else self.construct_document(node)


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for with every alias expanded, capped just above MAX_YAML_VALUES; each node
    is counted once however often it is aliased (so this is linear in the document), and a node inside itself
    (a recursive alias) counts as too many."""
    if id(node) not in sizes:
        sizes[id(node)] = MAX_YAML_VALUES + 1
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else ()
        sizes[id(node)] = min(1 + sum(_expanded(c, sizes) for c in children), MAX_YAML_VALUES + 1)
    return sizes[id(node)]


def parse_yaml(text: str, source: str):
    """The value of a YAML document from an untrusted `source` (plain YAML only: no tags that build Python
    objects, aliases bounded), or one ConfigError "SOURCE is not valid YAML: why"."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506  (_Loader is a SafeLoader)
    except (yaml.YAMLError, RecursionError) as e:
        why = " ".join(filter(None, (getattr(e, "context", None), getattr(e, "problem", None)))) or str(e)
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{source} is not valid YAML: {' '.join(why.split())}{at}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a copy."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a mapping")
        node[leaf] = parse_yaml(raw, f"override {item!r}")
    return out


def load_yaml(path: str | Path, cls: type[C], overrides: list[str] | None = None) -> C:
    return validate(cls, apply_overrides(read_yaml(path), overrides or []), source=str(path))


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file; ConfigError if it is missing, invalid YAML, or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = parse_yaml(read_small(path, "config file", ConfigError), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a mapping at the top level")
    return data


def resolve_device(name: str) -> str:
    """A device name as torch takes it: cpu, cuda, cuda:N; "auto" is cuda where torch sees one, else cpu."""
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ConfigError(f"expected a device auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "cpu":
        return name
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name}: torch sees no CUDA device here; use cpu (or auto)")
    return name
