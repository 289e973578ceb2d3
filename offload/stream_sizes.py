"""The streamed CPU Adam's host buffers, sized and laid out in one place.

The stream (offload/adam_stream.py) allocates its ring and param room by these
functions, and the engine budgets and plans host memory by the same ones
(engine/shards/state_layout.py), so what is budgeted is what is allocated.

One ring item, each part page-aligned ([Note: optimizer state in chunks] in
offload/adam_stream.py):

    | master fp32 | exp_avg | exp_avg_sq | param (a shard in one piece, bf16/fp16) |
      numel * 4     moment_nbytes(numel, state) each (numel * 4 for fp32)

With a bf16 master ([Note: bf16 master weights] in offload/bf16_master.py) the master
part is the param itself, read and written under the param's key, and there is no
separate param part:

    | master = param bf16 (a shard in one piece; none for a piece) | exp_avg | exp_avg_sq |
      numel * 2
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .host_ring import HostRing, page_up
from .state_codec import moment_nbytes
from .stream_parts import StreamSet


def piece_bytes(numel: int, state: str, low_itemsize: int = 0, master_itemsize: int = 4
                ) -> int:
    """Ring bytes of one piece: its master (``master_itemsize`` bytes per element: 4 for
    fp32, 2 for a bf16 master of a shard in one piece, 0 for a piece of a shard whose bf16
    master is assembled whole) and two moments in ``state`` precision, each part
    page-aligned, and the shard's low-precision param (``low_itemsize`` bytes per element;
    0: none) when the shard is in one piece."""
    low = page_up(numel * low_itemsize) if low_itemsize else 0
    return page_up(numel * master_itemsize) + 2 * page_up(moment_nbytes(numel, state)) + low


def ring_capacity(requested: int, piece_sizes: Iterable[int]) -> int:
    """Host bytes of the stream's ring: ``requested`` and at least the largest piece
    (``piece_sizes``, each from piece_bytes), page-aligned as HostRing allocates it. Pieces
    of very different sizes share the ring, so the largest does not set every buffer."""
    return page_up(max(requested, *piece_sizes, 0))


def param_assembly_bytes(whole_bytes: Sequence[int], regions: int = 2) -> int:
    """Host bytes where the new param of shards in several pieces is assembled: room for
    ``regions`` of the largest (``whole_bytes``: each such shard's param, page-aligned):
    two, one assembled while one is written; three with a bf16 master, whose next param
    is read ahead ([Note: shard inputs read ahead] in offload/shard_inputs.py)."""
    return regions * max(whole_bytes) if whole_bytes else 0


def carve(ring: HostRing, start: int, numel: int, state: str, shadow: torch.dtype | None,
          *, param: bool = True, master: torch.dtype | None = torch.float32) -> StreamSet:
    """The buffer set of one ring item at ``start`` (-1: an empty shard, no region), laid
    out as drawn above; ``param`` False or no ``shadow``: no param part; ``master``: its
    dtype (bf16: the param itself, no param part), None: no master part."""
    if start < 0:
        empty = torch.empty(0)
        return StreamSet(start, empty, empty, empty, None, state)
    if master is None:
        master_part = torch.empty(0)
        size = 0
    else:
        size = page_up(numel * torch.finfo(master).bits // 8)
        master_part = ring.view(start, numel, master)
    each = page_up(moment_nbytes(numel, state))
    moments = [ring.view(start + size + i * each, numel, torch.float32) if state == "fp32"
               else ring.view(start + size + i * each, moment_nbytes(numel, state), torch.uint8)
               for i in (0, 1)]
    end = start + size + 2 * each
    p16 = (None if shadow is None or not param or master != torch.float32
           else ring.view(end, numel, shadow))
    return StreamSet(start, master_part, moments[0], moments[1], p16, state)
