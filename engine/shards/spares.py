"""Freed gather buffers handed to the next gather, on a CPU compute device.

[Note: gather buffers kept for the next gather] A unit's full buffer (shards/flat.py)
is host memory on a CPU compute device, and its storage is emptied on every release so
the memory goes back to the system: glibc serves a buffer this large by mmap, so the next
gather's buffer is fresh memory that the kernel faults in and zeroes, on the training
thread and torch's copy threads, before the gather's copy can write it. At 2.07B that is
about 7 GB a step of zeroed pages, most of the system time of a step
(benchmarks/RESULTS.md, "Gather buffers kept for the next gather").

Here a released group's memory is moved, not freed: `keep` swaps its storage's memory into
a spare storage (`UntypedStorage._swap_data_ptr_`: the full buffer's storage is left
empty, as a resize to 0 leaves it, so every view autograd saved of it sees an empty
buffer as before), and the next gather of a group of the same size swaps it into its own
empty storage instead of allocating: pages already faulted in, written once.

Memory: at every moment, the gathered bytes plus the spares' are at most the most bytes
ever gathered at once (the scheduler's gathered_peak_bytes, which `tierzero plan` counts
for the gathered units):
- a release moves L bytes from gathered to spare (the sum is unchanged);
- a gather that takes a spare moves them back (unchanged);
- a gather that finds no spare of its size frees every spare first (`take` clears on a
  miss), then allocates as before.
The scheduler clears the spares when a pass ends (and on abort), and the engine when it
closes, so nothing is held between passes: an optimizer step after backward, a checkpoint
or user code between steps sees the memory it saw before.

The swap is a private method of torch's storage; where it is missing, or the device is not
the CPU (CUDA's caching allocator already reuses freed blocks), no spares are kept and a
gather allocates as before.
"""

from __future__ import annotations

import torch

_SWAP = "_swap_data_ptr_"


def spares_supported(device: torch.device) -> bool:
    """Whether gather buffers on `device` can be handed on ([Note: gather buffers kept for
    the next gather]): a CPU device and a torch whose storages swap their memory."""
    return device.type == "cpu" and hasattr(torch.UntypedStorage, _SWAP)


class GatherSpares:
    """Released gather buffers' memory, newest last, for the next gather of the same size.
    Used on the training thread only (gathers and releases run there)."""

    def __init__(self) -> None:
        self._free: list[torch.UntypedStorage] = []  # each holds one released buffer's memory
        self.nbytes = 0  # held by the spares now
        self.reused = 0  # gathers served from a spare (for tests and reports)
        self.kept = 0  # releases whose memory became a spare

    def __len__(self) -> int:
        return len(self._free)

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """Give empty `storage` the memory of a spare of exactly `nbytes` bytes (the newest);
        True when one was there. Without one, every spare is freed (so the allocation the
        caller makes next does not add to them) and False is returned."""
        if storage.nbytes():
            raise ValueError(f"GatherSpares.take: the storage holds {storage.nbytes()} bytes; "
                             "only an empty (released) buffer takes a spare")
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i].nbytes() == nbytes:
                spare = self._free.pop(i)
                getattr(storage, _SWAP)(spare)  # storage: the memory; spare: empty
                self.nbytes -= nbytes
                self.reused += 1
                return True
        self.clear()
        return False

    def keep(self, storage: torch.UntypedStorage) -> None:
        """Move `storage`'s memory into a new spare, leaving `storage` empty (as resize_(0)
        would, without freeing the memory)."""
        spare = torch.empty(0, dtype=torch.uint8).untyped_storage()
        getattr(spare, _SWAP)(storage)
        self._free.append(spare)
        self.nbytes += spare.nbytes()
        self.kept += 1

    def clear(self) -> None:
        """Free every spare's memory."""
        self._free.clear()
        self.nbytes = 0
