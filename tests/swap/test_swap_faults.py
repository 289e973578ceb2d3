"""Every fault reaches the caller as a SwapError naming file and key; none is silent."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch
from swap_helpers import FaultyIO, NoDirectIO

from tierzero.swap import SwapError, SwapStore
from tierzero.swap.header import HEADER_BYTES
from tierzero.swap.scratch import SUBDIR


def _data_file(tmp_path: Path) -> Path:
    (path,) = (tmp_path / SUBDIR).glob("*.scratch.swp")
    return path


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SwapError, match=r"does not exist.*'.*nope'"):
        SwapStore(missing)
    assert not missing.exists()  # we never create the user's directory


def test_directory_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SwapError, match="not a directory"):
        SwapStore(f)


def test_directory_not_writable(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/proc/self")  # root ignores mode bits; procfs refuses mkdir anyway
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o500)
    with pytest.raises(SwapError, match=r"cannot create swap files.*tierzero-swap.*errno"):
        SwapStore(target)


def test_not_enough_free_space_is_checked_up_front(tmp_path: Path) -> None:
    need = 1 << 60
    with pytest.raises(SwapError) as info:
        SwapStore(tmp_path, reserve_bytes=need)
    msg = str(info.value)
    assert f"need {need} bytes" in msg and "GiB) free" in msg and "ENOSPC" in msg
    assert str(tmp_path) in msg
    assert not list(tmp_path.rglob("*.swp")) and not list(tmp_path.rglob("*.lock"))


def test_reserve_preallocates(tmp_path: Path) -> None:
    with SwapStore(tmp_path, reserve_bytes=10 << 20) as s:
        assert os.stat(s.path).st_size == 10 << 20
        s.write("k", torch.zeros(1 << 20)).wait()
        assert os.stat(s.path).st_size == 10 << 20  # no growth: fits the reserve


@pytest.mark.parametrize(("err", "name"), [(errno.ENOSPC, "ENOSPC"), (errno.EIO, "EIO")])
def test_fault_mid_write_keeps_previous_contents(tmp_path: Path, err: int, name: str) -> None:
    io = FaultyIO()
    with SwapStore(tmp_path, fileio=io, block_size=1 << 16, verify=True) as s:
        old = torch.arange(200_000, dtype=torch.float32)
        s.write("k", old).wait()
        io.arm("pwrite", err, after=5)  # the 6th block of the next write fails
        fut = s.write("k", torch.zeros(200_000))
        with pytest.raises(SwapError) as info:
            fut.wait()
        msg = str(info.value)
        assert f"({name}" in msg and "'k'" in msg and s.path in msg and "failed" in msg
        assert info.value.errno == err and info.value.key == "k"
        assert torch.equal(s.read("k").wait(), old)  # previous contents still readable
        # the failed write's region went back to the allocator
        assert s.stats().used_bytes == HEADER_BYTES + 800_000 + (-800_000 % 4096)
        assert s.stats().write.failed == 1
        s.write("k", torch.ones(10)).wait()  # and the store still works
        assert torch.equal(s.read("k").wait(), torch.ones(10))


def test_fault_writing_header_fails_the_write(tmp_path: Path) -> None:
    io = FaultyIO()
    with SwapStore(tmp_path, fileio=io, block_size=1 << 16) as s:
        io.arm("pwrite", errno.EIO, after=1)  # 1 payload block, then the header
        with pytest.raises(SwapError, match="EIO"):
            s.write("new", torch.zeros(1000)).wait()
        assert "new" not in s
        with pytest.raises(SwapError, match="unknown key"):
            s.read("new", out=torch.zeros(1000))


def test_enospc_growing_the_file(tmp_path: Path) -> None:
    io = FaultyIO()
    with SwapStore(tmp_path, fileio=io) as s:
        io.arm("fallocate", errno.ENOSPC)
        with pytest.raises(SwapError, match=r"cannot grow the swap file.*'big'.*ENOSPC"):
            s.write("big", torch.zeros(1 << 20)).wait()
        assert s.stats().used_bytes == 0


def test_eio_on_read(tmp_path: Path) -> None:
    io = FaultyIO()
    with SwapStore(tmp_path, fileio=io) as s:
        s.write("k", torch.zeros(10_000)).wait()
        io.arm("pread", errno.EIO)
        with pytest.raises(SwapError, match=r"read of .* failed.*'k'.*EIO"):
            s.read("k").wait()
        assert torch.equal(s.read("k").wait(), torch.zeros(10_000))  # transient


def test_truncated_file_is_a_short_read(tmp_path: Path) -> None:
    with SwapStore(tmp_path, verify=False) as s:
        s.write("a", torch.ones(100_000)).wait()
        os.truncate(s.path, HEADER_BYTES + 4096)
        with pytest.raises(SwapError) as info:
            s.read("a").wait()
    msg = str(info.value)
    assert "short read" in msg and "truncated" in msg and "'a'" in msg and ".scratch.swp" in msg


@pytest.mark.parametrize("where", ["payload", "last byte", "header"])
def test_flipped_byte_is_detected_in_verify_mode(tmp_path: Path, where: str) -> None:
    with SwapStore(tmp_path, verify=True) as s:
        src = torch.randn(5000)  # 20000 bytes: last page partial
        s.write("k", src).wait()
        at = {"payload": HEADER_BYTES + 12345, "last byte": HEADER_BYTES + 19_999,
              "header": 20}[where]
        with open(s.path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(SwapError) as info:
            s.read("k").wait()
    msg = str(info.value)
    assert "corrupted" in msg and "'k'" in msg and ".scratch.swp" in msg
    assert ("checksum" in msg) if where != "header" else ("header" in msg)


def test_region_of_another_key_is_detected(tmp_path: Path) -> None:
    # A header that is valid but belongs to another write (stale region) is refused.
    with SwapStore(tmp_path, verify=True) as s:
        s.write("a", torch.zeros(1024)).wait()
        s.write("b", torch.ones(1024)).wait()
        with open(s.path, "r+b") as f:
            f.seek(0)
            region_a = f.read(HEADER_BYTES + 4096)
            f.write(region_a)  # copy a's region over b's
        with pytest.raises(SwapError, match=r"header .* says .*'a'.*expected.*'b'"):
            s.read("b").wait()


def test_no_o_direct_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tierzero.swap.opening"), \
            SwapStore(tmp_path, fileio=NoDirectIO(), verify=True) as s:
        assert not s.direct
        s.write("k", torch.arange(10)).wait()
        assert torch.equal(s.read("k").wait(), torch.arange(10))
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
    with pytest.raises(SwapError, match=r"does not support O_DIRECT.*direct=None"):
        SwapStore(tmp_path, fileio=NoDirectIO(), direct=True)
    assert not list(tmp_path.rglob("*.swp"))


def test_tmpfs_works(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    d = shm / f"tierzero-test-{os.getpid()}"
    d.mkdir()
    try:
        with SwapStore(d, verify=True) as s:  # O_DIRECT or not, depending on the kernel
            s.write("k", torch.arange(12345)).wait()
            assert torch.equal(s.read("k").wait(), torch.arange(12345))
    finally:
        d.rmdir()
