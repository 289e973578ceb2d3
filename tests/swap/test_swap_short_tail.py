"""A short last block moves with the block before it, in one I/O, checksummed per block
as before ([Note: short last block] in swap/request.py)."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

from tierzero.swap import SwapError, SwapStore, aligned_empty
from tierzero.swap.fileio import FileIO
from tierzero.swap.future import SwapFuture
from tierzero.swap.header import HEADER_BYTES, combine_block_crcs
from tierzero.swap.request import TAIL_RIDES, Request, max_task_bytes
from tierzero.swap.scratch import SUBDIR

B = 1 << 16  # block size of these stores


class CountingIO(FileIO):
    """Counts the payload and header calls of each direction."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[int]] = {"pwrite": [], "pread": []}

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        self.calls["pwrite"].append(len(buf))
        return super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        self.calls["pread"].append(len(buf))
        return super().pread(fd, buf, offset)


def _req(nbytes: int) -> Request:
    data = torch.zeros(nbytes, dtype=torch.uint8)
    return Request(op="write", key="k", future=SwapFuture("write", "k", data), data=data,
                   view=data.numpy().data, generation=1, direct_buffer=True, block_size=B)


@pytest.mark.parametrize(("nbytes", "tasks"), [
    (0, [(0, 0)]),
    (100, [(0, 100)]),
    (B, [(0, B)]),
    (B + 4096, [(0, B + 4096)]),  # the tail rides
    (B + B // TAIL_RIDES, [(0, B + B // TAIL_RIDES)]),  # the longest that rides
    (B + B // TAIL_RIDES + 4096, [(0, B), (B, B // TAIL_RIDES + 4096)]),  # too long to ride
    (3 * B + 4096, [(0, B), (B, B), (2 * B, B + 4096)]),
    (3 * B, [(0, B), (B, B), (2 * B, B)]),
])
def test_tasks_cover_the_payload_and_the_crcs_stay_per_block(
        nbytes: int, tasks: list[tuple[int, int]]) -> None:
    req = _req(nbytes)
    assert [req.block(i) for i in range(req.n_tasks)] == tasks
    assert req.n_blocks == max(1, -(-nbytes // B))
    crc = [c for i in range(req.n_tasks) for c in req.crc_blocks(i)]
    assert [b for b, _, _ in crc] == list(range(len(crc)))  # every block once, in order
    assert all(n <= B for _, _, n in crc) and sum(n for _, _, n in crc) == nbytes
    assert all(length <= max_task_bytes(B) for _, length in tasks)


def test_a_block_and_a_short_tail_are_one_io_each_way(tmp_path: Path) -> None:
    io = CountingIO()
    tail = B // TAIL_RIDES
    data = aligned_empty(B + tail, torch.uint8)
    data.copy_(torch.randint(0, 256, (B + tail,), dtype=torch.uint8))
    with SwapStore(tmp_path, fileio=io, block_size=B, verify=True) as s:
        before = {k: len(v) for k, v in io.calls.items()}
        s.write("k", data).wait()
        assert sorted(io.calls["pwrite"][before["pwrite"]:]) == [HEADER_BYTES, B + tail]
        out = s.read("k", out=aligned_empty(B + tail, torch.uint8)).wait()
        assert sorted(io.calls["pread"][before["pread"]:]) == [HEADER_BYTES, B + tail]
        assert torch.equal(out, data)
        # the checksum is that of per-block CRCs, as when the tail moved on its own
        raw = data.numpy().tobytes()
        want = combine_block_crcs([zlib.crc32(raw[:B]), zlib.crc32(raw[B:])])
        assert s._index["k"].checksum == want


def test_unaligned_buffer_with_a_riding_tail_goes_through_the_bounce(tmp_path: Path) -> None:
    base = torch.randint(0, 256, (3 * B + 1000 + 1,), dtype=torch.uint8)
    data = base[1:]  # not ALIGN-aligned
    with SwapStore(tmp_path, block_size=B, verify=True) as s:
        s.write("k", data).wait()
        out = torch.empty(3 * B + 1000 + 1, dtype=torch.uint8)[1:]
        s.read("k", out=out).wait()
        assert torch.equal(out, data)
        assert s.stats().write.bounced_bytes > 0 or not s.direct


def test_a_flipped_byte_in_a_riding_tail_is_caught(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (B + B // TAIL_RIDES,), dtype=torch.uint8)
    with SwapStore(tmp_path, block_size=B, verify=True) as s:
        s.write("k", data).wait()
        (path,) = (tmp_path / SUBDIR).glob("*.scratch.swp")
        at = s._index["k"].offset + HEADER_BYTES + B + 100  # inside the tail
        fd = os.open(path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old[0] ^ 0xFF]), at)
        finally:
            os.close(fd)
        with pytest.raises(SwapError, match="checksum"):
            s.read("k").wait()
