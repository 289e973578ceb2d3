"""Native YAML/JSON mapping -> Config, and Config -> plain mapping (for YAML output).

The parser walks the schema's dataclasses: a mapping's keys must be field
names (a misspelt key is an error with a did-you-mean), leaves go through
values.coerce, and two shorthands are expanded here and only here:

- `precision: bf16` means `precision: {dtype: bf16}`;
- `offload: {device: nvme, path: /x, ...}` sets those keys on both
  `offload.params` and `offload.optimizer` (a key that belongs to one class
  only, like `max_in_cpu_bytes`, goes to that class); an explicit `params:` or
  `optimizer:` section next to them overrides the shorthand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from tierzero.engine.config import values
from tierzero.engine.config.checks import hints
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.schema import (
    Config,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)

T = TypeVar("T")

# Top-level keys only the native schema has (optimizer, scheduler and
# gradient_clipping are spelt the same in DeepSpeed JSON).
TOP_ONLY = frozenset({"seed", "precision", "zero", "offload", "nvme", "batch", "logging",
                      "train"})


def user_fields(cls: type[Any]) -> list[dataclasses.Field[Any]]:
    """The fields a user may write (internal ones are filled by the loader)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def build(cls: type[T], data: Any, prefix: str = "", **internal: Any) -> T:
    """An instance of the config dataclass `cls` from the mapping `data`."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "(top level)",
                          f"{data!r} is not allowed; allowed: a mapping of keys to values")
    data = _expand_shorthands(cls, data, prefix)
    fields = {f.name: f for f in user_fields(cls)}
    for key in data:
        if key not in fields:
            name = str(key)
            raise ConfigError(f"{prefix}{name}", "unknown key" + values.did_you_mean(name, fields)
                              + "; allowed here: " + ", ".join(fields))
    types_ = hints(cls)
    kwargs: dict[str, Any] = dict(internal)
    for name, raw in data.items():
        f = fields[name]
        hint = types_[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, {} if raw is None else raw, f"{prefix}{name}.")
        else:
            kwargs[name] = values.coerce(raw, hint, f.metadata, f"{prefix}{name}")
    return cls(**kwargs)


def _expand_shorthands(cls: type[Any], data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    if cls is Config and isinstance(data.get("precision"), str):
        return {**data, "precision": {"dtype": data["precision"]}}
    if cls is OffloadConfig:
        return _expand_offload(data, prefix)
    return data


def _expand_offload(data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    param_keys = {f.name for f in user_fields(ParamOffloadConfig)}
    opt_keys = {f.name for f in user_fields(OptimizerOffloadConfig)}
    short = {k: v for k, v in data.items() if k in param_keys | opt_keys}
    if not short:
        return data
    out: dict[str, Any] = {k: v for k, v in data.items() if k not in short}
    for name, keys in (("params", param_keys), ("optimizer", opt_keys)):
        explicit = out.get(name) or {}
        if not isinstance(explicit, Mapping):
            raise ConfigError(f"{prefix}{name}", f"{explicit!r} is not allowed; allowed: a mapping")
        out[name] = {**{k: v for k, v in short.items() if k in keys}, **explicit}
    return out


def as_dict(node: Any) -> dict[str, Any]:
    """A config dataclass as plain dicts, lists and scalars (YAML/JSON ready)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = as_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out
