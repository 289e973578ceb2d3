"""Durable files for checkpoints: a streaming safetensors writer, CRC-32, fsync and atomic rename.

The writer never needs the whole set of tensors in memory: the header
(names, dtypes, shapes, offsets) is known up front, so tensors are appended
one at a time in header order, each as soon as the caller has it, and the
file is fsynced on close. The result is a standard safetensors file that
`safetensors.safe_open` (and `transformers`) read.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from tierzero.swap.safe_files import create_new

log = logging.getLogger(__name__)

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _pick_crc32() -> Callable[[bytes | memoryview, int], int]:
    try:
        from isal import isal_zlib
    except ImportError:  # optional accelerator; zlib gives the same values, slower
        return zlib.crc32
    fn: Callable[[bytes | memoryview, int], int] = isal_zlib.crc32
    return fn


crc32 = _pick_crc32()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, declared before any data is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class FileDigest:
    """Size and CRC-32 of a finished file (recorded in the manifest, checked on load)."""

    nbytes: int
    crc32: int


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SafetensorsWriter:
    """Writes `entries` to `path` tensor by tensor, in the declared order.

    `write(name, tensor)` checks the name, dtype and shape against the next
    declared entry; `write_part(name, part)` appends the next bytes of the next
    entry instead (an entry streamed in pieces; it is complete when its byte count
    is reached). `close()` checks every entry was written, fsyncs and
    returns the file's digest. On an exception inside a `with` block the
    partial file is left for the caller's temporary directory to discard.
    `sync_every` (bytes; 0 = off): write the data down and drop it from the page
    cache every so many bytes, so a long background write neither fills host memory
    with dirty pages nor ends in one large flush competing with the training's I/O.
    """

    def __init__(self, path: Path, entries: Sequence[TensorEntry],
                 metadata: dict[str, str] | None = None, mode: int = 0o600, *,
                 sync_every: int = 0) -> None:
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{path}: tensor names repeat: {dup[:5]}")
        for e in entries:
            if e.dtype not in ST_DTYPES:
                raise ValueError(f"{path}: tensor {e.name!r} has dtype {e.dtype}; safetensors "
                                 f"output supports {sorted(str(d) for d in ST_DTYPES)}")
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for e in entries:
            header[e.name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.path = path
        self._entries = list(entries)
        self._next = 0
        self._crc = 0
        self._nbytes = 0
        self._partial = 0  # bytes of the next entry written by write_part so far
        self._sync_every = sync_every
        self._synced = 0  # bytes written down and dropped from the page cache
        # A new file of ours, never through a planted link (see [Note: output files]).
        self._file = os.fdopen(create_new(path, mode), "wb")
        self._put(len(raw).to_bytes(8, "little") + raw)

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._crc = crc32(data, self._crc)
        self._nbytes += len(data)
        if self._sync_every and self._nbytes - self._synced >= self._sync_every:
            self._file.flush()
            fd = self._file.fileno()
            os.fdatasync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, self._synced, self._nbytes - self._synced,
                                 os.POSIX_FADV_DONTNEED)
            self._synced = self._nbytes

    def write_part(self, name: str, part: torch.Tensor) -> None:
        """The next bytes of entry `name` (the next declared one), from a CPU tensor of any
        dtype; the entry is complete once its declared byte count has been written."""
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path}: {name!r} written after every declared tensor")
        e = self._entries[self._next]
        data = part.detach().contiguous().reshape(-1).view(torch.uint8)
        if name != e.name or self._partial + data.numel() > e.nbytes:
            left = e.nbytes - self._partial
            raise ValueError(f"{self.path}: expected {e.name!r} next with {left} bytes left; "
                             f"got {name!r} with {data.numel()} bytes")
        self._put(data.numpy().data)
        self._partial += data.numel()
        if self._partial == e.nbytes:
            self._next += 1
            self._partial = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._partial:
            raise ValueError(f"{self.path}: {name!r} written whole while "
                             f"{self._entries[self._next].name!r} is written in parts")
        if self._next >= len(self._entries):
            raise ValueError(f"{self.path}: {name!r} written after every declared tensor")
        e = self._entries[self._next]
        if name != e.name or tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
            raise ValueError(f"{self.path}: expected {e.name!r} {e.dtype} {list(e.shape)} next; "
                             f"got {name!r} {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._put(data.numpy().data)
        self._next += 1

    def close(self) -> FileDigest:
        if self._file.closed:
            return FileDigest(self._nbytes, self._crc)
        missing = [e.name for e in self._entries[self._next:]]
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: closed with {len(missing)} declared tensors "
                             f"unwritten: {missing[:5]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return FileDigest(self._nbytes, self._crc)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def write_bytes_durable(path: Path, data: bytes, mode: int = 0o600) -> FileDigest:
    """Write `data` to `path` as a new file of ours (see [Note: output files]) and fsync it
    (the caller renames or fsyncs the directory)."""
    with os.fdopen(create_new(path, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(len(data), crc32(data, 0))


def replace_durable(tmp: Path, final: Path) -> None:
    """Atomically rename `tmp` to `final` (same directory) and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def file_digest(path: Path, chunk: int = 16 << 20) -> FileDigest:
    """Size and CRC-32 of `path`, read in `chunk`-byte pieces."""
    crc, n = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            got = f.readinto(buf)
            if not got:
                break
            crc = crc32(view[:got], crc)
            n += got
    return FileDigest(n, crc)
