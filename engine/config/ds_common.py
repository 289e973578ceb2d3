"""Shared pieces of the DeepSpeed mapping: the result object and section helpers."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierzero.engine.config import values
from tierzero.engine.config.errors import ConfigError

log = logging.getLogger("tierzero.engine.config.deepspeed")


@dataclass
class Mapped:
    """A DeepSpeed config as a native mapping, plus what was not acted on."""

    native: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why each ignored key is not acted on
    origin: dict[str, str] = field(default_factory=dict)  # native key -> DeepSpeed key
    # DeepSpeed key -> factor of the run length its "auto" waits for
    # ([Note: auto run length] in hf_auto.py)
    run_length: dict[str, float] = field(default_factory=dict)

    def set(self, native_key: str, value: Any, ds_key: str) -> None:
        node = self.native
        *parents, leaf = native_key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.origin[native_key] = ds_key

    def ignore(self, ds_key: str, reason: str) -> None:
        self.ignored.append(ds_key)
        self.reasons.append(reason)


def section(data: Mapping[str, Any], key: str, prefix: str = "") -> Mapping[str, Any]:
    """data[key] as a mapping ({} when absent or null)."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{prefix}{key}", f"{value!r} is not allowed; allowed: a JSON object")
    return value


def check_keys(section: Mapping[str, Any], known: Iterable[str], prefix: str) -> None:
    """Unknown keys in a section DeepSpeed validates strictly are errors."""
    known = sorted(known)
    for key in section:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}", "unknown DeepSpeed key"
                              + values.did_you_mean(key, known)
                              + "; allowed here: " + ", ".join(known))


# What DeepSpeed's pydantic config models take for a bool (lax mode), beside true/false.
_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0"})


def ds_bool(raw: Any, ds_key: str) -> bool:
    """A DeepSpeed switch as DeepSpeed's config models read it: true/false, 1/0, and the
    strings "true"/"false", "yes"/"no", "on"/"off", "1"/"0", "t"/"f", "y"/"n" (any case)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int | float) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(ds_key, f"{raw!r} is not allowed; allowed: true or false (DeepSpeed "
                      "also takes 1/0 and the strings yes/no, on/off, true/false)")


def elements_to_bytes(raw: Any, itemsize: int, ds_key: str) -> int:
    """See [Note: DeepSpeed element counts] in deepspeed.py."""
    count: int = values.coerce(raw, int, {"ge": 0}, ds_key)
    return count * itemsize
