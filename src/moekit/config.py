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
        node[leaf] = yaml.safe_load(raw)
    return out


def load_yaml(path: str | Path, cls: type[C], overrides: list[str] | None = None) -> C:
    return validate(cls, apply_overrides(read_yaml(path), overrides or []), source=str(path))


def read_yaml(path: str | Path) -> dict:
    """The mapping in a YAML file; ConfigError if it is missing, invalid YAML, or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = read_small(path, "config file", ConfigError)
    try:
        data = yaml.safe_load(text) or {}
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a mapping at the top level")
    return data
