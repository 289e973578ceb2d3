"""Host allocations and the staging pool (offload/pool.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tierzero.offload import BufferPool, HostAllocator, OffloadError, ShardSpec
from tierzero.swap import is_aligned


def test_pool_buffers_are_aligned_reused_and_never_double_freed() -> None:
    pool = BufferPool(3, 8192, HostAllocator(pin=False, node=None))
    assert pool.nbytes == 3 * 8192 and pool.count == 3
    bufs = [pool.try_acquire() for _ in range(3)]
    assert all(b is not None and is_aligned(b.data) for b in bufs)
    assert pool.try_acquire() is None  # exhausted: the caller evicts or waits
    first = bufs[0]
    assert first is not None
    pool.release(first)
    again = pool.try_acquire()
    assert again is first  # recycled, not reallocated
    assert again.data.data_ptr() == first.data.data_ptr()
    with pytest.raises(OffloadError, match="released twice"):
        pool.release(again)
        pool.release(again)
    spec = ShardSpec("k", "grad", 1024, torch.float16)
    view = again.view(spec)
    assert view.dtype == torch.float16 and view.numel() == 1024
    with pytest.raises(OffloadError, match="does not fit"):
        again.view(ShardSpec("big", "grad", 4096, torch.float32))
    assert pool.peak_in_use == 3


def test_pinning_stops_at_the_memlock_limit(caplog: pytest.LogCaptureFixture) -> None:
    alloc = HostAllocator(pin=True, node=None)
    alloc.limit = 0  # as if ulimit -l were 0: nothing may be pinned
    with caplog.at_level(logging.WARNING, logger="tierzero.offload.pool"):
        a = alloc.empty(4096)
        b = alloc.empty(4096)
    assert not a.is_pinned() and not b.is_pinned() and alloc.pinned_bytes == 0
    assert sum("memlock limit" in r.getMessage() for r in caplog.records) == 1  # logged once
