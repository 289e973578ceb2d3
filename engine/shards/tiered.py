"""The engine's shard store over offload's TierManager.

A `ShardStore` whose tensors live wherever the tier manager puts them ([Note: shard
residency] in shards/store.py). The config becomes homes and tier settings in
shards/tier_config.py; which manager keys and pieces each group has, and their stored
form, in shards/state_layout.py (`store.layout`, shared with the streamed step).

Access: `use(key, kind)` fetches the shard to the tier where the engine
consumes it (param -> device, where it is gathered; the others -> host when
homed off the device) and releases it on exit. A compressed moment (`layout.compressed`)
is handed out decoded to fp32 (and encoded back when writable), `use(raw=True)` the stored
bytes of one piece, `use_stored()` every piece's (checkpoints). A group's master and
moments in several pieces are assembled in one host buffer. When the optimizer state stays
on the device (device Adam), master, grad and the moments are pinned on the device once
and `tensor()` hands out those views, which stay valid.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tierzero import swap
from tierzero.engine.config import Config
from tierzero.engine.host_defaults import device_is_host
from tierzero.engine.shards import tier_config
from tierzero.engine.shards.lent import LEND_POOL_SPANS, LENT_POOL_BUFFERS, lending_possible
from tierzero.engine.shards.snapshot import Part, StoreSnapshot
from tierzero.engine.shards.state_layout import Pieces, RingRequest, StateLayout
from tierzero.engine.shards.store import ShardStore
from tierzero.offload import TierManager
from tierzero.offload.settings import TensorClass, Tier
from tierzero.offload.state_codec import StoredLayout, decode, encode, moment_nbytes


@dataclass
class _Pending:
    init: torch.Tensor  # 1D fp32 initial values of this rank's shard, host
    compute_dtype: torch.dtype
    trainable: bool


class TieredShardStore(ShardStore):
    """ShardStore whose tensors live in a TierManager; see the module docstring.

    Every group is declared first (`declare`, sizes only) and `finalize()` plans
    placement over all of them at once; then `add()` places each group's initial
    values as its unit is built (no copy of the whole model is held) and pins
    device-homed optimizer state.
    """

    def __init__(self, device: torch.device, config: Config,
                 grad_dtype: torch.dtype = torch.float32, *, rank: int = 0,
                 world_size: int = 1, host_compute: bool | None = None) -> None:
        """rank: this rank, which names its shards in the salt of a bf16 master's
        stochastic rounding ([Note: bf16 master weights] in offload/bf16_master.py).
        host_compute: the compute device's memory is host memory ([Note: params gathered
        from host memory]); None: no CUDA (`device_is_host`). A dry run on meta planning a
        CUDA machine says False."""
        super().__init__(device, grad_dtype)
        self.host_compute = device_is_host(device) if host_compute is None else host_compute
        self.config = config
        self.homes = tier_config.homes_from(config)
        # gathers may view the pool's buffers of param shards, which get one more buffer
        # ([Note: a gather viewing the pool's buffer] in shards/lent.py)
        self.lends = (self.host_compute and world_size == 1 and lending_possible()
                      and self.homes["param"] == "nvme"
                      and config.offload.params.buffer_count >= LEND_POOL_SPANS)
        self._added: set[str] = set()
        self._views: dict[tuple[str, TensorClass], torch.Tensor] = {}  # pinned device views
        self.manager: TierManager | None = None
        self.swap: swap.SwapStore | swap.DrySwap | None = None
        o = config.offload.optimizer
        on_device = tier_config.optimizer_on_device(self.homes)
        self.layout = StateLayout(
            streamed=not (on_device or tier_config.state_in_host(self.homes)),
            chunk_numel=tier_config.chunk_numel(config, self.homes),
            state_precision=tier_config.state_precision(config, self.homes),
            # a dry run (tierzero plan, on meta) counts bytes: [Note: dry-run pieces]
            coarse=device.type == "meta",
            ring=RingRequest(o.buffer_count, o.buffer_bytes,
                             tier_config.ring_piece_numel(config)), grad_dtype=grad_dtype,
            master_precision=tier_config.master_precision(config, self.homes), rank=rank)

    @property
    def keeps_views(self) -> bool:
        return False  # a view is valid inside use() only: the manager may move the shard

    @property
    def prefetches(self) -> bool:
        return True

    def snapshot_parts(self, key: str, kind: TensorClass) -> list[Part] | None:
        """The manager keys of every piece, in element order ([Note: snapshot parts]): kept
        on NVMe or copied just before they change, never all copied into host memory (that
        is what did not fit there). Device-pinned optimizer state is copied at the save."""
        self.layout.check(key, kind)
        if (key, kind) in self._views:
            return None
        specs = self._mgr().plan.specs
        return [(mkey, specs[mkey].numel, specs[mkey].dtype)
                for mkey, _, _ in self.pieces(key, kind)]

    def open_snapshot(self, keys: list[str], copy_limit: int,
                      awaiting: Collection[str] = ()) -> StoreSnapshot | None:
        """TierManager.snapshot of `keys` (`awaiting`: see [Note: shard snapshots] in
        offload/snapshot.py); SnapshotSpaceError when the swap directory cannot hold the
        regions it keeps."""
        if not keys:
            return None
        mgr = self._mgr()
        return StoreSnapshot(mgr, mgr.snapshot(keys, copy_limit=copy_limit,
                                               awaiting=awaiting))

    @property
    def optimizer_offloaded(self) -> bool:
        return not tier_config.optimizer_on_device(self.homes)

    @property
    def state_precision(self) -> str:
        """How the moments are kept on their home tier ([Note: 8-bit moment codes])."""
        return self.layout.state_precision

    def state_in_host(self) -> bool:
        """Master and moments homed in host memory: the CPU Adam updates them in place."""
        return tier_config.state_in_host(self.homes)

    # -- declare, plan, place ----------------------------------------------------------
    def declare(self, key: str, numel: int, compute_dtype: torch.dtype, trainable: bool) -> None:
        if self.manager is not None:
            raise RuntimeError(f"declare({key!r}) after finalize(): the placement is planned")
        self.layout.declare(key, numel, compute_dtype, trainable)

    def add(self, key: str, master_init: torch.Tensor, compute_dtype: torch.dtype,
            trainable: bool) -> None:
        """Place the initial values of a declared group on their home tiers (copied)."""
        if not self.layout.matches(key, master_init.numel(), compute_dtype, trainable):
            declared = (key in self.layout.group_keys() and (
                self.layout.numel(key), self.layout.param_dtype(key), self.layout.kinds(key)))
            raise ValueError(f"add({key!r}): {master_init.numel()} x {compute_dtype}, "
                             f"trainable={trainable} does not match its declaration "
                             f"{declared or None}")
        if key in self._added:
            raise ValueError(f"shard group {key!r} registered twice")
        self._added.add(key)
        self._place(key, _Pending(master_init.detach().float(), compute_dtype, trainable))
        if trainable:
            self._zeroed.add(key)  # placed as zeros: [Note: gradients zeroed on first use]

    def finalize(self) -> None:
        """Plan placement over every declared shard and start the tier manager."""
        if self.manager is not None:
            return
        specs = self.layout.specs()
        path = tier_config.swap_dir(self.config)
        needs_swap = tier_config.needs_swap(self.config, self.homes)
        if needs_swap and self.device.type == "meta":  # a dry run (tierzero plan): count bytes
            self.swap = swap.DrySwap()
        elif needs_swap and path is not None:
            self.swap = swap.SwapStore(path, **tier_config.swap_options(self.config.nvme))
        try:
            settings = tier_config.tier_settings(
                self.config, self.device, host_outside=self.layout.pipeline_bytes(),
                specs=specs, params_to_device=not self.host_compute,
                lent_buffers=LENT_POOL_BUFFERS if self.lends else 0)
            self.manager = TierManager(specs, settings, swap=self.swap)
        except BaseException:
            self.close()
            raise

    def _place(self, key: str, pend: _Pending) -> None:
        mgr = self._mgr()
        mgr.place(f"{key}:param", pend.init.to(pend.compute_dtype)).wait()
        if not pend.trainable:
            return
        zeros = torch.zeros_like(pend.init)
        for kind in self.layout.kinds(key)[1:]:  # the optimizer's (no master if bf16)
            src = pend.init if kind == "master" else zeros
            if kind == "grad":  # [Note: gradient precision] in shards/grad_precision.py
                src = src.to(self.grad_dtype)
            for mkey, lo, hi in self.layout.pieces(key, kind):
                if self.layout.compressed(kind):  # all-zero bytes decode to zero moments
                    mgr.place(mkey, torch.zeros(moment_nbytes(hi - lo, self.state_precision),
                                                dtype=torch.uint8)).wait()
                else:
                    mgr.place(mkey, src[lo:hi]).wait()
        if not self.optimizer_offloaded:
            for kind in self.layout.kinds(key)[1:]:
                self._views[(key, kind)] = mgr.pin(f"{key}:{kind}", "device").wait()

    def _mgr(self) -> TierManager:
        if self.manager is None:
            raise RuntimeError("TieredShardStore used before finalize(): the tier manager "
                               "is built once every shard group is added")
        return self.manager

    # -- access ------------------------------------------------------------------------
    def tier_for(self, key: str, kind: TensorClass, *, compute: bool = True) -> Tier:
        """Where `kind` is read or written: param for compute (gathers) on the device,
        unless the device is host memory ([Note: params gathered from host memory]);
        otherwise on its home, host for anything below it.

        [Note: params gathered from host memory] When the compute device's memory is host
        memory (a CPU run, or a dry run planning one), a param shard homed in host memory
        or on NVMe is gathered from its host copy: its home, or the host cache an NVMe read
        fills (a pool buffer). The "device" tier is host memory too, so a copy into it
        would only add an allocation and a host-to-host copy of every gathered byte (the
        gather copies the shard into the unit's full buffer anyway); the NVMe read-ahead
        (the NVMe window, into the pool) is the gather's prefetch. A shard homed on the
        device (offload none) stays there. With CUDA the param is copied to the device
        first, where the all-gather reads it."""
        home = self._mgr().home_of(self.layout.pieces(key, kind)[0][0])
        if kind == "param" and compute and not self.host_compute:
            return "device"
        return "device" if home == "device" else "host"

    def tensor(self, key: str, kind: TensorClass) -> torch.Tensor:
        self.layout.check(key, kind)
        view = self._views.get((key, kind))
        if view is None:
            raise RuntimeError(f"shard {key!r}/{kind} lives in the tier manager (home "
                               f"{self._mgr().home_of(f'{key}:{kind}')}); read it with "
                               "store.use(key, kind), which fetches and releases it")
        return self._zero_if_marked(key, kind, view)  # [Note: gradients zeroed on first use]

    @contextmanager
    def use(self, key: str, kind: TensorClass, *, writable: bool = False,
            compute: bool = True, overwrite: bool = False, as_reduced: bool = False,
            raw: bool = False) -> Iterator[torch.Tensor]:
        """`compute=False`: not for a gather, so param is reached on its home tier (host
        for NVMe) instead of being copied to the device first. `overwrite=True` (implies
        writable): the caller writes every element, so old data need not be read
        (TierManager.fetch discard); the view's contents are undefined until then.
        A gradient marked zero is fetched without a read and zeroed (unless `overwrite`);
        `as_reduced` reads its bytes as they are ([Note: gradients zeroed on first use]).
        A compressed moment (`layout.compressed(kind)`) is handed out decoded to fp32 and,
        when writable, encoded back on exit; `raw=True` hands out its stored bytes instead
        (one piece only: the CPU Adam's in-place step)."""
        fresh = kind == "grad" and not as_reduced and self.grad_zeroed(key)
        with self._access(key, kind, writable=writable or fresh, compute=compute,
                          overwrite=overwrite or fresh, raw=raw) as t:
            yield t if not fresh else self._zero_if_marked(key, kind, t, overwrite=overwrite)

    def lend(self, key: str) -> torch.Tensor | None:
        """The param shard's host cache, held until end_lend ([Note: a gather viewing the
        pool's buffer] in shards/lent.py), where the gather would copy it out of the
        pool (`lends`: a CPU compute device, one rank, params on NVMe): the shard in one
        piece that takes one pool buffer, in a pool that got its lent buffers (a tight
        host budget may have cut it)."""
        self.layout.check(key, "param")
        pieces = self.layout.pieces(key, "param")
        if not self.lends or (key, "param") in self._views or len(pieces) != 1:
            return None
        mgr, mkey = self._mgr(), pieces[0][0]
        if mgr.home_of(mkey) != "nvme":
            return None
        span, count = mgr.pool_spans(mkey)
        if span != 1 or count < LEND_POOL_SPANS + LENT_POOL_BUFFERS:
            return None
        return mgr.fetch(mkey, "host").wait()

    def end_lend(self, key: str) -> None:
        self._mgr().release(self.layout.pieces(key, "param")[0][0], "host")

    @contextmanager
    def _access(self, key: str, kind: TensorClass, *, writable: bool, compute: bool,
                overwrite: bool, raw: bool) -> Iterator[torch.Tensor]:
        """use() without the gradient marks."""
        self.layout.check(key, kind)
        view = self._views.get((key, kind))
        if view is not None:
            yield view
            return
        pieces = self.layout.pieces(key, kind)
        if self.layout.compressed(kind) and not raw:
            with self._use_decoded(key, kind, pieces, writable=writable or overwrite,
                                   overwrite=overwrite) as t:
                yield t
            return
        if raw and len(pieces) > 1:
            raise KeyError(f"shard group {key!r} keeps its {kind} in {len(pieces)} pieces; "
                           "raw access takes one piece (use pieces())")
        if len(pieces) > 1:
            with self._use_pieces(key, pieces, writable=writable or overwrite,
                                  overwrite=overwrite) as t:
                yield t
            return
        mgr, mkey = self._mgr(), f"{key}:{kind}"
        tier = self.tier_for(key, kind, compute=compute)
        t = mgr.fetch(mkey, tier, writable=writable or overwrite, discard=overwrite).wait()
        try:
            yield t
        finally:
            mgr.release(mkey, tier)

    @contextmanager
    def _use_pieces(self, key: str, pieces: Pieces, *, writable: bool,
                    overwrite: bool) -> Iterator[torch.Tensor]:
        """A whole fp32 shard kept in pieces, assembled in one host buffer (read piece by
        piece; written back piece by piece when ``writable``). For whole-shard access off the
        step (checkpoints, param from master): one shard at a time, counted as the
        manager's (TierManager.host_empty)."""
        with self._assembled(self.layout.numel(key), torch.float32, pieces, read=not overwrite,
                             write=writable) as whole:
            yield whole

    @contextmanager
    def _assembled(self, numel: int, dtype: torch.dtype, ranges: Pieces,
                   *, read: bool, write: bool) -> Iterator[torch.Tensor]:
        """One host buffer over several stored pieces (`ranges`: the manager's key and
        where its elements sit in the buffer), read piece by piece first when `read` and
        written back piece by piece on a normal exit when `write`; counted as the
        manager's (TierManager.host_empty)."""
        mgr = self._mgr()
        whole = mgr.host_empty(numel, dtype, purpose="shard_assembly")
        try:
            if read:
                for t in [mgr.read_into(mkey, whole[a:b]) for mkey, a, b in ranges]:
                    t.wait()
            yield whole
            if write:
                for t in [mgr.write_from(mkey, whole[a:b]) for mkey, a, b in ranges]:
                    t.wait()
        finally:
            mgr.host_free(whole)

    @contextmanager
    def _use_decoded(self, key: str, kind: TensorClass, pieces: Pieces, *,
                     writable: bool, overwrite: bool) -> Iterator[torch.Tensor]:
        """A compressed moment as one fp32 host buffer: each piece read and decoded, and
        encoded and written back when ``writable`` (state_codec.decode / encode: exact
        decoding; encoding decoded values gives them back, see [Note: 8-bit moment codes])."""
        mgr, prec = self._mgr(), self.state_precision
        whole = mgr.host_empty(self.layout.numel(key), torch.float32, purpose="shard_assembly")
        try:
            for mkey, lo, hi in pieces if not overwrite else ():
                buf = mgr.host_empty(moment_nbytes(hi - lo, prec), torch.uint8,
                                     purpose="shard_assembly")
                try:
                    mgr.read_into(mkey, buf).wait()
                    decode(kind, buf, whole[lo:hi], prec)
                finally:
                    mgr.host_free(buf)
            yield whole
            for mkey, lo, hi in pieces if writable else ():
                buf = mgr.host_empty(moment_nbytes(hi - lo, prec), torch.uint8,
                                     purpose="shard_assembly")
                try:
                    encode(kind, whole[lo:hi], buf, prec, offset=lo)
                    mgr.write_from(mkey, buf).wait()
                finally:
                    mgr.host_free(buf)
        finally:
            mgr.host_free(whole)

    @contextmanager
    def use_stored(self, key: str, kind: TensorClass, *,
                   overwrite: bool = False) -> Iterator[torch.Tensor]:
        """A compressed moment's stored bytes, every piece's in order, in one host buffer
        (read piece by piece; written back piece by piece when `overwrite`): what a
        checkpoint holds, with no decoding. Other kinds: `use(compute=False)`."""
        if not self.layout.compressed(kind) or (key, kind) in self._views:
            with self.use(key, kind, compute=False, writable=overwrite,
                          overwrite=overwrite) as t:
                yield t
            return
        byte_ranges, pos = self.layout.stored_ranges(key, kind)  # in element order
        with self._assembled(pos, torch.uint8, byte_ranges, read=not overwrite,
                             write=overwrite) as whole:
            yield whole

    # -- what the ShardStore interface asks of the layout -------------------------------
    def version(self, key: str, kind: TensorClass) -> int | None:
        """The tier manager's version of a class kept in one piece (None for pieces)."""
        if len(self.layout.pieces(key, kind)) != 1:
            return None
        return self._mgr().version(self.layout.manager_key(key, kind))

    def moment_layout(self, key: str, kind: TensorClass) -> StoredLayout:
        return self.layout.moment_layout(key, kind)

    def has(self, key: str, kind: TensorClass) -> bool:
        return self.layout.has(key, kind)

    def group_keys(self) -> list[str]:
        return self.layout.group_keys()

    def numel(self, key: str) -> int:
        return self.layout.numel(key)

    def param_dtype(self, key: str) -> torch.dtype:
        return self.layout.param_dtype(key)

    def pieces(self, key: str, kind: TensorClass) -> Pieces:
        return self.layout.pieces(key, kind)

    def nbytes(self) -> dict[str, int]:
        return self.layout.nbytes()

    @property
    def master_precision(self) -> str:
        """fp32, or bf16: the param is the master ([Note: bf16 master weights])."""
        return self.layout.master_precision

    def write_param_from_master(self, key: str) -> None:
        if not self.layout.has(key, "master"):  # a bf16 master: param is the master
            return
        with self.use(key, "master") as master, self.use(
                key, "param", compute=False, overwrite=True) as p16:
            p16.copy_(master)

    def tier_report(self) -> dict[str, object] | None:
        if self.manager is None:
            return None
        r = self.manager.memory_report()
        plan = self.manager.plan
        homes: dict[str, dict[str, int]] = {}  # class -> tier -> bytes homed there
        for key, spec in plan.specs.items():
            by_tier = homes.setdefault(spec.cls, {})
            by_tier[plan.homes[key]] = by_tier.get(plan.homes[key], 0) + spec.nbytes
        grads = homes.get("grad", {})
        return {"homes": homes,
                # where the gradient shards live ([Note: gradient home]): host, nvme,
                # or "host+nvme" when the host budget kept only some in host memory
                "grad_home": "+".join(t for t in ("device", "host", "nvme") if grads.get(t))
                             or None,
                # offload.params.max_in_cpu_bytes: param bytes homed in host, not NVMe
                "params_in_cpu": sum(plan.specs[k].nbytes for k in plan.host_kept
                                     if plan.specs[k].cls == "param"),
                "budget": dict(r.budget), "current": dict(r.current), "peak": dict(r.peak),
                # host buffers outside the budgeted tier (CPU Adam ring, ...) by purpose
                "outside": dict(r.outside), "outside_peak": r.outside_peak,
                "moved": dict(r.moved),
                "moved_by_class": {d: dict(c) for d, c in r.moved_by_class.items()},
                "stall_s": r.stall_s, "hits": r.hits,
                "misses": r.misses, "prefetches": r.prefetches, "evictions": r.evictions,
                "writebacks": r.writebacks, "order_mismatches": r.order_mismatches}

    def set_order(self, entries: list[tuple[str, TensorClass]]) -> None:
        """A fresh gradient shard is overwritten by its reduction, never read: no read-ahead
        for it ([Note: gradients zeroed on first use])."""
        mgr = self._mgr()
        mgr.set_order([(mkey, self.tier_for(k, kind)) for k, kind in entries
                       if not (kind == "grad" and self.grad_zeroed(k))
                       for mkey, _, _ in self.layout.pieces(k, kind)])

    def close(self) -> None:
        try:
            if self.manager is not None:
                for (key, kind) in list(self._views):
                    self.manager.unpin(f"{key}:{kind}", "device")
                self._views.clear()
                self.manager.close()
        finally:
            self.manager = None
            if self.swap is not None:
                self.swap.close()
                self.swap = None
