"""A unit's parameters flattened per (dtype, trainable) into padded buffers, rank r owning slice r.

[Note: flat layout] For a group of parameters p_0..p_k (module order):

    full buffer  | p_0 | p_1 | ... | p_k | zero pad |     padded_numel elements
    shards       | rank 0 | rank 1 | ... | rank W-1 |    shard_numel each

`padded_numel` = W * shard_numel and `shard_numel` is a multiple of
SHARD_ALIGN elements. Padding is zero in params and grads, so norms and the
optimizer see zeros there. The full buffer exists only while the unit is
gathered: its storage is resized to 0 on release, which also frees every view
autograd saved of it, and resized back and refilled before backward uses them.
With one rank and the `param` shard already on the compute device, the shard
*is* the full buffer: parameters view it directly, with no copy and no extra
memory (`FlatGroup.base` says which tensor the views point into). On a CPU
compute device a released buffer's memory is handed to the next gather of the
same size instead of freed ([Note: gather buffers kept for the next gather] in
shards/spares.py), and a gather may view the staging pool's buffer instead of copying it
([Note: a gather viewing the pool's buffer] in shards/lent.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tierzero.engine.collectives import Comm, PendingReduce
from tierzero.engine.init.context import forget, full_values
from tierzero.engine.shards.lent import adopt, alias_into, lending_supported, unalias
from tierzero.engine.shards.spares import GatherSpares
from tierzero.engine.shards.store import ShardStore
from tierzero.offload.huge_pages import advise_huge

# Shards are whole multiples of 128 elements so vectorised Adam kernels and
# aligned I/O never see a ragged tail.
SHARD_ALIGN = 128


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in its group's full buffer."""

    qname: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int


@dataclass
class FlatGroup:
    """One flat buffer of a unit: layout, gathered buffer, and the bridge to the shard store."""

    key: str  # "<unit name>/<dtype>/<trainable|frozen>", the shard store key
    slots: tuple[ParamSlot, ...]
    dtype: torch.dtype  # compute dtype of the gathered buffer
    trainable: bool
    shard_numel: int
    world_size: int
    full: torch.Tensor = field(repr=False)  # 1D compute dtype, device; storage 0 when released
    base: torch.Tensor | None = field(default=None, repr=False)  # what params view; None: released
    # the store's version of the param shard the gather copied into `full` (None: not a
    # copy, or the store keeps no versions): [Note: a param held in host memory]
    copied_version: int | None = None
    # released buffers' memory for the next gather, shared by the engine's groups on a CPU
    # device (None: freed on release): [Note: gather buffers kept for the next gather]
    spares: GatherSpares | None = field(default=None, repr=False, compare=False)
    # the store whose pool buffer `full` views while gathered, held until release (None:
    # `full` owns its memory): [Note: a gather viewing the pool's buffer] in shards/lent.py
    lent_from: ShardStore | None = field(default=None, repr=False, compare=False)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def gathered(self) -> bool:
        return self.base is not None


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank of a group of `numel` elements ([Note: flat layout])."""
    chunk = SHARD_ALIGN * world_size
    return max(chunk, -(-numel // chunk) * chunk) // world_size


def build_group(
    key: str, named: list[tuple[str, nn.Parameter]], *, dtype: torch.dtype, trainable: bool,
    comm: Comm, store: ShardStore, device: torch.device, spares: GatherSpares | None = None,
) -> FlatGroup:
    """Lay out `named`, create this rank's shards in `store`, and leave the group released.
    `spares`: where its released buffer's memory goes ([Note: gather buffers kept for the
    next gather]; None: freed)."""
    slots, offset = [], 0
    for qname, p in named:
        slots.append(ParamSlot(qname, p, p.shape, offset, p.numel()))
        offset += p.numel()
    n_shard = shard_numel(offset, comm.world_size)
    padded = n_shard * comm.world_size
    lo, hi = comm.rank * n_shard, (comm.rank + 1) * n_shard
    with torch.no_grad():
        host = "meta" if device.type == "meta" else "cpu"  # meta: a dry run (tierzero plan)
        mine = torch.zeros(n_shard, dtype=torch.float32, device=host)  # fp32 initial values
        for s in slots:
            # A parameter built under engine.Init is gathered here, one at a time (a
            # collective: every rank visits every slot in the same order).
            values = full_values(s.param, comm)  # 1D, s.numel
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if b > a:
                mine[a - lo:b - lo].copy_(values[a - s.offset:b - s.offset])
            forget(s.param)
        store.add(key, mine, dtype, trainable)
    full = torch.empty(padded, dtype=dtype, device=device)
    full.untyped_storage().resize_(0)  # released until its first gather (not a spare)
    group = FlatGroup(key, tuple(slots), dtype, trainable, n_shard, comm.world_size, full,
                      spares=spares)
    release_group(group)
    return group


def _empty_like_param(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def gather_group(group: FlatGroup, comm: Comm, store: ShardStore, *, lend: bool = False
                 ) -> None:
    """All-gather the shards into the full buffer and point each parameter at its view.
    `lend`: the full buffer may view the store's host buffer of the shard instead, held
    until release ([Note: a gather viewing the pool's buffer] in shards/lent.py)."""
    if (lend and comm.world_size == 1 and lending_supported(group.full.device)
            and not group.full.untyped_storage().nbytes()):
        shard = store.lend(group.key)
        if shard is not None:
            _view_lent(group, shard, store)
            return
    with torch.no_grad(), store.use(group.key, "param") as shard:
        if comm.world_size == 1 and store.keeps_views and shard.device == group.full.device:
            base = shard  # the shard is the whole buffer: view it, copy nothing
        else:  # an offloaded shard's view is valid only inside use(): copy it out
            base = group.full
            storage = base.untyped_storage()
            if storage.nbytes() == 0:
                _take_memory(group, storage, group.padded_numel * base.element_size())
            comm.all_gather(base, shard, group.key)
        # what was copied, read while `use` holds it (no write of the shard meanwhile)
        group.copied_version = None if base is shard else store.version(group.key, "param")
        for s in group.slots:
            s.param.data = base[s.offset:s.offset + s.numel].view(s.shape)
    group.base = base


def _take_memory(group: FlatGroup, storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give `group`'s empty `storage` `nbytes` of memory: a spare's ([Note: gather buffers
    kept for the next gather]), or fresh memory, advised onto huge pages before its first
    write ([Note: huge pages for per-step host buffers] in offload/huge_pages.py)."""
    if group.spares is not None and group.spares.take(storage, nbytes):
        return
    storage.resize_(nbytes)
    advise_huge(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))


def _view_lent(group: FlatGroup, shard: torch.Tensor, store: ShardStore) -> None:
    """Point `group`'s full buffer and parameters at `shard`, the store's lent buffer."""
    try:
        if shard.dtype != group.dtype or shard.numel() != group.padded_numel:
            raise RuntimeError(f"internal: the store lent {group.key!r} as {shard.numel()} "
                               f"{shard.dtype} elements; its gather takes "
                               f"{group.padded_numel} {group.dtype}")
        alias_into(group.full, shard)
    except BaseException:
        store.end_lend(group.key)
        raise
    group.lent_from = store
    group.copied_version = None  # not a copy: the update reads the shard from the store
    base = group.full
    for s in group.slots:
        s.param.data = base[s.offset:s.offset + s.numel].view(s.shape)
    group.base = base


def settle_group(group: FlatGroup) -> None:
    """A group viewing its store's buffer gets its own copy of it and ends the hold: the
    parameters (and every view autograd saved of them) keep their values, now in memory
    the group owns; the shard may be written from here on. No-op for a group that owns
    its buffer."""
    store = group.lent_from
    if store is None:
        return
    version = store.version(group.key, "param")  # of the bytes copied below
    with torch.no_grad():
        lent = group.full.untyped_storage()
        own = torch.empty(0, dtype=torch.uint8).untyped_storage()
        _take_memory(group, own, lent.nbytes())
        torch.empty(0, dtype=torch.uint8).set_(own).copy_(
            torch.empty(0, dtype=torch.uint8).set_(lent))
        adopt(group.full, own)
    group.lent_from = None
    store.end_lend(group.key)
    group.copied_version = version  # [Note: a param held in host memory]


def release_group(group: FlatGroup) -> None:
    """Point parameters at size-0 tensors and empty the full buffer's storage: its memory
    is freed, or kept for the next gather ([Note: gather buffers kept for the next
    gather]), or, viewed in a store's buffer, handed back to it ([Note: a gather viewing
    the pool's buffer])."""
    empty = _empty_like_param(group.dtype, group.full.device)
    for s in group.slots:
        s.param.data = empty
    storage = group.full.untyped_storage()
    lender = group.lent_from
    if lender is not None:
        unalias(group.full)
        group.lent_from = None
        lender.end_lend(group.key)
    elif storage.nbytes():
        if group.spares is not None:
            group.spares.keep(storage)
        else:
            storage.resize_(0)
    group.base = None
    group.copied_version = None


def held_shard(group: FlatGroup, rank: int, version: int | None) -> torch.Tensor | None:
    """This rank's param shard as the group's gathered buffer holds it, when that buffer
    is a host copy of the shard at `version` (the store's now), else None: the streamed
    update may copy it instead of reading the shard back ([Note: a param held in host
    memory] in offload/shard_inputs.py). The all-gather put this rank's own shard at its
    offset bit for bit, whatever the world size."""
    base = group.base
    if (base is None or version is None or group.copied_version != version
            or base.device.type != "cpu"):
        return None
    lo = rank * group.shard_numel
    return base[lo:lo + group.shard_numel]


# Elements per piece of add_upcast's fp32 scratch (512 KiB: stays in L2, and below the
# 1 MiB at which glibc may serve an allocation by mmap, page faults on every call).
_UPCAST_CHUNK = 1 << 17


def add_upcast(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst += src, src in a narrower float dtype (a bf16/fp16 gradient into its fp32 shard).

    Bit-identical to `dst.add_(src)` (which upcasts each element exactly, then adds in
    fp32), but on the CPU that mixed-dtype add runs a slow element-by-element cast loop
    (benchmarks/RESULTS.md, "Measurements behind design choices"); here each piece is
    converted into a small fp32 scratch by the vectorised copy, then added."""
    if dst.device.type != "cpu" or src.dtype == dst.dtype or dst.numel() <= _UPCAST_CHUNK:
        dst.add_(src)
        return
    n = dst.numel()
    scratch = torch.empty(_UPCAST_CHUNK, dtype=dst.dtype)
    for lo in range(0, n, _UPCAST_CHUNK):
        hi = min(n, lo + _UPCAST_CHUNK)
        part = scratch[:hi - lo]
        part.copy_(src[lo:hi])
        dst[lo:hi].add_(part)


def reduce_group_grads(group: FlatGroup, comm: Comm, store: ShardStore) -> PendingReduce | None:
    """Reduce-scatter the parameters' `.grad` (mean over ranks) into the gradient shard.

    Consumes and clears each parameter's `.grad` (a missing one counts as
    zero). With one rank the gradients are added at once (None is returned);
    with several this starts a collective and returns it in flight: the shard
    holds the result only after `wait()`. Every rank must reduce the same
    groups in the same order (see [Note: reduction order] in schedule.py).
    A shard marked zero in the store is overwritten instead ([Note: gradients zeroed
    on first use] in shards/store.py): with one rank that copy is exact also into a shard
    kept in the compute dtype ([Note: gradient precision] in shards/grad_precision.py).
    """
    with torch.no_grad():
        if comm.world_size == 1:
            # a fresh shard is overwritten whole: its old bytes are not read from NVMe
            with store.use_grad_sum(group.key) as (grad_shard, fresh):  # 1D, store.grad_dtype
                for s in group.slots:  # back to back from offset 0 (build_group)
                    dst = grad_shard[s.offset:s.offset + s.numel]
                    g = s.param.grad
                    if g is None:
                        if fresh:
                            dst.zero_()
                    elif fresh:
                        dst.copy_(g.reshape(-1))  # exact upcast, as add_upcast to 0
                    else:
                        add_upcast(dst, g.reshape(-1).to(grad_shard.device))
                    s.param.grad = None
                if fresh:
                    grad_shard[group.numel:].zero_()  # padding
            return None
        full = torch.zeros(group.padded_numel, dtype=torch.float32, device=group.full.device)
        for s in group.slots:
            g = s.param.grad
            if g is not None:
                full[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
                s.param.grad = None
        return _scatter(group, full, comm, store)


def reduce_flat_grad(group: FlatGroup, full: torch.Tensor, comm: Comm,
                     store: ShardStore) -> PendingReduce | None:
    """Reduce `full`, the group's whole gradient already summed in fp32 (1D, padded_numel,
    zero padding; layer-major accumulation, [Note: layer-major schedule] in
    engine/layer_major.py), into the gradient shard (fp32 under that schedule: [Note:
    gradient precision]): as `reduce_group_grads`, with `full` in place of the
    parameters' `.grad` (it is consumed)."""
    with torch.no_grad():
        if comm.world_size == 1:
            with store.use_grad_sum(group.key) as (grad_shard, fresh):  # 1D, store.grad_dtype
                src = full.to(grad_shard.device)
                if fresh:
                    grad_shard.copy_(src)
                else:
                    grad_shard.add_(src)
            return None
        return _scatter(group, full, comm, store)


def _scatter(group: FlatGroup, full: torch.Tensor, comm: Comm,
             store: ShardStore) -> PendingReduce:
    """Start the reduce-scatter (mean) of `full` into this rank's gradient shard."""
    with torch.no_grad():
        mine = torch.empty(group.shard_numel, dtype=torch.float32, device=full.device)
        if store.keeps_views:  # the collective adds into the shard (a fresh one zeroed first)
            return comm.reduce_scatter_mean_async(
                mine, full, accumulate_into=store.tensor(group.key, "grad"), what=group.key)
        pending = comm.reduce_scatter_mean_async(mine, full, what=group.key)

    def accumulate(out: torch.Tensor) -> None:
        with torch.no_grad(), store.use_grad_sum(group.key) as (grad_shard, fresh):
            if fresh:
                grad_shard.copy_(out)
            else:
                grad_shard.add_(out.to(grad_shard.device))

    pending.then = accumulate
    return pending
