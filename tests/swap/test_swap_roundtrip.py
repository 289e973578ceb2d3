"""SwapStore round trips: dtypes, odd sizes, aligned and unaligned buffers, both I/O modes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tierzero.swap import SwapError, SwapStore, aligned_empty, is_aligned
from tierzero.swap.fileio import FileIO

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.float8_e4m3fn]
BYTE_SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) + 1, 23 * 10**6 + 3]


def _random(nbytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _typed(dtype: torch.dtype, numel: int, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns of `dtype` (NaN payloads included: compared bytewise)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = _random(numel * itemsize, gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype)


@pytest.fixture(params=[None, False], ids=["direct-auto", "buffered"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> SwapStore:
    s = SwapStore(tmp_path, verify=True, direct=request.param, block_size=64 << 10, threads=3)
    request.addfinalizer(s.close)
    return s


def test_direct_io_in_use_on_this_file_system(tmp_path: Path) -> None:
    # /tmp here is ext4, which supports O_DIRECT: the auto mode must pick it.
    with SwapStore(tmp_path) as s:
        assert s.direct and s.stats().direct


@pytest.mark.parametrize("nbytes", BYTE_SIZES)
def test_byte_sizes_round_trip(store: SwapStore, nbytes: int) -> None:
    gen = torch.Generator().manual_seed(nbytes)
    src = _random(nbytes, gen)
    store.write("k", src).wait()
    # into an aligned buffer (direct path), an unaligned one (bounce), and a new one
    aligned = aligned_empty(nbytes, torch.uint8)
    unaligned = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    for out in (aligned, unaligned):
        out.fill_(0xAB) if nbytes else None
        assert store.read("k", out=out).wait() is out
        assert torch.equal(out, src)
    fresh = store.read("k").wait()
    assert is_aligned(fresh) and torch.equal(fresh, src)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_round_trip_with_shape(store: SwapStore, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    src = _typed(dtype, 3 * 5 * 1031, gen).view(3, 5, 1031)
    store.write(f"t/{dtype}", src).wait()
    out = store.read(f"t/{dtype}").wait()
    assert out.dtype == dtype and out.shape == src.shape
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


def test_scalar_and_non_aligned_source_tensors(store: SwapStore) -> None:
    scalar = torch.tensor(3.25, dtype=torch.float64)
    store.write("scalar", scalar).wait()
    assert store.read("scalar").wait().item() == 3.25
    base = torch.arange(100_000, dtype=torch.float32)
    view = base[3:]  # contiguous, not 4 KiB aligned
    store.write("view", view).wait()
    assert torch.equal(store.read("view").wait(), view)


def test_out_buffer_must_match(store: SwapStore) -> None:
    store.write("k", torch.zeros(10, dtype=torch.float32)).wait()
    with pytest.raises(ValueError, match=r"'k'.*float32.*\(10,\)"):
        store.read("k", out=torch.zeros(11, dtype=torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        store.read("k", out=torch.zeros(10, dtype=torch.int32))
    # same dtype and element count, other shape: allowed (a reinterpretation)
    out = store.read("k", out=torch.ones(2, 5)).wait()
    assert out.shape == (2, 5) and not out.any()


def test_bad_arguments(store: SwapStore) -> None:
    with pytest.raises(TypeError, match="non-empty str"):
        store.write("", torch.zeros(1))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        store.write("k", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not contiguous"):
        store.write("k", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="longer than"):
        store.write("x" * 5000, torch.zeros(1))
    with pytest.raises(SwapError, match=r"unknown key.*'nope'.*scratch\.swp"):
        store.read("nope", out=torch.zeros(1))
    with pytest.raises(SwapError, match=r"unknown key.*'nope'"):
        store.delete("nope")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"block_size": 1000}, "block_size"), ({"block_size": 6000}, "multiple of 4096"),
     ({"queue_depth": 0}, "queue_depth"), ({"threads": 0}, "threads"),
     ({"reserve_bytes": -1}, "reserve_bytes"), ({"direct": "yes"}, "direct"),
     ({"verify": 1}, "verify")],
)
def test_bad_settings(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SwapStore(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert not list((tmp_path).rglob("*.swp"))


def test_unaligned_buffer_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tierzero.swap.store"), SwapStore(tmp_path) as s:
        for i in range(3):
            s.write(f"k{i}", torch.zeros(10_001, dtype=torch.float32)[1:]).wait()
        st = s.stats()
    assert sum("not 4096-byte aligned" in r.message for r in caplog.records) == 1
    assert st.write.bounced_bytes == 3 * 10_000 * 4


def test_aligned_buffers_go_direct_without_copies(tmp_path: Path) -> None:
    # Sizes that are multiples of 4 KiB from aligned buffers never touch a bounce buffer.
    with SwapStore(tmp_path, block_size=1 << 16) as s:
        src = aligned_empty(1 << 20, torch.float32).uniform_()
        out = aligned_empty(1 << 20, torch.float32)
        s.write("k", src).wait()
        s.read("k", out=out).wait()
        st = s.stats()
    assert s.direct
    assert torch.equal(out, src)
    assert st.write.bounced_bytes == 0 and st.read.bounced_bytes == 0
    assert st.write.bytes == st.read.bytes == 4 << 20


@pytest.mark.cuda
def test_pinned_buffers_round_trip_to_the_gpu(tmp_path: Path) -> None:
    # The offload tier's path: pinned host buffer <-> NVMe, then host <-> device.
    n = (3 << 20) + 5  # not a multiple of the page: exercises the padded tail
    with SwapStore(tmp_path, verify=True, block_size=1 << 20) as s:
        src_gpu = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        pinned = aligned_empty(n, torch.bfloat16, pin_memory=True)
        assert pinned.is_pinned() and is_aligned(pinned)
        pinned.copy_(src_gpu, non_blocking=True)
        torch.cuda.synchronize()
        s.write("p", pinned).wait()
        # a pinned buffer from torch's caching host allocator (alignment not promised)
        back = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        s.read("p", out=back).wait()
        on_gpu = back.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu, src_gpu)
        st = s.stats()
    assert st.write.bounced_bytes <= 4096  # aligned pinned source: only the tail page


def test_an_aligned_buffer_with_a_ragged_end_bounces_only_its_last_page(tmp_path: Path) -> None:
    # 2 blocks and 3 pages and 100 bytes: the aligned head of the last block moves direct,
    # its last 100 bytes through the bounce, each way; what comes back is what was written
    class Lengths(FileIO):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
            self.lengths.append(len(buf))
            return super().pwrite(fd, buf, offset)

        def pread(self, fd: int, buf: memoryview, offset: int) -> int:
            self.lengths.append(len(buf))
            return super().pread(fd, buf, offset)

    n = 2 * (1 << 16) + 3 * 4096 + 100
    io = Lengths()
    with SwapStore(tmp_path, block_size=1 << 16, fileio=io, verify=True) as s:
        src = aligned_empty(n, torch.uint8)
        src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
        out = aligned_empty(n, torch.uint8).fill_(7)
        s.write("k", src).wait()
        s.read("k", out=out).wait()
        st = s.stats()
    assert s.direct
    assert torch.equal(out, src)
    assert st.write.bounced_bytes == st.read.bounced_bytes == 100
    assert all(length % 4096 == 0 for length in io.lengths)  # O_DIRECT's rule, every call
