"""Named notes ([Note: name], STYLE.md): each note is written once, and every reference to it
leads a reader to that text.

A note is *defined* where its label begins a line of a comment or docstring and its text
follows (on that line or the next ones):

    # [Note: swap file layout]
    # Each swap file starts with ...

    [Note: plan from the engine] The plan does not model the engine; it runs it.

Anything else is a *reference*: `[Note: name] in path/file.py` (also `(path/file.py)`, a
path read from the repository root, from the referencing file's folder or one above it,
or as the unique file whose path ends so), or a bare `[Note: name]`, which may point at a
note of any file. A label followed by `:`, `;`, `,`, `.` or `)` is a reference too
("[Note: gradient home]: reading them after backward costs no disk read").
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("engine", "offload", "swap", "tierzero", "benchmarks", "tests", "docs")
SELF = "tests/test_notes.py"  # its docs and patterns hold placeholder labels
LABEL = re.compile(r"\[Note: ([^\]]+)\]")
# after a label: "in path", ", path", "(path)", with comment markers and backticks between
PATH_AFTER = re.compile(r"[\s#`*]*(?:in\b|,|\()?[\s#`*]*([\w/.-]+\.(?:py|c|md))\b")
LINE_START = re.compile(r"(?:^|\n)[ \t]*(?:#|//|/?\*|[rb]?(?:\"\"\"|'''))?[ \t]*$")


@dataclass(frozen=True)
class Label:
    path: str  # the file it is written in, from the repository root
    line: int
    name: str
    kind: str  # "def", "ref" (with a file) or "bare"
    target: str | None = None  # a ref's file as written


def _name(raw: str) -> str:
    # a label may run over a line break of a comment or of adjacent string literals
    raw = re.sub(r"[\"']\s*[\"']", "", raw)
    return " ".join(raw.replace("#", " ").replace("//", " ").replace("*", " ").split())


def _files() -> dict[str, str]:
    paths = [ROOT / "README.md"]
    for tree in TREES:
        paths += [p for p in (ROOT / tree).rglob("*")
                  if p.suffix in (".py", ".md", ".c") and p.is_file()]
    texts = {}
    for p in paths:
        rel = p.resolve().relative_to(ROOT).as_posix()  # tierzero/engine/... -> engine/...
        if rel != SELF:
            texts[rel] = p.read_text(errors="ignore")
    return texts


def labels(path: str, text: str) -> list[Label]:
    """Every [Note: ...] label of one file, classified."""
    out = []
    for m in LABEL.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        name = _name(m.group(1))
        ref = PATH_AFTER.match(text, m.end())
        if ref:
            out.append(Label(path, line, name, "ref", ref.group(1)))
            continue
        at_start = LINE_START.search(text[max(0, m.start() - 80):m.start()]) is not None
        nxt = text[m.end():m.end() + 1]
        if at_start and nxt not in (":", ";", ",", ".", ")"):
            out.append(Label(path, line, name, "def"))
        else:
            out.append(Label(path, line, name, "bare"))
    return out


def _scan() -> tuple[list[Label], dict[str, set[str]], set[str]]:
    texts = _files()
    found = [lab for path, text in sorted(texts.items()) for lab in labels(path, text)]
    homes: dict[str, set[str]] = defaultdict(set)
    for lab in found:
        if lab.kind == "def":
            homes[lab.name].add(lab.path)
    return found, homes, set(texts)


def _candidates(target: str, source: str, files: set[str]) -> list[str]:
    """The files `target` may mean, written in `source`: from the root, from source's
    folder or one above it, else every file whose path ends with it."""
    folder = Path(source).parent
    for base in (Path(), folder, *folder.parents):
        if (base / target).as_posix() in files:
            return [(base / target).as_posix()]
    return sorted(f for f in files if f.endswith("/" + target))


def test_every_note_is_defined_in_one_file() -> None:
    _, homes, _ = _scan()
    twice = [f"[Note: {name}] is defined in {sorted(paths)}; keep the text in one file and "
             "refer to it from the others ('[Note: name] in path/file.py')"
             for name, paths in sorted(homes.items()) if len(paths) > 1]
    assert not twice, "\n".join(twice)


def test_every_note_reference_names_the_file_that_holds_it() -> None:
    found, homes, files = _scan()
    wrong = []
    for lab in found:
        if lab.kind != "ref" or lab.target is None:
            continue
        where = _candidates(lab.target, lab.path, files)
        home = sorted(homes.get(lab.name, ()))
        if not where:
            wrong.append(f"{lab.path}:{lab.line}: [Note: {lab.name}] in {lab.target}: no such "
                         f"file; the note is defined in {home or 'no file'}")
        elif not set(where) & set(home):
            wrong.append(f"{lab.path}:{lab.line}: [Note: {lab.name}] in {lab.target} "
                         f"({', '.join(where)}); the note is defined in {home or 'no file'}")
    assert not wrong, "\n".join(wrong)


def test_every_bare_reference_names_a_note() -> None:
    found, homes, _ = _scan()
    missing = [f"{lab.path}:{lab.line}: [Note: {lab.name}] is defined nowhere"
               for lab in found if lab.kind == "bare" and lab.name not in homes]
    assert not missing, "\n".join(missing)


def test_the_classifier() -> None:
    text = ('"""[Note: a] Some text.\n"""\n# [Note: b]\n# body\nx = 1  # [Note: a]\n'
            "# see [Note: b] in engine/x.py\n# [Note: a]: a gloss\n"
            "# ([Note: c] in\n# shards/flat.py)\n")
    got = [(lab.name, lab.kind, lab.target) for lab in labels("engine/y.py", text)]
    assert got == [("a", "def", None), ("b", "def", None), ("a", "bare", None),
                   ("b", "ref", "engine/x.py"), ("a", "bare", None),
                   ("c", "ref", "shards/flat.py")]
    files = {"engine/shards/flat.py", "engine/layer_major.py", "engine/x.py"}
    assert _candidates("shards/flat.py", "engine/hf/export.py", files) == [
        "engine/shards/flat.py"]
    assert _candidates("layer_major.py", "docs/engine.md", files) == ["engine/layer_major.py"]
