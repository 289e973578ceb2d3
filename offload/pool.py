"""Host memory: the fixed staging pool and allocations for host-homed shards.

Every byte is page-aligned (swap.aligned_empty, so O_DIRECT can use it), is
page-locked when the plan says so (allocated pinned directly: no pageable
temporary, no second copy), and lands on the GPU's NUMA node on multi-node
machines (offload.numa.local_to, first touch). Pinned bytes never exceed the
memlock limit: past it, allocations fall back to pageable memory, logged once.

The pool is one arena carved into ``count`` equal buffers, allocated when the
manager starts and recycled for its whole life: the hot path never allocates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import swap

from . import numa
from .budget import memlock_limit
from .errors import OffloadError
from .residency import ShardSpec

log = logging.getLogger(__name__)


class HostAllocator:
    """Allocates aligned host tensors, pinned within the memlock limit, NUMA-local."""

    def __init__(self, *, pin: bool, node: int | None, meta: bool = False) -> None:
        self.pin = pin
        self.meta = meta  # a dry run (plan): tensors on the meta device, nothing allocated
        self.node = node  # NUMA node of the GPU, None when unknown or one node
        self.limit = memlock_limit()  # None: unlimited
        self.pinned_bytes = 0
        self._warned = False

    def empty(self, nbytes: int) -> torch.Tensor:
        """A 1D uint8 tensor of ``nbytes``, page-aligned."""
        if self.meta:
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        pin = self.pin
        if pin and self.limit is not None and self.pinned_bytes + nbytes > self.limit:
            if not self._warned:
                log.warning("memlock limit (ulimit -l = %d bytes) reached with %d bytes pinned; "
                            "further host buffers are pageable (slower copies)",
                            self.limit, self.pinned_bytes)
                self._warned = True
            pin = False
        with numa.local_to(self.node) as bound:
            data = swap.aligned_empty(nbytes, torch.uint8, pin_memory=pin)
            if bound:
                data.zero_()  # first touch inside the binding puts the pages on the node
        if pin:
            self.pinned_bytes += nbytes
        return data


@dataclass(eq=False)
class PoolBuffer:
    """One fixed-size slot of the pool."""

    index: int
    data: torch.Tensor  # 1D uint8, page-aligned; pinned when the pool is

    def view(self, spec: ShardSpec) -> torch.Tensor:
        """The first ``spec.nbytes`` bytes as a 1D tensor of ``spec.dtype``."""
        if spec.nbytes > self.data.numel():
            raise OffloadError(
                f"shard {spec.key!r} ({spec.nbytes} bytes) does not fit a "
                f"{self.data.numel()}-byte pool buffer"
            )
        return self.data[: spec.nbytes].view(spec.dtype)


class BufferPool:
    """``count`` reusable buffers of ``buffer_bytes`` each, allocated once."""

    def __init__(self, count: int, buffer_bytes: int, allocator: HostAllocator) -> None:
        self.buffer_bytes = buffer_bytes
        empty = torch.empty(0, dtype=torch.uint8)
        arena = allocator.empty(count * buffer_bytes) if count else empty
        self.nbytes = count * buffer_bytes  # counted against the host budget, always
        self._buffers = [
            PoolBuffer(i, arena[i * buffer_bytes : (i + 1) * buffer_bytes]) for i in range(count)
        ]
        self._free = list(reversed(self._buffers))
        self.peak_in_use = 0

    @property
    def count(self) -> int:
        return len(self._buffers)

    @property
    def in_use(self) -> int:
        return len(self._buffers) - len(self._free)

    def try_acquire(self) -> PoolBuffer | None:
        """A free buffer, or None when all are taken (the caller evicts or waits)."""
        if not self._free:
            return None
        buf = self._free.pop()
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: PoolBuffer) -> None:
        if buf in self._free or self._buffers[buf.index] is not buf:
            raise OffloadError(f"pool buffer {buf.index} released twice or not from this pool")
        self._free.append(buf)

    def close(self) -> None:
        self._free.clear()
        self._buffers.clear()
