"""Named notes ([Note: name], STYLE.md): every reference "[Note: name] in <file>" names
the file that holds the note itself, so a reader who follows it finds the text."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("engine", "offload", "swap", "tierzero", "benchmarks", "tests", "docs")
PATH = r"((?:engine|offload|swap|tierzero|benchmarks|tests|docs)/[\w/.]+\.(?:py|c|md))"
NOTE = re.compile(r"\[Note: ([^\]]+)\]")
REF = re.compile(r"\[Note: ([^\]]+)\][\s#`*]*(?:in|,)?[\s#`*]*" + PATH)


def _name(raw: str) -> str:
    return " ".join(raw.replace("#", " ").replace("//", " ").replace("*", " ").split())


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for tree in TREES:
        out += [p for p in (ROOT / tree).rglob("*")
                if p.suffix in (".py", ".md", ".c") and p.is_file()]
    return out


def _held(text: str) -> set[str]:
    """Notes a file holds: each "[Note: name]" that is not a reference to another file."""
    refs = {m.start() for m in REF.finditer(text)}
    return {_name(m.group(1)) for m in NOTE.finditer(text) if m.start() not in refs}


def test_every_note_reference_names_the_file_that_holds_it() -> None:
    texts = {p.relative_to(ROOT).as_posix(): p.read_text(errors="ignore") for p in _files()}
    held = {path: _held(text) for path, text in texts.items()}
    wrong = []
    for path, text in texts.items():
        for m in REF.finditer(text):
            name, where = _name(m.group(1)), m.group(2)
            if name not in held.get(where, set()):
                owners = sorted(p for p, names in held.items() if name in names)
                wrong.append(f"{path}: [Note: {name}] in {where}; held by {owners}")
    assert not wrong, "\n".join(wrong)
