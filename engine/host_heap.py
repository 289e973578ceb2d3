"""Give the C heap's free memory back to the system during the build, placement and steps.

[Note: returning freed host memory] glibc's malloc serves an allocation above its
mmap threshold with mmap and returns it on free, but the threshold is dynamic: freeing
one such block raises it (up to 32 MiB on 64-bit), so later blocks below the new threshold
come from the heap, and a freed heap block is kept for reuse, in RSS, unless it sits at
the heap's top. Building a model creates and frees many parameter-sized blocks (engine.Init
partitions each parameter once it is initialised; initialize() copies each group into its
shards and frees the module's tensors); afterwards the process would keep gigabytes of
freed blocks resident that the training step never reuses, which a host budget cannot see.
The same holds during training on a CPU compute device, where every unit's gather buffer
and gradients are host memory freed each step. malloc_trim(0) hands every free page back
(madvise on the free chunks of every arena, not only the top): the engine calls it after
each unit is placed, and HeapTrim each time another 64 MiB of parameters was partitioned by Init or
of gather buffers and gradients released by a step on the CPU, so freed blocks never pile
up (a call is cheap with nothing to release; nothing in use is freed, and allocations
after it are served as before). Setting a fixed
mmap threshold instead (MALLOC_MMAP_THRESHOLD_) would also stop the retention, but makes
every gather buffer and activation a fresh mmap and page faults it in again, slowing every
step (benchmarks/RESULTS.md). Other C libraries: nothing to do (no malloc_trim).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_heap(where: str) -> bool:
    """malloc_trim(0) where the C library has it ([Note: returning freed host memory]);
    True when memory was handed back."""
    fn = _malloc_trim()
    if fn is None:
        return False
    released = bool(fn(0))
    log.debug("malloc_trim after %s: %s", where, "released" if released else "nothing to release")
    return released


class HeapTrim:
    """release_free_heap() each time `every` more bytes were freed (as the caller counts
    them), so a long build holds at most about that much freed memory at any time, not
    everything it freed until its end."""

    def __init__(self, every: int, where: str) -> None:
        self.every = max(every, 1)
        self.where = where
        self._since = 0

    def freed(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every:
            self._since = 0
            release_free_heap(self.where)
