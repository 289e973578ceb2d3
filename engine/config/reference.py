"""Markdown tables for docs/config.md, rendered from the schema and the DeepSpeed tables.

docs/config.md embeds these between `<!-- generated:NAME -->` markers; a test
checks they match, so the reference cannot drift from the code. Regenerate
with `python -m tierzero.engine.config.reference docs/config.md`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any

from tierzero.engine.config import deepspeed, ds_offload, values
from tierzero.engine.config.checks import hints
from tierzero.engine.config.schema import Config
from tierzero.swap.safe_files import write_atomic


def _default_text(value: Any, meta: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if meta.get("unit") == "bytes" and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
            if value >= size and value % size == 0:
                return f"{value} ({value // size} {unit})"
    return str(value)


def keys_table() -> str:
    """Every native key: dotted path, what it accepts, default, meaning."""
    rows = ["| key | accepts | default | meaning |", "|---|---|---|---|"]

    def walk(cls: type[Any], prefix: str) -> None:
        types_ = hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal"):
                continue
            hint = types_[f.name]
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
                continue
            default = f.default
            accepts = values.describe(hint, f.metadata, short=True).replace("'", "`")
            rows.append(f"| `{prefix}{f.name}` | {accepts} | "
                        f"`{_default_text(default, f.metadata)}` | {f.metadata['doc']} |")

    walk(Config, "")
    return "\n".join(rows)


def ignored_table() -> str:
    """DeepSpeed keys accepted but not acted on, with the reason."""
    rows = ["| DeepSpeed key | why tierzero does not act on it |", "|---|---|"]
    for key, why in sorted(deepspeed.IGNORED_TOP.items()):
        rows.append(f"| `{key}` | {why} |")
    for key, why in sorted(deepspeed.IGNORED_ZERO.items()):
        rows.append(f"| `zero_optimization.{key}` | {why} |")
    for key, why in sorted(ds_offload.OPT_IGNORED.items()):
        rows.append(f"| `zero_optimization.offload_optimizer.{key}` | {why} |")
    return "\n".join(rows)


SECTIONS = {"keys": keys_table, "ignored": ignored_table}
_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def render(doc: str) -> str:
    """`doc` with every generated block replaced by its current rendering."""
    return _BLOCK.sub(lambda m: m.group(1) + SECTIONS[m.group(2)]() + "\n" + m.group(4), doc)


if __name__ == "__main__":
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    write_atomic(path, render(text).encode(), 0o644)  # a tracked docs file
