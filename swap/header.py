"""Region header and payload checksum of a swap file.

[Note: swap file layout]
A store owns one data file, `<directory>/tierzero-swap-<uid>/swap-<pid>-<token>.scratch.swp`
(scratch: never a checkpoint; removed on close, at exit, or by the next store
when its owner is dead, see scratch.py). The file is a sequence of regions,
each starting on an ALIGN (4 KiB) boundary, one region per stored key:

    offset r             r + ALIGN                         r + ALIGN + pad(nbytes)
    | header (ALIGN bytes) | payload (nbytes, zero-padded to ALIGN) |

Header, little-endian:

    0    8  magic b"TZSWAP\\x00\\x01"
    8    4  u32 header version (1)
    12   4  u32 flags (bit 0: payload checksum present)
    16   8  u64 write generation (store-wide counter, new on every write)
    24   8  u64 nbytes of payload
    32   4  u32 payload checksum (see below)
    36   4  u32 checksum block size in bytes
    40   4  u32 ndim
    44   4  u32 key length in bytes (utf-8)
    48  24  dtype name, ascii, zero-padded ("float32", "bfloat16", ...)
    72  8*ndim  i64 shape
    ..      key bytes
    4092 4  u32 CRC-32 of bytes [0, 4092)

Payload checksum: the payload is cut into blocks of `block size` bytes (the
last one shorter); each block's CRC-32 is taken by the I/O thread that moves
it (in parallel, GIL released), and the checksum is the CRC-32 of those block
CRCs packed as little-endian u32s. The header is written after every payload
block has landed, so a region with a valid header has a complete payload.
CRC-32 is the zlib polynomial; ISA-L's implementation (package `isal`, about ten
times zlib's speed: benchmarks/RESULTS.md) is used when installed, zlib otherwise:
the values are identical.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tierzero.swap.aligned import ALIGN

__all__ = [
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_NDIM",
    "Header",
    "combine_block_crcs",
    "crc32",
    "dtype_from_name",
    "dtype_name",
]

log = logging.getLogger(__name__)

HEADER_BYTES = ALIGN
MAGIC = b"TZSWAP\x00\x01"
VERSION = 1
FLAG_CHECKSUM = 1
MAX_NDIM = 32
_FIXED = struct.Struct("<8sIIQQIIII24s")  # 72 bytes, fields 0..72 above
_KEY_AT = _FIXED.size  # key follows the shape; shape at 72
_CRC_AT = HEADER_BYTES - 4
MAX_KEY_BYTES = _CRC_AT - _FIXED.size - 8 * MAX_NDIM


def _pick_crc32() -> Callable[[bytes | memoryview, int], int]:
    try:
        from isal import isal_zlib
    except ImportError:
        log.info("isal not installed: payload checksums use zlib.crc32 (about 2 GB/s per core)")
        return zlib.crc32
    fn: Callable[[bytes | memoryview, int], int] = isal_zlib.crc32
    return fn


crc32: Callable[[bytes | memoryview, int], int] = _pick_crc32()


def combine_block_crcs(block_crcs: Sequence[int]) -> int:
    """The payload checksum from the per-block CRCs, in block order."""
    return zlib.crc32(struct.pack(f"<{len(block_crcs)}I", *block_crcs))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype | None:
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


@dataclass(frozen=True)
class Header:
    """One region's header (see [Note: swap file layout])."""

    key: str
    generation: int
    nbytes: int
    dtype: str  # dtype_name(...)
    shape: tuple[int, ...]
    checksum: int | None  # None: written without a checksum
    block_size: int

    def pack_into(self, buf: memoryview) -> None:
        """Write the header into the first HEADER_BYTES of `buf` (zero-filled first)."""
        key = self.key.encode()
        flags = FLAG_CHECKSUM if self.checksum is not None else 0
        buf[:HEADER_BYTES] = bytes(HEADER_BYTES)
        _FIXED.pack_into(
            buf, 0, MAGIC, VERSION, flags, self.generation, self.nbytes,
            self.checksum or 0, self.block_size, len(self.shape), len(key),
            self.dtype.encode("ascii"),
        )
        struct.pack_into(f"<{len(self.shape)}q", buf, _KEY_AT, *self.shape)
        at = _KEY_AT + 8 * len(self.shape)
        buf[at : at + len(key)] = key
        struct.pack_into("<I", buf, _CRC_AT, zlib.crc32(buf[:_CRC_AT]))

    @classmethod
    def unpack(cls, buf: memoryview) -> Header:
        """Parse a header; ValueError says what is wrong with it."""
        if len(buf) < HEADER_BYTES:
            raise ValueError(f"header is {len(buf)} bytes, expected {HEADER_BYTES}")
        (stored_crc,) = struct.unpack_from("<I", buf, _CRC_AT)
        if zlib.crc32(buf[:_CRC_AT]) != stored_crc:
            raise ValueError("header checksum mismatch (header bytes corrupted)")
        magic, version, flags, gen, nbytes, checksum, block, ndim, keylen, dtype = (
            _FIXED.unpack_from(buf, 0)
        )
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a tierzero swap header (magic {magic!r}, version {version})")
        if ndim > MAX_NDIM or keylen > MAX_KEY_BYTES:
            raise ValueError(f"header has ndim {ndim} / key length {keylen} out of range")
        shape = struct.unpack_from(f"<{ndim}q", buf, _KEY_AT)
        at = _KEY_AT + 8 * ndim
        return cls(
            key=bytes(buf[at : at + keylen]).decode(),
            generation=gen,
            nbytes=nbytes,
            dtype=dtype.rstrip(b"\x00").decode("ascii"),
            shape=tuple(shape),
            checksum=checksum if flags & FLAG_CHECKSUM else None,
            block_size=block,
        )
