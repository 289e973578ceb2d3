"""engine.load_config: a file (native YAML/JSON or DeepSpeed JSON), a mapping, or the default."""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import yaml

from tierzero.engine.config import deepspeed, native
from tierzero.engine.config.errors import ConfigError
from tierzero.engine.config.schema import Config

log = logging.getLogger(__name__)

DEFAULT_RESOURCE = "default.yaml"  # in the `configs` package (package data)

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | None


def load_config(source: ConfigSource = None, *,
                auto_values: Mapping[str, Any] | None = None) -> Config:
    """Load, map and validate a config.

    `source`: a path to a YAML/JSON file, an already-parsed mapping, or None for
    the embedded default (configs/default.yaml, read from package data).
    Native and DeepSpeed configs are told apart by their keys.
    `auto_values`: Hugging Face TrainingArguments values (plus `world_size`,
    `hidden_size`) that resolve `"auto"` in a DeepSpeed config; unused for
    native configs. Raises ConfigError naming the file, key, value and what is
    allowed.
    """
    file: str | None = None
    if source is None:
        file = f"<package configs/{DEFAULT_RESOURCE}>"
        text = importlib.resources.files("tierzero.configs").joinpath(DEFAULT_RESOURCE).read_text()
        data = _parse(text, file, is_json=False)
    elif isinstance(source, Mapping):
        data = source
    elif isinstance(source, str | os.PathLike):
        file = os.fspath(source)
        data = _parse(_read(file), file, is_json=file.endswith(".json"))
    else:
        raise ConfigError("", f"cannot load a config from {source!r}; allowed: a path, a mapping "
                          "or None (the embedded default)")
    try:
        return from_mapping(data, auto_values)
    except ConfigError as exc:
        raise exc.in_file(file) if file else exc from None


def from_mapping(data: Any, auto_values: Mapping[str, Any] | None = None) -> Config:
    """A Config from a parsed mapping, native or DeepSpeed."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("", f"the top level is {type(data).__name__} {data!r}; allowed: a "
                          "mapping of keys to values")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(str(bad[0]), "keys must be strings")
    if not deepspeed.is_deepspeed(data):
        return native.build(Config, data)
    mixed = [k for k in data if k in native.TOP_ONLY]
    if mixed:
        raise ConfigError(mixed[0], "is a native tierzero key in a DeepSpeed config (found "
                          f"DeepSpeed keys too: {', '.join(k for k in data if k not in mixed)}); "
                          "use one schema per file")
    mapped = deepspeed.to_native(data, auto_values)
    try:
        config = native.build(Config, mapped.native, source="deepspeed",
                              ignored_keys=tuple(mapped.ignored),
                              ignored_reasons=tuple(mapped.reasons),
                              run_length_auto=tuple(mapped.run_length.items()))
    except ConfigError as exc:
        ds_key = mapped.origin.get(exc.key)
        if ds_key is None:
            raise
        raise ConfigError(ds_key, f"{exc.problem} (as tierzero's {exc.key})") from None
    if mapped.ignored:
        # The one report of them (config check prints them again, on request);
        # every rank loads the config, so only rank 0 (torchrun's RANK) warns.
        level = logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.DEBUG
        log.log(level, "DeepSpeed keys accepted but not acted on: %s", "; ".join(
            f"{key} ({why})" for key, why in zip(mapped.ignored, mapped.reasons, strict=True)))
    return config


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError("", f"cannot read config file '{path}' (errno {exc.errno}: "
                          f"{exc.strerror}); check the path", path) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(str(key), f"given twice in one mapping (second at line {line}); "
                                  "keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(key, "given twice in one JSON object; keep one")
        out[key] = value
    return out


def _parse(text: str, file: str, *, is_json: bool) -> Any:
    try:
        if is_json:
            return json.loads(text, object_pairs_hook=_no_duplicates)
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no arbitrary objects
    except ConfigError as exc:
        raise exc.in_file(file) from None
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"not valid JSON: {exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}", file) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("", f"not valid YAML: {problem}{where}", file) from None
