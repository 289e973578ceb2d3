"""Leaf values: coercion from YAML/JSON scalars to a field's type, bounds, messages.

One function per kind of value; every failure is a ConfigError naming the key,
the value seen and what is allowed. Byte sizes accept ints, integral floats
(``1e9``) and strings (``"5e8"``, ``"512MiB"``, ``"2GB"``); paths expand ``~``
and ``$VARS``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import Field
from typing import Any, Literal, Union

from tierzero.engine.config.errors import ConfigError

# Decimal and binary multiples; matched without regard to case ("512mib").
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_ENV_RE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
BYTES_FORMS = "an int, an integral float like 1e9, or a string like '5e8', '512MiB', '2GB'"
# Every integer (counts, byte sizes) ends up in C: an OS call, a torch size or a seed.
INT_MAX = 2**63 - 1


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when none is close."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean '{by_lower[close[0]]}'?)" if close else ""


def split_optional(hint: Any) -> tuple[Any, bool]:
    """(inner type, accepts None) for `X | None`; (hint, False) otherwise."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def describe(hint: Any, meta: Mapping[str, Any], *, short: bool = False) -> str:
    """What a field accepts, in words, for error messages and (`short`) docs."""
    inner, optional = split_optional(hint)
    if meta.get("unit") == "bytes":
        text = "a byte size" if short else f"a byte size ({BYTES_FORMS})"
    elif typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(inner))
    elif inner is bool:
        text = "true or false"
    elif inner == bool | str:
        text = "true, false or a path"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a directory path" if meta.get("path") else "a string"
    elif inner == tuple[str, ...]:
        text = "a list of strings"
    elif inner == tuple[float, float]:
        text = "a list of two numbers"
    else:
        text = str(inner)
    bounds = [f"{op} {_num(meta[k])}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="))
              if meta.get(k) is not None]
    if bounds:
        text += " " + " and ".join(bounds)
    return f"null or {text}" if optional else text


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _check_int(value: int, key: str, raw: Any, hint: Any, meta: Mapping[str, Any]) -> int:
    if abs(value) > INT_MAX:
        raise _bad(key, raw, hint, meta, f"too large: more than {INT_MAX}")
    return value


def _bad(key: str, raw: Any, hint: Any, meta: Mapping[str, Any], why: str = "") -> ConfigError:
    reason = f" ({why})" if why else ""
    return ConfigError(key, f"{raw!r} is not allowed{reason}; allowed: {describe(hint, meta)}")


def parse_bytes(raw: Any, key: str, hint: Any, meta: Mapping[str, Any]) -> int:
    """Byte size from an int, integral float or size string."""
    if isinstance(raw, bool):
        raise _bad(key, raw, hint, meta)
    if isinstance(raw, int):
        return _check_int(raw, key, raw, hint, meta)
    if isinstance(raw, float):
        if not math.isfinite(raw) or raw != int(raw):
            raise _bad(key, raw, hint, meta, "not a whole number of bytes")
        return _check_int(int(raw), key, raw, hint, meta)
    if isinstance(raw, str):
        match = _SIZE_RE.match(raw)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            why = "unknown unit; use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB" if match else ""
            raise _bad(key, raw, hint, meta, why)
        number = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(number):
            raise _bad(key, raw, hint, meta, "not finite")
        if number != int(number):
            raise _bad(key, raw, hint, meta, "not a whole number of bytes")
        return _check_int(int(number), key, raw, hint, meta)
    raise _bad(key, raw, hint, meta)


def expand_path(raw: str, key: str) -> str:
    """`~` and `$VARS` expanded; an unset variable is an error, not left in the path."""
    missing = [name for name in _ENV_RE.findall(raw) if name not in os.environ]
    if missing:
        raise ConfigError(
            key, f"{raw!r} uses the unset environment variable ${missing[0]}; "
            f"set it or write the path out",
        )
    return os.path.expanduser(os.path.expandvars(raw))


def _number(raw: Any, key: str, hint: Any, meta: Mapping[str, Any], *, integer: bool) -> Any:
    value = raw
    if isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise _bad(key, raw, hint, meta) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(key, raw, hint, meta)
    if not math.isfinite(value):
        raise _bad(key, raw, hint, meta, "not finite")
    if integer:
        if value != int(value):
            raise _bad(key, raw, hint, meta, "not a whole number")
        return _check_int(int(value), key, raw, hint, meta)
    return float(value)


def coerce(raw: Any, hint: Any, meta: Mapping[str, Any], key: str) -> Any:
    """`raw` (a YAML/JSON scalar or list) as a value of type `hint`, bounds checked."""
    inner, optional = split_optional(hint)
    if raw is None:
        if optional:
            return None
        raise _bad(key, raw, hint, meta)
    value: Any
    if meta.get("unit") == "bytes":
        value = parse_bytes(raw, key, hint, meta)
    elif typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if raw not in choices:
            hint_text = did_you_mean(str(raw), choices) if isinstance(raw, str) else ""
            raise ConfigError(key, f"{raw!r} is not allowed{hint_text}; allowed: "
                              f"{describe(hint, meta)}")
        value = raw
    elif inner is bool:
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        elif isinstance(raw, bool):
            value = raw
        else:
            raise _bad(key, raw, hint, meta)
    elif inner == bool | str:  # a switch that may name its target instead of `true`
        if isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        elif isinstance(raw, str) and raw.strip():
            value = expand_path(raw, key) if meta.get("path") else raw
        else:
            raise _bad(key, raw, hint, meta)
    elif inner is int:
        value = _number(raw, key, hint, meta, integer=True)
    elif inner is float:
        value = _number(raw, key, hint, meta, integer=False)
    elif inner is str:
        if not isinstance(raw, str) or not raw.strip():
            raise _bad(key, raw, hint, meta)
        value = expand_path(raw, key) if meta.get("path") else raw
    elif inner == tuple[str, ...]:
        if isinstance(raw, str) or not isinstance(raw, list | tuple):
            raise _bad(key, raw, hint, meta)
        for item in raw:
            if not isinstance(item, str) or not item.strip():
                raise _bad(key, raw, hint, meta, f"item {item!r} is not a non-empty string")
        value = tuple(raw)
    elif inner == tuple[float, float]:
        if isinstance(raw, str) or not isinstance(raw, list | tuple) or len(raw) != 2:
            raise _bad(key, raw, hint, meta)
        value = tuple(_number(v, key, hint, meta, integer=False) for v in raw)
    else:
        raise TypeError(f"config field {key} has a type the parser does not know: {hint}")
    check_bounds(value, key, hint, meta)
    return value


def check_bounds(value: Any, key: str, hint: Any, meta: Mapping[str, Any]) -> None:
    """Numeric bounds from the field's metadata (ge, gt, le); None passes."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    if (ge is not None and value < ge) or (gt is not None and value <= gt) or (
        le is not None and value > le
    ):
        raise ConfigError(key, f"{value!r} is out of range; allowed: {describe(hint, meta)}")


def field_meta(f: Field[Any]) -> Mapping[str, Any]:
    """A dataclass field's metadata (the knob() arguments)."""
    return f.metadata
