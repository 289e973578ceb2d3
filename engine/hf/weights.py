"""Reading Hugging Face weight files tensor by tensor, a slice at a time.

Finds the files of a checkpoint directory, lists every tensor's name, shape
and file from headers alone (no tensor data read), and reads a flat range of
one tensor touching only the rows that hold it.

[Note: safetensors layout] (checked here so a truncated file names its tensor)

    | u64 little-endian N | N bytes of JSON header | data ... |
    header: {"<name>": {"dtype": "F32", "shape": [d0, d1, ...],
                        "data_offsets": [begin, end]},     offsets relative to data start
             "__metadata__": {...}}                         optional

A file is complete when every tensor's `end` lies within the data section.
`pytorch_model*.bin` files are torch zip archives, opened with `mmap=True`
so reading a slice pages in only that slice.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class PretrainedLoadError(ValueError):
    """A checkpoint that cannot be loaded: names the tensor, the file and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor, or (with `pieces`) one made of several laid end to end."""

    name: str
    file: Path
    shape: tuple[int, ...]
    pieces: tuple[tuple[TensorEntry, int], ...] = ()  # (part, its first flat index)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")


def _inside(directory: Path, name: str) -> bool:
    """True when the index entry `name` is a plain file name in `directory` (no absolute
    path, no '..', no symlink leading out)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    return (directory / name).resolve().parent == directory.resolve()


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory (index JSON first), or `path` itself."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise PretrainedLoadError(f"checkpoint path {str(path)!r} does not exist")
    for index in _INDEXES:
        ipath = path / index
        if ipath.is_file():
            try:
                weight_map = json.loads(ipath.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise PretrainedLoadError(f"{ipath}: not a valid index file (needs a "
                                          f"'weight_map' object): {exc}") from exc
            files = sorted({str(f) for f in weight_map.values()})
            outside = [f for f in files if not _inside(path, f)]
            if outside:
                raise PretrainedLoadError(
                    f"{ipath} names weight files outside {str(path)!r}: {outside[:5]}; an "
                    "index may only name files in its own directory (plain file names)")
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                raise PretrainedLoadError(f"{ipath} lists files that are missing from "
                                          f"{str(path)!r}: {missing[:5]}")
            return [path / f for f in files]
    for single in _SINGLES:
        if (path / single).is_file():
            return [path / single]
    found = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not found:
        raise PretrainedLoadError(
            f"no weights in {str(path)!r}: expected {_INDEXES[0]}, {_SINGLES[0]}, "
            f"{_SINGLES[1]} (or its index), or *.safetensors files")
    return found


def _safetensors_entries(file: Path) -> list[TensorEntry]:
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise PretrainedLoadError(f"{file}: truncated safetensors file ({size} bytes, "
                                          "shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise PretrainedLoadError(f"{file}: truncated safetensors file (header of {n} "
                                          f"bytes, file of {size})")
            header: dict[str, Any] = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        if isinstance(exc, PretrainedLoadError):
            raise
        raise PretrainedLoadError(f"{file}: unreadable safetensors header: {exc}") from exc
    data_bytes = size - 8 - n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = int(info["data_offsets"][1])
        if end > data_bytes:
            raise PretrainedLoadError(
                f"{file}: truncated: tensor {name!r} ends at byte {end} of the data section, "
                f"which holds only {data_bytes} bytes; re-download or re-save the checkpoint")
        out.append(TensorEntry(name, file, tuple(int(d) for d in info["shape"])))
    return out


def _bin_open(file: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError/EOFError/pickle errors alike
        raise PretrainedLoadError(f"{file}: cannot read (truncated or corrupt torch "
                                  f"archive?): {exc}") from exc
    if not isinstance(sd, dict):
        raise PretrainedLoadError(f"{file}: holds a {type(sd).__name__}, expected a "
                                  "state dict (name -> tensor)")
    return sd


def list_tensors(files: list[Path], reader: SliceReader) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint by name, from headers; duplicates are an error.
    `.bin` files are opened (memory-mapped) once, through `reader`."""
    out: dict[str, TensorEntry] = {}
    for file in files:
        if file.suffix == ".safetensors":
            entries = _safetensors_entries(file)
        else:
            sd = reader.bin_file(file)
            entries = [TensorEntry(k, file, tuple(v.shape)) for k, v in sd.items()
                       if isinstance(v, torch.Tensor)]
        for e in entries:
            if e.name in out:
                raise PretrainedLoadError(f"tensor {e.name!r} is in both {out[e.name].file} "
                                          f"and {e.file}")
            out[e.name] = e
    return out


class SliceReader:
    """Open files of one checkpoint; reads flat ranges of tensors. A context manager."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._st: dict[Path, Any] = {}
        self._bin: dict[Path, dict[str, torch.Tensor]] = {}
        self.peak_read_bytes = 0  # largest single read, bytes in the file's dtype

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._bin.clear()
        self._st.clear()
        self._stack.close()

    def read(self, entry: TensorEntry, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor (1D, the file's dtype), reading only
        the rows (along dim 0) that hold them."""
        try:
            out = self._read(entry, lo, hi)
        except PretrainedLoadError:
            raise
        except Exception as exc:
            raise PretrainedLoadError(f"{entry.file}: reading tensor {entry.name!r} failed: "
                                      f"{exc}") from exc
        self.peak_read_bytes = max(self.peak_read_bytes, out.numel() * out.element_size())
        return out

    def bin_file(self, file: Path) -> dict[str, torch.Tensor]:
        """The state dict of a `.bin` file, memory-mapped, opened once."""
        sd = self._bin.get(file)
        if sd is None:
            sd = self._bin[file] = _bin_open(file)
        return sd

    def _read(self, entry: TensorEntry, lo: int, hi: int) -> torch.Tensor:
        if entry.pieces:
            parts = [self._read(part, max(lo, at) - at, min(hi, at + part.numel) - at)
                     for part, at in entry.pieces if at < hi and at + part.numel > lo]
            return torch.cat(parts)
        if entry.file.suffix != ".safetensors":
            flat = self.bin_file(entry.file)[entry.name].reshape(-1)
            return flat[lo:hi].clone()  # pages in only [lo, hi) of the mapping
        f = self._st.get(entry.file)
        if f is None:
            f = self._st[entry.file] = self._stack.enter_context(
                safe_open(str(entry.file), framework="pt"))
        if not entry.shape:  # 0-d
            return f.get_tensor(entry.name).reshape(-1)[lo:hi]  # type: ignore[no-any-return]
        row = entry.numel // entry.shape[0] if entry.shape[0] else 1
        r0, r1 = lo // row, -(-hi // row)
        rows = f.get_slice(entry.name)[r0:r1]
        return rows.reshape(-1)[lo - r0 * row:hi - r0 * row]  # type: ignore[no-any-return]


def iter_ranges(entries: list[TensorEntry]) -> Iterator[TensorEntry]:
    """Entries ordered by file, then by name, so files are read front to back once."""
    yield from sorted(entries, key=lambda e: (str(e.file), e.name))
