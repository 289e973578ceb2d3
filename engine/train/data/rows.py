"""Dataset files -> rows, each with the place it came from (for errors that name it).

Formats, told apart by the path:
- `.txt`: plain text; each block of lines separated by blank lines is a row
  {"text": ...} (where: `file:line` of its first line);
- `.jsonl`: one JSON object per non-empty line (where: `file:line`);
- `.parquet`, `.arrow`: a table, one row per record (where: `file row N`, 1-based),
  read through `datasets` (Arrow memory-mapped, nothing cached elsewhere);
- a directory written by `datasets.save_to_disk`: a Dataset, or a DatasetDict
  whose `train` split trains and whose `validation` (else `test`) split is the
  evaluation set.

What a row means (text, prompt/completion, chat messages) is encode.py's job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tierzero.engine.train.data.errors import DataError

TABLE_EXTENSIONS = (".parquet", ".arrow")
EXTENSIONS = (".txt", ".jsonl", *TABLE_EXTENSIONS)
ALLOWED = ("a .txt, .jsonl, .parquet or .arrow file, or a directory written by "
           "datasets' save_to_disk")

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Row:
    where: str  # "data.jsonl:12", "data.parquet row 12"
    data: Mapping[str, Any]


def check_path(path: str, key: str) -> None:
    """Refuse, before any work, a path that is neither a known file type nor a directory."""
    if os.path.isdir(path):
        return
    if not os.path.isfile(path):
        raise DataError(f"{key}: '{path}' is not a file or directory; give {ALLOWED}")
    if not path.endswith(EXTENSIONS):
        raise DataError(f"{key}: '{path}' has an unknown extension; allowed: "
                        + ", ".join(EXTENSIONS) + ", or a save_to_disk directory")


def read_rows(path: str, key: str, split: Split = "train") -> list[Row]:
    """Every row of the dataset at `path` (`key` names the config key in errors)."""
    check_path(path, key)
    if os.path.isdir(path):
        return list(_disk_rows(path, split))
    if path.endswith(".txt"):
        return _text_rows(path)
    if path.endswith(".jsonl"):
        return list(_jsonl_rows(path))
    return list(_table_rows(path))


def text_rows(lines: Iterable[str], name: str) -> list[Row]:
    """Blocks of non-blank lines as {"text": ...} rows, each named `name:<first line>`."""
    out: list[Row] = []
    block: list[str] = []
    first = 0
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            if not block:
                first = lineno
            block.append(line)
        elif block:
            out.append(Row(f"{name}:{first}", {"text": "".join(block).rstrip("\n")}))
            block = []
    if block:
        out.append(Row(f"{name}:{first}", {"text": "".join(block).rstrip("\n")}))
    return out


def _text_rows(path: str) -> list[Row]:
    with open(path, encoding="utf-8") as f:
        try:
            return text_rows(f, path)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _jsonl_rows(path: str) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(data, dict):
                raise DataError(f"{path}:{lineno}: a JSON {type(data).__name__}; allowed: an "
                                "object per line")
            yield Row(f"{path}:{lineno}", data)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError("Parquet, Arrow and save_to_disk datasets need the datasets package: "
                        "pip install 'tierzero[data]'") from exc
    return datasets


def _table_rows(path: str) -> Iterator[Row]:
    ds = _datasets()
    try:
        if path.endswith(".arrow"):
            table = ds.Dataset.from_file(path)  # memory-mapped in place, no cache files
        else:
            import pyarrow.parquet as pq
            table = ds.Dataset(pq.read_table(path))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as {path.rsplit('.', 1)[-1]} "
                        f"({type(exc).__name__}: {exc})") from exc
    for i, data in enumerate(table, 1):
        yield Row(f"{path} row {i}", data)


def _disk_rows(path: str, split: Split) -> Iterator[Row]:
    ds = _datasets()
    try:
        loaded = ds.load_from_disk(path)
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DataError(f"'{path}' is a directory but not one datasets.save_to_disk wrote "
                        f"({type(exc).__name__}: {exc}); give {ALLOWED}") from exc
    name = ""
    if isinstance(loaded, ds.DatasetDict):
        wanted = ("train",) if split == "train" else ("validation", "test")
        found = [s for s in wanted if s in loaded]
        if not found:
            raise DataError(f"{path}: a DatasetDict with splits {sorted(loaded)}; the "
                            f"{split} set needs a split named {' or '.join(wanted)}")
        name = f" [{found[0]}]"
        loaded = loaded[found[0]]
    for i, data in enumerate(loaded, 1):
        yield Row(f"{path}{name} row {i}", data)
