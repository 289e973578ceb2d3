"""Where `engine.Init` keeps partitioned parameter slices when params are homed on NVMe.

[Note: Init onto NVMe] With `offload.params.device: nvme`, each slice a
parameter leaves when it is partitioned ([Note: Init partitioning]) is written
to a swap file of its own under the offload path instead of being kept in host
memory, so building a model holds only the live parameters (bounded by
`zero.init_live_bytes`) plus the writes in flight (bounded by
INFLIGHT_BYTES) in host memory. `engine.initialize` reads the slices back one
parameter at a time to build each unit's flat shard, which the tier manager
then places on its home tier; each slice is deleted as it is consumed, and the
swap file goes when the last one is.

Why not the tier manager itself: its placement is planned over every unit of
the finished model, which does not exist while the model is being built.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from tierzero import swap
from tierzero.engine.config import NvmeConfig
from tierzero.engine.shards.tier_config import swap_options

log = logging.getLogger(__name__)

# Host bytes of slices handed to the swap store and not yet on disk: enough to keep the
# drive's queue full, small next to any model that needs NVMe.
INFLIGHT_BYTES = 64 << 20


class SliceStaging:
    """Slices on NVMe, keyed by string; reads follow writes of the same key (swap ordering)."""

    def __init__(self, directory: str, nvme: NvmeConfig, bar: Any = None) -> None:
        self.swap = swap.SwapStore(directory, **swap_options(nvme))
        self._inflight: deque[tuple[swap.SwapFuture, int]] = deque()
        self._inflight_bytes = 0
        self._keys: set[str] = set()
        self._next = 0
        self.building = True  # the Init context is open: more slices may come
        self.written_bytes = 0  # every slice write, re-partitions after an access included
        self._bar = bar  # tqdm of bytes written (engine.progress), or None

    @staticmethod
    def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer for a `numel`-element slice, padded to whole swap.ALIGN
        blocks and aligned, so direct I/O needs no bounce copy. put() takes the buffer;
        the slice is its first `numel` elements."""
        return swap.aligned_empty((_padded(numel, dtype),), dtype).zero_()

    def put(self, shard: torch.Tensor) -> str:
        """Write `shard` (1D, host) under a new key; returns the key. `shard` must not be
        changed afterwards (the write may still be in flight)."""
        key = f"slice{self._next}"
        self._next += 1
        nbytes = shard.numel() * shard.element_size()
        self._inflight.append((self.swap.write(key, shard), nbytes))
        self._inflight_bytes += nbytes
        self._keys.add(key)
        while self._inflight_bytes > INFLIGHT_BYTES:
            self._settle_one()
        self.written_bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        return key

    def _settle_one(self) -> None:
        fut, nbytes = self._inflight.popleft()
        self._inflight_bytes -= nbytes
        fut.wait()

    def get(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The slice stored under `key` (1D, `numel` elements, a new host tensor)."""
        out = swap.aligned_empty((_padded(numel, dtype),), dtype)
        self.swap.read(key, out=out).wait()
        return out[:numel]

    def overwrite(self, key: str, values: torch.Tensor) -> None:
        """Replace the slice under `key` with `values` (load_pretrained writes them)."""
        buf = self.empty(values.numel(), values.dtype)
        buf[:values.numel()].copy_(values)
        self.swap.write(key, buf).wait()

    def drop(self, key: str) -> None:
        """The slice was consumed; the last drop after the context closed ends the file."""
        if key in self._keys:
            self._keys.discard(key)
            self.swap.delete(key)
        if not self._keys and not self.building:
            self.close()

    def finish_building(self) -> None:
        """The Init context closed: wait for every write; close when nothing is left."""
        while self._inflight:
            self._settle_one()
        self.building = False
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        log.info("Init: %d bytes of parameter slices on NVMe (%s)", self.written_bytes,
                 self.swap.path)
        if not self._keys:
            self.close()

    def close(self) -> None:
        while self._inflight:
            self._settle_one()
        self.swap.close()


def _padded(numel: int, dtype: torch.dtype) -> int:
    """`numel` rounded up to whole swap.ALIGN blocks of `dtype` elements."""
    per_block = swap.ALIGN // dtype.itemsize
    return max(per_block, -(-numel // per_block) * per_block)
