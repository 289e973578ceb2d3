"""docs/engine.md's file map ("How it works (files)") has one row for every library file
(engine/, offload/, swap/) and none for a file that is gone, so a new contributor who reads
it finds every file, and a file added without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "engine.md"
SECTION = "## How it works (files)"
LAYERS = ("offload/", "swap/")  # rows of these name the folder; engine rows do not


def _library_files() -> set[str]:
    out = {p.relative_to(ROOT).as_posix() for p in (ROOT / "engine").rglob("*.py")}
    for layer in ("offload", "swap"):
        out |= {p.relative_to(ROOT).as_posix() for p in (ROOT / layer).iterdir()
                if p.suffix in (".py", ".c")}
    return out


def _mapped() -> list[str]:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    paths = []
    for line in text[start:end if end != -1 else None].splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            paths.append(name if name.startswith(LAYERS) else f"engine/{name}")
    return paths


def test_every_library_file_has_one_row() -> None:
    mapped = _mapped()
    files = _library_files()
    missing = sorted(files - set(mapped))
    stale = sorted(set(mapped) - files)
    twice = sorted({p for p in mapped if mapped.count(p) > 1})
    assert not missing, f"docs/engine.md's file map lacks a row for: {missing}"
    assert not stale, f"docs/engine.md's file map names files that do not exist: {stale}"
    assert not twice, f"docs/engine.md's file map lists these more than once: {twice}"
