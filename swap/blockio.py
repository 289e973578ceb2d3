"""Moving one block of one request between a caller's buffer and the data file.

Runs on the store's I/O threads, outside the store lock. With O_DIRECT, a
block goes straight from/to the caller's memory when the buffer is
ALIGN-aligned and the block length is a multiple of ALIGN. A block of an
unaligned caller buffer goes through the thread's own aligned bounce buffer,
zero-padded to ALIGN; of an aligned buffer whose payload ends mid-page, only that
last partial page does (the aligned head moves direct, then one page bounced).
"""

from __future__ import annotations

import dataclasses

import torch

from tierzero.swap.aligned import ALIGN, aligned_empty
from tierzero.swap.allocator import round_up
from tierzero.swap.errors import SwapError
from tierzero.swap.fileio import FileIO
from tierzero.swap.header import HEADER_BYTES, Header, combine_block_crcs, crc32, dtype_name
from tierzero.swap.request import Request, max_task_bytes

__all__ = ["BlockIO", "WorkerBuffers"]


class WorkerBuffers:
    """One I/O thread's aligned scratch memory: a bounce block and a header page."""

    def __init__(self, block_size: int) -> None:
        # 1D uint8, ALIGN-aligned: the longest I/O ([Note: short last block])
        self.bounce = aligned_empty(max_task_bytes(block_size), torch.uint8)
        self.bounce_view = self.bounce.numpy().data
        self.header = aligned_empty(HEADER_BYTES, torch.uint8)  # 1D uint8, one page
        self.header_view = self.header.numpy().data


class BlockIO:
    """Block reads/writes and header steps against one open data file."""

    def __init__(self, fileio: FileIO, fd: int, path: str, *, direct: bool, verify: bool) -> None:
        self.fileio = fileio
        self.fd = fd
        self.path = path
        self.direct = direct  # fd was opened with O_DIRECT
        self.verify = verify  # CRCs computed on write, header and CRCs checked on read
        self.checksum = verify

    def run_block(
        self, req: Request, index: int, wb: WorkerBuffers
    ) -> tuple[SwapError | None, int]:
        """Move one I/O's blocks; return (its error or None, bytes that went through the
        bounce)."""
        try:
            if req.op == "write":
                return None, self.write_block(req, index, wb)
            return None, self.read_block(req, index, wb)
        except SwapError as exc:
            return exc, 0
        except Exception as exc:  # an I/O thread must never die silently
            err = SwapError(f"unexpected error in swap I/O thread: {exc!r}", path=self.path,
                            key=req.key)
            err.__cause__ = exc
            return err, 0

    def finalize(self, req: Request, wb: WorkerBuffers) -> None:
        """Last step of a request, on the thread that finished its last block: a write's
        checksum and header (the on-disk commit), a read's verification."""
        if req.error is not None:
            return
        try:
            if req.op == "write":
                if req.entry is not None:
                    req.entry = dataclasses.replace(req.entry, checksum=self.payload_checksum(req))
                req.crcs = []
                self.write_header(req, wb)
            elif self.verify:
                self.verify_read(req, wb)
        except SwapError as exc:
            req.error = exc
        except Exception as exc:
            err = SwapError(f"unexpected error finishing swap I/O: {exc!r}", path=self.path,
                            key=req.key)
            err.__cause__ = exc
            req.error = err

    def _bounce(self, req: Request, length: int) -> bool:
        return self.direct and (not req.direct_buffer or length % ALIGN != 0)

    def write_block(self, req: Request, index: int, wb: WorkerBuffers) -> int:
        """Write block `index` of `req`; return bytes copied through the bounce buffer."""
        start, length = req.block(index)
        if length == 0:
            return 0
        if req.entry is None:
            raise SwapError("internal: write has no region", path=self.path, key=req.key)
        src = req.view[start : start + length]
        if self.checksum:
            self._crcs(req, index)
        offset = req.entry.offset + HEADER_BYTES + start
        if self._bounce(req, length) and req.direct_buffer:
            # an aligned buffer with a ragged end: only its last page goes through the bounce
            head = length - length % ALIGN
            if head:
                self._pwrite_all(req, src[:head], offset)
            tail = length - head
            wb.bounce[:tail].copy_(req.data[start + head : start + length])
            wb.bounce[tail:ALIGN].zero_()
            self._pwrite_all(req, wb.bounce_view[:ALIGN], offset + head)
            return tail
        if self._bounce(req, length):
            padded = round_up(length)
            wb.bounce[:length].copy_(req.data[start : start + length])
            wb.bounce[length:padded].zero_()
            self._pwrite_all(req, wb.bounce_view[:padded], offset)
            return length
        self._pwrite_all(req, src, offset)
        return 0

    def read_block(self, req: Request, index: int, wb: WorkerBuffers) -> int:
        """Read block `index` of `req` into the caller's buffer; return bounced bytes."""
        start, length = req.block(index)
        if length == 0:
            return 0
        if req.entry is None:
            raise SwapError("internal: read has no region", path=self.path, key=req.key)
        offset = req.entry.offset + HEADER_BYTES + start
        bounced = 0
        if self._bounce(req, length) and req.direct_buffer:
            # as in write_block: the aligned head straight into the buffer, the last page
            # through the bounce
            head = length - length % ALIGN
            if head:
                self._pread_all(req, req.view[start : start + head], offset, head)
            tail = length - head
            self._pread_all(req, wb.bounce_view[:ALIGN], offset + head, tail)
            req.data[start + head : start + length].copy_(wb.bounce[:tail])
            bounced = tail
        elif self._bounce(req, length):
            self._pread_all(req, wb.bounce_view[: round_up(length)], offset, length)
            req.data[start : start + length].copy_(wb.bounce[:length])
            bounced = length
        else:
            self._pread_all(req, req.view[start : start + length], offset, length)
        if self.verify:
            self._crcs(req, index)
        return bounced

    @staticmethod
    def _crcs(req: Request, index: int) -> None:
        """The CRC-32 of each checksum block I/O `index` moved ([Note: short last block])."""
        for block, lo, n in req.crc_blocks(index):
            req.crcs[block] = crc32(req.view[lo : lo + n], 0)

    def write_header(self, req: Request, wb: WorkerBuffers) -> None:
        """After every payload block landed: the header commits the region on disk."""
        entry = req.entry
        if entry is None:
            raise SwapError("internal: write has no region", path=self.path, key=req.key)
        Header(
            key=req.key, generation=entry.generation, nbytes=entry.nbytes,
            dtype=dtype_name(entry.dtype), shape=entry.shape, checksum=entry.checksum,
            block_size=req.block_size,
        ).pack_into(wb.header_view)
        self._pwrite_all(req, wb.header_view, entry.offset)

    def payload_checksum(self, req: Request) -> int | None:
        return combine_block_crcs(req.crcs) if self.checksum else None

    def verify_read(self, req: Request, wb: WorkerBuffers) -> None:
        """Read the region header and check it and the payload CRCs against the index."""
        entry = req.entry
        if entry is None:
            raise SwapError("internal: read has no region", path=self.path, key=req.key)
        self._pread_all(req, wb.header_view, entry.offset, HEADER_BYTES)
        try:
            header = Header.unpack(wb.header_view)
        except ValueError as exc:
            raise SwapError(
                f"swap file corrupted: region header at offset {entry.offset} is invalid "
                f"({exc})", path=self.path, key=req.key,
            ) from exc
        expect = (req.key, entry.generation, entry.nbytes, dtype_name(entry.dtype), entry.shape)
        seen = (header.key, header.generation, header.nbytes, header.dtype, header.shape)
        if seen != expect:
            raise SwapError(
                f"swap file corrupted: region header at offset {entry.offset} says "
                f"(key, generation, nbytes, dtype, shape) = {seen}, expected {expect}",
                path=self.path, key=req.key,
            )
        if entry.checksum is not None:
            got = combine_block_crcs(req.crcs)
            if got != entry.checksum:
                raise SwapError(
                    f"swap file corrupted: payload checksum {got:#010x} != {entry.checksum:#010x} "
                    f"written ({entry.nbytes} bytes at offset {entry.offset + HEADER_BYTES})",
                    path=self.path, key=req.key,
                )

    def _pwrite_all(self, req: Request, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            try:
                n = self.fileio.pwrite(self.fd, buf[done:], offset + done)
            except OSError as exc:
                raise SwapError(
                    f"write of {len(buf)} bytes at offset {offset} failed",
                    path=self.path, key=req.key, errno=exc.errno,
                ) from exc
            if n <= 0:
                raise SwapError(
                    f"short write: {done} of {len(buf)} bytes at offset {offset}",
                    path=self.path, key=req.key,
                )
            done += n

    def _pread_all(self, req: Request, buf: memoryview, offset: int, need: int) -> None:
        """Read into `buf` (length >= need, padded for O_DIRECT) until `need` bytes came."""
        got = 0
        while got < need:
            try:
                n = self.fileio.pread(self.fd, buf[got:], offset + got)
            except OSError as exc:
                raise SwapError(
                    f"read of {len(buf)} bytes at offset {offset} failed",
                    path=self.path, key=req.key, errno=exc.errno,
                ) from exc
            if n <= 0:
                raise SwapError(
                    f"short read: file ends after {got} of {need} bytes at offset {offset} "
                    "(swap file truncated?)",
                    path=self.path, key=req.key,
                )
            got += n

