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

from tierzero import swap
from tierzero.offload.huge_pages import advise_huge

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
            if not pin:
                # the C heap's memory, fresh for each buffer (pinned memory is the CUDA
                # host allocator's): [Note: huge pages for per-step host buffers]
                advise_huge(data)
            if bound:
                data.zero_()  # first touch inside the binding puts the pages on the node
        if pin:
            self.pinned_bytes += nbytes
        return data


@dataclass(eq=False)
class PoolBuffer:
    """``span`` adjacent fixed-size slots of the pool, starting at slot ``index``."""

    index: int
    data: torch.Tensor  # 1D uint8, page-aligned; pinned when the pool is
    span: int = 1  # slots covered: > 1 only for a shard larger than one buffer

    def view(self, spec: ShardSpec) -> torch.Tensor:
        """The first ``spec.nbytes`` bytes as a 1D tensor of ``spec.dtype``."""
        if spec.nbytes > self.data.numel():
            raise OffloadError(
                f"shard {spec.key!r} ({spec.nbytes} bytes) does not fit a "
                f"{self.data.numel()}-byte pool buffer"
            )
        return self.data[: spec.nbytes].view(spec.dtype)


class BufferPool:
    """``count`` reusable buffers of ``buffer_bytes`` each, allocated once.

    [Note: pool spans]
    The buffers are sized for the shards staged through the pool every step
    (parameter gathers); a rarer, larger shard (initial placement or a
    checkpoint of NVMe-homed optimizer state) takes several adjacent buffers of
    the one arena as a single span, so the pool never has to be sized for the
    largest shard of any class. The plan makes ``count * buffer_bytes`` at least
    the largest NVMe-homed shard (offload/placement.py ``_pool_shape``).
    """

    def __init__(self, count: int, buffer_bytes: int, allocator: HostAllocator) -> None:
        self.buffer_bytes = buffer_bytes
        empty = torch.empty(0, dtype=torch.uint8)
        self._arena = allocator.empty(count * buffer_bytes) if count else empty
        self.nbytes = count * buffer_bytes  # counted against the host budget, always
        self._count = count
        self._free = [True] * count  # per slot
        # one handle per slot made once: the per-step path never allocates
        self._singles = [PoolBuffer(i, self._arena[i * buffer_bytes:(i + 1) * buffer_bytes])
                         for i in range(count)]
        self._taken: dict[int, PoolBuffer] = {}  # first slot -> span handed out
        self.peak_in_use = 0

    @property
    def count(self) -> int:
        return self._count

    @property
    def arena(self) -> torch.Tensor:
        """The one allocation every buffer is a slice of (1D uint8)."""
        return self._arena

    @property
    def in_use(self) -> int:
        """Slots taken (a span counts each of its slots)."""
        return self._count - sum(self._free)

    def slots_for(self, nbytes: int) -> int:
        """Adjacent buffers a shard of ``nbytes`` needs (1 for everything staged per step)."""
        return max(1, -(-nbytes // self.buffer_bytes)) if self.buffer_bytes else 1

    def _run(self, span: int) -> int | None:
        """First slot of the lowest run of ``span`` free slots, or None."""
        length = 0
        for i, free in enumerate(self._free):
            length = length + 1 if free else 0
            if length == span:
                return i - span + 1
        return None

    def can_take(self, nbytes: int) -> bool:
        return self._run(self.slots_for(nbytes)) is not None

    def try_acquire(self, nbytes: int = 0) -> PoolBuffer | None:
        """A free span for ``nbytes`` (one buffer when 0), or None when no run of free
        buffers is long enough (the caller evicts or waits)."""
        span = self.slots_for(nbytes)
        if span > self._count:
            raise OffloadError(
                f"a {nbytes}-byte shard needs {span} pool buffers of {self.buffer_bytes} bytes "
                f"but the pool has {self._count}; raise pool.buffer_count or buffer_bytes")
        first = self._run(span)
        if first is None:
            return None
        lo, hi = first * self.buffer_bytes, (first + span) * self.buffer_bytes
        buf = self._singles[first] if span == 1 else PoolBuffer(first, self._arena[lo:hi], span)
        for i in range(first, first + span):
            self._free[i] = False
        self._taken[first] = buf
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: PoolBuffer) -> None:
        if self._taken.get(buf.index) is not buf:
            raise OffloadError(f"pool buffer {buf.index} released twice or not from this pool")
        del self._taken[buf.index]
        for i in range(buf.index, buf.index + buf.span):
            self._free[i] = True

    def close(self) -> None:
        self._taken.clear()
        self._singles.clear()
        self._free, self._count = [], 0
