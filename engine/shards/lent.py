"""A gather that views the staging pool's buffer instead of copying it, on a CPU device.

[Note: a gather viewing the pool's buffer] With one rank and a CPU compute device, a
param shard homed on NVMe is read into a buffer of the tier manager's staging pool, and
that buffer holds the unit's whole gathered parameters, bit for bit: the gather's copy
into the unit's own buffer (shards/flat.py) moves every gathered byte once more on the
training thread (benchmarks/RESULTS.md, "where the gather's time goes"). A unit whose
gathers may view the pool's buffer instead (`Unit.lendable`: released as soon as its
backward ends) keeps the manager's hold on it from the gather to the release:

- Views autograd saves must see an empty buffer once the unit is released, as after the
  copying gather's `resize_(0)`. So the parameters do not view the pool's tensor: the
  unit's full buffer keeps its own storage, and `alias_into` gives that storage the pool
  buffer's memory without owning it (`UntypedStorage._swap_data_ptr_`, as the gather
  spares do); `unalias` empties it again before the hold ends.
- Nothing writes the shard while it is viewed: the manager refuses to write an NVMe
  shard whose cache is held (TierManager.write_from) instead of letting a gathered unit
  see its update. The scheduler ends the hold before the unit's update can start in
  backward (`Scheduler._reduce`): it releases the unit first, or copies the buffer out
  (`settle_group`) where the unit stays gathered (a group reduced at the end of backward
  because a parameter got no gradient). A unit kept gathered from its forward to its
  backward ([Note: reuse distance]) keeps viewing the buffer: no update of it runs
  between the two (the deferred one ran before its forward's gather).
- The hold takes pool room the gathers' read-ahead and the gradients' writes also use:
  where gathers view it, the pool gets `LENT_POOL_BUFFERS` more buffers (the one a unit
  views, which the copying gather's own buffer held before: the same memory, and the
  read-ahead keeps its room instead of being evicted by the gradients' writes and read
  again); at most `MAX_LENT_UNITS` units view it at once (the scheduler copies beyond
  them); and a store lends only one-buffer param shards, from a pool configured with at
  least `LEND_POOL_SPANS` buffers (offload.params.buffer_count, whose default is that).
"""

from __future__ import annotations

import ctypes

import torch

from tierzero.engine.shards.spares import spares_supported

# Units whose gathers view pool buffers at once (a unit's backward and the next one's
# gather overlap); the scheduler gathers a third by copying.
MAX_LENT_UNITS = 2
# Pool buffers a store needs configured to lend: the lent units', plus three for a
# gradient being written (an fp32 one takes two buffers sized for a bf16 param) and a read
# ahead.
LEND_POOL_SPANS = MAX_LENT_UNITS + 3
# Buffers the pool gets beyond its configured count where gathers view it.
LENT_POOL_BUFFERS = 1

_SWAP = "_swap_data_ptr_"


def lending_possible() -> bool:
    """Whether this torch lets a storage take memory it does not own (whatever the
    device: a dry run on meta sizes a CPU run's pool by it)."""
    return hasattr(torch.UntypedStorage, _SWAP)


def lending_supported(device: torch.device) -> bool:
    """Whether a gather on `device` may view a pool buffer: a CPU device (on CUDA the
    gather is the host-to-device copy) and a torch whose storages swap their memory."""
    return spares_supported(device)


def alias_into(full: torch.Tensor, view: torch.Tensor) -> None:
    """Give `full`'s empty storage the memory of `view` (contiguous, on the CPU), not
    owned: freeing the storage later leaves `view`'s memory alone."""
    storage = full.untyped_storage()
    if storage.nbytes():
        raise ValueError(f"alias_into: the buffer holds {storage.nbytes()} bytes; only a "
                         "released (empty) buffer views another's memory")
    nbytes = view.numel() * view.element_size()
    if not view.is_contiguous() or view.device.type != "cpu" or nbytes != full.numel() * \
            full.element_size():
        raise ValueError(f"alias_into: a {tuple(view.shape)} {view.dtype} view on "
                         f"{view.device} does not cover the {full.numel()}-element "
                         f"{full.dtype} buffer contiguously on the CPU")
    # a Python buffer over the memory, owning nothing; the tensor made from it holds it
    holder = (ctypes.c_uint8 * nbytes).from_address(view.data_ptr())
    alias = torch.frombuffer(holder, dtype=torch.uint8)
    getattr(storage, _SWAP)(alias.untyped_storage())  # storage: the memory; alias: empty


def unalias(full: torch.Tensor) -> None:
    """Empty `full`'s storage, which `alias_into` pointed at memory it does not own."""
    empty = torch.empty(0, dtype=torch.uint8).untyped_storage()
    getattr(empty, _SWAP)(full.untyped_storage())  # full: empty; dropped with `empty`


def adopt(full: torch.Tensor, own: torch.UntypedStorage) -> None:
    """`full`'s storage, which `alias_into` pointed at memory it does not own, takes the
    memory of `own` instead (a copy of it, the same size); `own` is left empty."""
    storage = full.untyped_storage()
    if own.nbytes() != storage.nbytes():
        raise ValueError(f"adopt: {own.nbytes()} bytes for a {storage.nbytes()}-byte buffer")
    unalias(full)
    getattr(storage, _SWAP)(own)
