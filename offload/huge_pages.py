"""Transparent huge pages for the large host buffers allocated on every step.

[Note: huge pages for per-step host buffers] On a CPU compute device a unit's gather
buffer (engine/shards/flat.py), the device tier's copy of a shard (Mover.empty_device in
offload/transfer.py) and autograd's gradients and activations are host memory allocated
and freed for every unit of every step. glibc serves a block this large by
mmap (and host_heap.py's malloc_trim hands back the smaller ones), so each allocation is
fresh memory that the kernel faults in and zeroes 4 KiB at a time as it is first
written: at 2.07B parameters that is tens of gigabytes of 4 KiB faults a step, on the
training thread and the copy threads, beside the compute on a few cores. Under the
kernel's transparent huge page mode "madvise" (the usual default), a range advised
MADV_HUGEPAGE before its first write is faulted in 2 MiB pages instead: the same bytes
and the same RSS to within one 2 MiB page at each end of a buffer, a fraction of the
faults (benchmarks/RESULTS.md, "Huge pages").

Two ways in, both advice the kernel may decline (no free huge page, mode "never"):
- torch's own CPU allocator advises every tensor of 2 MiB or more when the process has
  THP_MEM_ALLOC_ENABLE=1 at torch's first allocation (c10 reads it once). This covers
  autograd's tensors too. `import tierzero` sets it unless the environment already
  says otherwise (tierzero/__init__.py), which takes effect when tierzero is imported
  before the process's first tensor (`tierzero train`, a script that imports tierzero
  first); THP_MEM_ALLOC_ENABLE=0 turns it off.
- `advise_huge` below, for the buffers the engine allocates itself, whatever the order
  of imports: called on each before its first write.
With mode "always" the kernel does this by itself and with "never" not at all: there
`advise_huge` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): a PMD-sized page
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word: always, madvise or
    never), None where the kernel does not say (not Linux, no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where advice helps: Linux with THP mode "madvise"."""
    if not sys.platform.startswith("linux") or thp_mode() != "madvise":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_range(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """The whole huge pages inside [ptr, ptr + nbytes): (start, length), or None when
    not one fits."""
    lo = -(-ptr // HUGE_PAGE) * HUGE_PAGE
    hi = (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if hi - lo >= HUGE_PAGE else None


def advise_huge(t: torch.Tensor) -> bool:
    """Advise the kernel to back `t`'s memory with huge pages ([Note: huge pages for
    per-step host buffers]); call it before the first write. True when advised: a host
    tensor spanning at least one whole huge page, under THP mode "madvise". Advice only:
    a refusal changes nothing but the page size."""
    if t.device.type != "cpu":
        return False
    fn = _madvise()
    if fn is None:
        return False
    span = huge_range(t.data_ptr(), t.numel() * t.element_size())
    return span is not None and fn(span[0], span[1], _MADV_HUGEPAGE) == 0
